"""What the gather kernels share: the problem, its config, its cost and the backward's plan.

Every gather is seen through a free reshape of `x` to a 3-D table `(batch, n, columns)`:
`batch` is the product of the dims before `axis`, `n` the gathered axis, `columns` the product
of the dims after it. `axis=0` is `(1, n, columns)` (an embedding table), the last axis is
`(batch, n, 1)`. No case transposes the table. The indices are flattened to `(m,)` int32 by
`reference.gather.bounded_indices`, which keeps each index's outcome under the mode; the
kernels then count negative indices from the end and apply the mode themselves.

Kernel modes: the six public modes reduce to three rules a kernel implements.
  forward "clip": out-of-range rows read the edge row   (None, "promise_in_bounds", "clip")
  forward "fill": out-of-range rows read `fill`          ("drop", "fill")
  forward "wrap": rows are taken modulo n                ("wrap")
and the backward scatter-add follows JAX's transpose of each public mode:
  scatter "drop": out-of-range rows add nothing          (None, "promise_in_bounds", "drop", "fill")
  scatter "clip": out-of-range rows add into the edge row ("clip")
  scatter "wrap": rows are taken modulo n                ("wrap")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


FORWARD_MODE = {None: "clip", "promise_in_bounds": "clip", "clip": "clip", "drop": "fill",
                "fill": "fill", "wrap": "wrap"}
SCATTER_MODE = {None: "drop", "promise_in_bounds": "drop", "clip": "clip", "drop": "drop",
                "fill": "drop", "wrap": "wrap"}
# The transpose of a scatter-add is a gather with the matching forward rule; dropped rows
# gather zero.
TRANSPOSED_MODE = {"drop": "fill", "clip": "clip", "wrap": "wrap"}


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Block sizes of the gather and scatter-add kernels; `None` fields are picked from shapes.

    Each implementation reads the fields it names and ignores the others.

    block_indices: triton: indices one program gathers in the forward. mosaic_gpu: ids one
      forward CTA gathers (at most 2048: it stages them in shared memory), rounded up to
      whole tiles of its ring. (mosaic stages indices 128 at a time, one SMEM tile, and takes
      no other value.)
    block_columns: triton: table columns one program handles, forward and backward (a power
      of 2). mosaic: columns one backward grid step accumulates (a multiple of 128 dividing
      the row length, or the whole row). mosaic_gpu: columns one forward CTA walks (rounded
      up to whole pieces of 256).
    block_batch: mosaic forward: leading slices (the dims before `axis`) one DMA copies.
    block_rows: mosaic backward: table rows one grid step owns (a multiple of the dtype's
      sublane tile, or all of them). mosaic_gpu backward: table rows one CTA owns (at most
      256).
    num_warps, num_stages: triton: compiler params.
    """

    block_indices: int | None = None
    block_columns: int | None = None
    block_batch: int | None = None
    block_rows: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


class Problem(NamedTuple):
    """One gather (or its scatter-add) on the `(batch, n, columns)` view of the table."""

    batch: int
    n: int
    columns: int
    num_indices: int
    dtype: Any          # the table's dtype (bool is carried as uint8 inside the kernels)
    mode: str           # forward rule: "clip", "fill" or "wrap"
    fill: bytes | None  # mode "fill": the fill value's bytes in `dtype` (see `fill_bits`)

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def fill_value(self) -> np.generic:
        """The fill for out-of-range rows (0 outside mode "fill": never read then)."""
        return fill_scalar(self.fill, self.dtype) if self.fill else np.zeros((), self.dtype)[()]


def fill_bits(fill_value: Any, dtype: Any) -> bytes:
    """`fill_value` converted to `dtype` as JAX's gather converts it (XLA's conversion: integers
    wrap, floats truncate toward zero and saturate into an integer dtype, NaN becomes 0), as
    raw bytes, so that a NaN fill still compares equal and the static arguments hash
    consistently. Computed with NumPy: tracing an op executes nothing."""
    dtype = np.dtype(dtype)
    value = np.asarray(fill_value)
    if value.dtype.kind in "fc" and dtype.kind in "iu":
        # Compared as Python numbers: float(info.max) of a 64-bit type rounds up past it.
        info, number = np.iinfo(dtype), float(np.nan_to_num(np.trunc(value.real), nan=0.0))
        value = np.asarray(info.max if number >= info.max else
                           info.min if number <= info.min else int(number))
    elif value.dtype.kind == "c" and dtype.kind != "c":
        value = value.real
    return value.astype(dtype).tobytes()


def fill_scalar(fill: bytes, dtype: Any) -> np.generic:
    """The value stored by `fill_bits`, as a NumPy scalar of `dtype`."""
    return np.frombuffer(fill, np.dtype(dtype))[0]


