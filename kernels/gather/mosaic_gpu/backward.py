"""The scatter-add gradient of gather as Pallas kernels lowered through Mosaic GPU (sm_90a,
sm_100a) (the package's docstring has both kernels' loop nests).

Block schedule (deterministic scatter-add)
------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`: `order` lists the index
positions by target row, `row_starts` delimits each table row's segment) and bounds each
row's work as the Triton backward does (`common.Pieces`, `common.piece_table`): a row's first
`length` positions (about sqrt(m)) are its owner's, the rest are cut into pieces of `length`
positions. XLA also lists the owners' positions compacted (`_owner_walk`: `walk`, with
`walk_starts` per row), so that a block of table rows owns one contiguous range of it, as a
block of pieces owns one contiguous range of partial rows. Both kernels sum contiguous ranges
of rows through `_Ring`: one-row slots in shared memory, a barrier each, `slots` rows in flight
by TMA, each row's sum in float32 registers.

    scatter_add_pieces (launched when some row may be hit more than `length` times),
    CTA (b, piece q, column piece k):
        partials[b, q, k] = sum(g[b, order[s], k] for s in q's positions)
    scatter_add, CTA (b, block of tile_rows table rows, column piece k):
        for each row r of the block:
            acc = sum(g[b, walk[s], k] for s in walk_starts[r] .. walk_starts[r + 1])
            acc += sum(partials[b, q, k] for q in r's pieces)
            tile[r - first row] = acc                          # shared memory
        TMA: tile -> dx[b, block, k]

Every table row is written once, zeros included, by the CTA that owns it; dropped indices sort
past the last row and are never read. No atomics: each output element has one writer and a
fixed summation order (the stable sort's), so every run gives the same bits. No CTA walks more
than about 2 sqrt(m) rows, whatever the ids.

Memory traffic (`_cost`): each cotangent row read once (by its owner or by one piece), the
pieces' float32 partial rows written and read once, the table gradient written once, the
positions and segment starts once per column piece. Rows that are not a multiple of 16 bytes
(TMA's stride rule) are padded: a copy of the cotangent before the launches and of the
gradient after them, by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, load, mosaic_gpu_call, pad_to,
                                        piece_columns, row_layout, smem, store, stored_shape)
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, accumulator_dtype,
                                   piece_table)
from kernels.gather.mosaic_gpu.config import BackwardPlan, backward_plan

__all__ = ["scatter_add"]

_LAYOUT_ITEMSIZE = 4  # a (1, PIECE) float32 row in registers: 2 values a thread


class _Ring:
    """Positions [start, stop) of a walk, position s being row `row_of(s)` of `source[batch]`
    (a GMEM ref (batch, rows, aligned)), piece `piece` of it moved by TMA into `slots`
    (slots, PIECE) shared memory, a barrier each; a position's slot is (s - start) % slots,
    refilled with position s + slots once every thread has read it."""

    def __init__(self, source, row_of, batch, piece, slots, barriers, start, stop):
        self.source, self.row_of, self.batch, self.piece = source, row_of, batch, piece
        self.slots, self.barriers, self.start, self.stop = slots, barriers, start, stop
        self.depth = slots.shape[0]
        self.layout = row_layout(1, PIECE, _LAYOUT_ITEMSIZE)

    def _load(self, position) -> None:
        @pl.when(position < self.stop)
        def _():
            slot = (position - self.start) % self.depth
            plgpu.copy_gmem_to_smem(
                self.source.at[self.batch, pl.ds(self.row_of(position), 1),
                               piece_columns(self.piece)],
                self.slots.at[pl.ds(slot, 1)], self.barriers.at[slot])

    def prefetch(self) -> None:
        """Starts loading the first `depth` positions."""
        def load_one(position, carry):
            self._load(position)
            return carry

        jax.lax.fori_loop(self.start, self.start + self.depth, load_one, 0)

    def total(self, first, last, acc: jax.Array) -> jax.Array:
        """acc + the rows of positions [first, last), which must be the walk's next ones."""
        def add(position, acc):
            slot = (position - self.start) % self.depth
            plgpu.barrier_wait(self.barriers.at[slot])
            row = load(self.slots.at[pl.ds(slot, 1)], self.layout)
            plgpu.commit_smem()  # every thread has read the slot: it may be refilled
            self._load(position + self.depth)
            return acc + row.astype(acc.dtype)

        return jax.lax.fori_loop(first, last, add, acc)

    def zeros(self) -> jax.Array:
        return plgpu.layout_cast(jnp.zeros((1, PIECE), jnp.float32), self.layout)