def table_view(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def gather_bytes(p: Problem) -> int:
    """Minimum traffic: each gathered row read once, the output written once, the indices
    read once."""
    return 2 * p.batch * p.num_indices * p.columns * p.itemsize + 4 * p.num_indices


def scatter_bytes(p: Problem) -> int:
    """Minimum traffic: the cotangent read once, the table gradient written once, the sorted
    indices, their order and the segment starts read once."""
    return ((p.batch * p.num_indices + p.batch * p.n) * p.columns * p.itemsize
            + 8 * p.num_indices + 4 * (p.n + 1))


def row_of_index(index: jax.Array, n: int, mode: str) -> tuple[jax.Array, jax.Array]:
    """(row, in_range) for int32 `index` into n rows under a kernel rule; row is always in
    [0, n). Works on scalars (Mosaic, Mosaic GPU) and vectors (Triton) alike; nothing
    overflows: only a negative index has n added, which stays within int32."""
    if mode == "wrap":
        row = jax.lax.rem(index, jnp.int32(n))
        row = jnp.where(row < 0, row + n, row)
        return row, jnp.ones_like(index, dtype=jnp.bool_)
    row = jnp.where(index < 0, index + n, index)
    in_range = (row >= 0) & (row < n)
    return jnp.clip(row, 0, n - 1), in_range


class ScatterPlan(NamedTuple):
    """The backward's schedule, computed in the wrapper with XLA (a sort of the small index
    vector, not of the table): the positions of the indices in order of target row (stable, so
    duplicates are summed in a fixed order and every run gives the same bits) and, per
    table row r, where its segment starts: row r's cotangent rows are
    `order[row_starts[r]:row_starts[r + 1]]`. Dropped indices sort past the last row."""

    order: jax.Array       # (m,) int32
    targets: jax.Array     # (m,) int32 sorted target rows, n for dropped ones
    row_starts: jax.Array  # (n + 1,) int32


def scatter_targets(indices: jax.Array, n: int, scatter_mode: str) -> jax.Array:
    """Target row of each index under the scatter rule; n (past the table) when dropped."""
    row, in_range = row_of_index(indices, n, "wrap" if scatter_mode == "wrap" else "clip")
    if scatter_mode == "drop":
        row = jnp.where(in_range, row, n)
    return row.astype(jnp.int32)


def scatter_plan(indices: jax.Array, n: int, scatter_mode: str) -> ScatterPlan:
    """One sort of the (m,) targets, then the segment starts from their counts: O(m + n), and
    no loop (`jnp.searchsorted`'s default method is a while loop of about log2(m) steps)."""
    targets = scatter_targets(indices, n, scatter_mode)
    order = jnp.argsort(targets, stable=True).astype(jnp.int32)
    hits = jnp.zeros((n,), jnp.int32).at[targets].add(1, mode="drop")  # dropped ones: n
    row_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(hits, dtype=jnp.int32)])
    return ScatterPlan(order, targets[order], row_starts)


class Pieces(NamedTuple):
    """How a backward bounds each table row's work: a row's first `length` sorted positions are
    summed by its owner; the rest are cut into pieces of `length` positions, `count` at most
    (a static bound: (m - 1) // length), each summed by its own program into a float32
    partial row that the owner adds."""

    length: int
    count: int


class PieceTable(NamedTuple):
    """Per table row r, its pieces are rows row_pieces[r]:row_pieces[r + 1] of the partials;
    piece q covers sorted positions bounds[q, 0]:bounds[q, 1] (empty past the last piece)."""

    row_pieces: jax.Array  # (n + 1,) int32
    bounds: jax.Array      # (count, 2) int32


def piece_table(plan: ScatterPlan, p: Problem, pieces: Pieces) -> PieceTable:
    """The pieces of the rows hit more than `pieces.length` times, with XLA (O(m + n))."""
    hits = plan.row_starts[1:] - plan.row_starts[:-1]
    extra = jnp.maximum(hits - 1, 0) // pieces.length
    row_pieces = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                  jnp.cumsum(extra).astype(jnp.int32)])
    # Each piece's row: mark each row's first piece with the row, then a running max (no
    # search loop). Unused pieces past row_pieces[n] get the last row and are masked below.
    piece = jnp.arange(pieces.count, dtype=jnp.int32)
    first_piece = jnp.where(extra > 0, row_pieces[:-1], pieces.count)
    row = lax.cummax(jnp.zeros((pieces.count,), jnp.int32).at[first_piece].max(
        jnp.arange(p.n, dtype=jnp.int32), mode="drop"))
    start = plan.row_starts[row] + pieces.length * (piece - row_pieces[row] + 1)
    stop = jnp.minimum(start + pieces.length, plan.row_starts[row + 1])
    used = piece < row_pieces[p.n]
    bounds = jnp.stack([jnp.where(used, start, 0), jnp.where(used, stop, 0)], axis=1)
    return PieceTable(row_pieces, bounds.astype(jnp.int32))


def accumulator_dtype(dtype: Any) -> Any:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def check_int(config: GatherConfig, field: str) -> None:
    value = getattr(config, field)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise ValueError(f"config.{field} must be a positive int or None, got {value!r}")