def _write_tile(tile, destination) -> None:
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, destination)
    plgpu.wait_smem_to_gmem(0)


def _pieces_body(order_ref, bounds_ref, g_ref, partials_ref, slots, tile, barriers,
                 plan: BackwardPlan) -> None:
    """One CTA of the pieces kernel: one piece of positions, one piece of columns."""
    program = jax.lax.axis_index("pieces")
    piece, rest = program % plan.num_pieces, program // plan.num_pieces
    batch, q = rest // plan.pieces.count, rest % plan.pieces.count
    start, stop = bounds_ref[q, 0], bounds_ref[q, 1]
    ring = _Ring(g_ref, lambda s: order_ref[s], batch, piece, slots, barriers, start, stop)
    ring.prefetch()
    store(tile, ring.total(start, stop, ring.zeros()))
    _write_tile(tile, partials_ref.at[batch, pl.ds(q, 1), piece_columns(piece)])


def _rows_body(*refs, p: Problem, plan: BackwardPlan) -> None:
    """One CTA of the scatter-add: `tile_rows` table rows, one piece of columns. Without
    pieces, it takes no partial rows and no ring for them."""
    if plan.pieces.count:
        (walk_ref, walk_starts_ref, row_pieces_ref, g_ref, partials_ref, dx_ref, slots, tile,
         barriers, partial_slots, partial_barriers) = refs
    else:
        walk_ref, walk_starts_ref, g_ref, dx_ref, slots, tile, barriers = refs
    program = jax.lax.axis_index("blocks")
    piece, block = program % plan.num_pieces, program // plan.num_pieces
    batch, first_row = block // plan.blocks, block % plan.blocks * plan.tile_rows
    last_row = jnp.minimum(first_row + plan.tile_rows, p.n)
    owned = _Ring(g_ref, lambda s: walk_ref[s], batch, piece, slots, barriers,
                  walk_starts_ref[first_row], walk_starts_ref[last_row])
    owned.prefetch()
    if plan.pieces.count:
        partials = _Ring(partials_ref, lambda s: s, batch, piece, partial_slots,
                         partial_barriers, row_pieces_ref[first_row], row_pieces_ref[last_row])
        partials.prefetch()

    # Rows no id lands on (most of a vocabulary's) stay zero: the tile starts so.
    zeros = jnp.zeros((plan.tile_rows, PIECE), jnp.float32)
    store(tile, plgpu.layout_cast(zeros, row_layout(plan.tile_rows, PIECE,
                                                     _LAYOUT_ITEMSIZE)).astype(tile.dtype))

    def sum_row(i, carry):
        row = jnp.minimum(first_row + i, p.n)  # rows past the table: empty ranges
        following = jnp.minimum(row + 1, p.n)
        start, stop = walk_starts_ref[row], walk_starts_ref[following]

        @pl.when(start < stop)  # a row with pieces has its first positions here too
        def _():
            acc = owned.total(start, stop, owned.zeros())
            if plan.pieces.count:
                acc = partials.total(row_pieces_ref[row], row_pieces_ref[following], acc)
            store(tile.at[pl.ds(i, 1)], acc.astype(tile.dtype))
        return carry

    jax.lax.fori_loop(0, plan.tile_rows, sum_row, 0)
    _write_tile(tile, dx_ref.at[batch, pl.ds(first_row, plan.tile_rows), piece_columns(piece)])


def _owner_walk(plan: ScatterPlan, n: int, length: int) -> tuple[jax.Array, jax.Array]:
    """(walk, walk_starts): the positions' cotangent rows (`order`) that row owners sum, each
    row's first `length`, compacted in sorted order, and where each row's begin (n + 1). With
    XLA, O(m + n), no loop."""
    hits = plan.row_starts[1:] - plan.row_starts[:-1]
    walk_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                   jnp.cumsum(jnp.minimum(hits, length), dtype=jnp.int32)])
    positions = jnp.arange(plan.order.shape[0], dtype=jnp.int32)
    row = jnp.minimum(plan.targets, n - 1)  # dropped positions (target n) are not kept
    rank = positions - plan.row_starts[row]
    kept = (plan.targets < n) & (rank < length)
    destination = jnp.where(kept, walk_starts[row] + rank, positions.shape[0])
    walk = jnp.zeros_like(plan.order).at[destination].set(plan.order, mode="drop")
    return walk, walk_starts


def _ring_scratch(plan: BackwardPlan, dtype) -> list:
    """A `_Ring`'s slots and barriers."""
    return [smem((plan.slots, PIECE), dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=plan.slots)]


def _sum_pieces(g, plan: ScatterPlan, bounds, p: Problem, schedule: BackwardPlan,
                interpret) -> jax.Array:
    """The pieces' float32 partial rows, (batch, count, aligned) (whole pieces of columns:
    each is stored as one run of GMEM, `stored_shape`)."""
    slots, barriers = _ring_scratch(schedule, g.dtype)
    dtype = accumulator_dtype(p.dtype)
    shape = stored_shape((p.batch, schedule.pieces.count, schedule.aligned), (1, PIECE))
    return mosaic_gpu_call(
        functools.partial(_pieces_body, plan=schedule),
        out_shape=[jax.ShapeDtypeStruct(shape, dtype)],
        grid=(p.batch * schedule.pieces.count * schedule.num_pieces,), grid_names=("pieces",),
        interpret=interpret, name="scatter_add_pieces_mosaic_gpu",
        scratch=[slots, smem((1, PIECE), dtype), barriers],
        flops_and_bytes=_pieces_cost(p, schedule))(plan.order, bounds, g)[0]


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    schedule = backward_plan(p, config)
    g = pad_to(g, schedule.aligned)
    slots, barriers = _ring_scratch(schedule, g.dtype)
    scratch = [slots, smem((schedule.tile_rows, PIECE), g.dtype), barriers]
    if schedule.pieces.count:
        table = piece_table(plan, p, schedule.pieces)
        partials = _sum_pieces(g, plan, table.bounds, p, schedule, interpret)
        operands = [*_owner_walk(plan, p.n, schedule.pieces.length), table.row_pieces, g,
                    partials]
        scratch += _ring_scratch(schedule, partials.dtype)
    else:  # every position is its row owner's
        operands = [plan.order, plan.row_starts, g]
    shape = stored_shape((p.batch, p.n, schedule.aligned), (schedule.tile_rows, PIECE))
    dx = mosaic_gpu_call(
        functools.partial(_rows_body, p=p, plan=schedule),
        out_shape=[jax.ShapeDtypeStruct(shape, g.dtype)],
        grid=(schedule.programs,), grid_names=("blocks",), interpret=interpret,
        name="scatter_add_mosaic_gpu", scratch=scratch,
        flops_and_bytes=_rows_cost(p, schedule))(*operands)[0]
    return dx[:, :p.n, :p.columns]


# Each cotangent row is read once, by its row's owner or by one piece, which the ids decide:
# the rows kernel's figure counts them all, the pieces kernel's only its partial rows, so that
# the two sum to what both move.


def _pieces_cost(p: Problem, plan: BackwardPlan) -> tuple[int, int]:
    """The partial rows written once, the positions and the pieces' bounds once per column
    piece."""
    partials = p.batch * plan.pieces.count
    return 0, partials * (plan.aligned * 4 + 8 * plan.num_pieces)


def _rows_cost(p: Problem, plan: BackwardPlan) -> tuple[int, int]:
    """One add per cotangent element; every cotangent row read once, the partial rows read
    once, the table gradient written once; the positions and the segment starts once per
    column piece."""
    rows, partials = p.batch * p.num_indices, p.batch * plan.pieces.count
    index_bytes = 4 * p.batch * plan.num_pieces * (p.num_indices + 2 * (p.n + 1))
    return rows * plan.aligned, ((rows + p.batch * p.n) * plan.aligned * p.itemsize
                                 + partials * plan.aligned * 4 + index_bytes)

