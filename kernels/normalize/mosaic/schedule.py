"""The grid, block specs and masks both normalize passes run on (`forward.py`, `backward.py`;
their sizes come from `config.py`).

Block schedule (forward and backward alike)
-------------------------------------------
grid = (outer · ranges, blocks_per_range, phases, num_chunks), semantics ("parallel",
"arbitrary", "arbitrary", "arbitrary"), num_chunks = cdiv(reduced, block_reduced). With one
chunk per group the cdiv(groups, block_groups) group blocks are cut into ranges of consecutive
blocks, one per TensorCore (`core_ranges`: 2 on a megacore v4, else 1; a short last range's
extra step repeats its last block, and its masked groups add nothing); a core walks its range
in order, adding each block's dscale/doffset column sums into one partial row that stays in
VMEM. With two phases each block is its own range: phase 0 walks the chunks accumulating in
VMEM scratch, phase 1 walks them again and writes the output (what each pass accumulates and
writes: `forward.py`, `backward.py`). The output's index map sends every phase-0 step to chunk
0, which phase 1 writes first, so each output block is written back once, after it is final.
Statistics and their cotangents are (1, block_groups) blocks, lane-dense in both layouts (see
`Schedule.stats_spec`), and so are the scale/offset chunks and the partial dscale/doffset rows,
(1, block_reduced) in both layouts (`Schedule.param_spec`).

Ragged edges: padding past `reduced` may hold anything (NaN in TPU interpret mode), so it is
masked out of every sum; padding past `groups` computes garbage whose writes are dropped, and
is masked out of the backward's dscale/doffset sums. Each range writes its own partial dscale
and doffset row of shape (1, reduced) once; XLA sums the rows afterwards (no atomics: the same
result on every run). One chunk per group: outer · ranges rows (1 for a layer norm on a v5e,
however many blocks); two phases: one per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import core_ranges, range_block
from kernels._pallas import pl
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["SEMANTICS", "Schedule", "lane_dense", "all_valid", "and_masks", "zero_invalid"]


# A core walks its range of blocks in order: the backward's partial rows accumulate across
# them, and a short range's repeated block revisits its outputs (in order, so written back once).
SEMANTICS = ("parallel", "arbitrary", "arbitrary", "arbitrary")


class Schedule:
    """Grid, block specs and in-kernel masks of one problem and config."""

    def __init__(self, p: Problem, config: NormalizeConfig):
        self.p, self.block_groups, self.block_reduced = p, config.block_groups, config.block_reduced
        self.num_blocks = pl.cdiv(p.groups, config.block_groups)
        self.num_chunks = pl.cdiv(p.reduced, config.block_reduced)
        self.phases = 1 if self.num_chunks == 1 else 2
        # Two phases walk every chunk of a block before the next block, so a partial row
        # could not stay in VMEM from block to block: there each block is its own range.
        self.num_ranges, self.blocks_per_range = (
            core_ranges(self.num_blocks) if self.phases == 1 else (self.num_blocks, 1))
        self.num_partials = p.outer * self.num_ranges
        self.grid = (self.num_partials, self.blocks_per_range, self.phases, self.num_chunks)

    def orient(self, group_part, reduced_part):
        return (group_part, reduced_part) if self.p.rows else (reduced_part, group_part)

    def _slab_and_block(self, u, k):
        """(slab, group block) of grid step (u, k, ...) (`range_block`)."""
        return u // self.num_ranges, range_block(u % self.num_ranges, k, self.blocks_per_range,
                                                 self.num_blocks)

    def _chunk(self, phase, c, last_phase: bool):
        """The chunk a block visits at step (phase, c): one used in the last phase only stays
        on chunk 0 through phase 0, so it moves once per chunk, when it is used."""
        return c * phase if last_phase and self.phases == 2 else c

    def tile_spec(self, last_phase: bool = False) -> pl.BlockSpec:
        """x, residual, dy, y, sum, dx, dsum. A block used in the last phase only (an output,
        or dsum) stays on chunk 0 during phase 0: an output is then written back once, after
        it is final, and an input fetched once."""
        def index(u, k, phase, c):
            o, b = self._slab_and_block(u, k)
            return (o, *self.orient(b, self._chunk(phase, c, last_phase)))
        return pl.BlockSpec((None, *self.orient(self.block_groups, self.block_reduced)), index)

    def stats_spec(self) -> pl.BlockSpec:
        """Statistics as lane-dense rows. In the columns layout they are (outer, 1, groups)
        already. In the rows layout a (groups, 1) array would be tiled (8, 128) with one lane
        in use, 128x its bytes in HBM (4 MiB instead of 32 KiB per statistic at 8192 rows), so
        the kernels see (outer * num_blocks, 1, block_groups) (`to_kernel_stats`) and
        transpose each block's column in VMEM (`load_stats`, `store_stats`). Outside the
        kernels XLA keeps (groups, 1) dense (lanes along groups), so the reshapes between the
        two are small copies of the statistics alone."""
        def index(u, k, phase, c):
            o, b = self._slab_and_block(u, k)
            return (o * self.num_blocks + b, 0, 0) if self.p.rows else (o, 0, b)
        return pl.BlockSpec((None, 1, self.block_groups), index)

    def kernel_stats_shape(self) -> tuple[int, int, int]:
        if not self.p.rows:
            return self.p.stats_shape
        return (self.p.outer * self.num_blocks, 1, self.block_groups)

    def to_kernel_stats(self, stats: jax.Array | None) -> jax.Array | None:
        """`p.stats_shape` statistics as the kernels read them (groups padded to whole blocks)."""
        if stats is None or not self.p.rows:
            return stats
        padded = self.num_blocks * self.block_groups - self.p.groups
        stats = jnp.pad(stats, ((0, 0), (0, padded), (0, 0))) if padded else stats
        return stats.reshape(self.kernel_stats_shape())

    def from_kernel_stats(self, stats: jax.Array) -> jax.Array:
        if not self.p.rows:
            return stats
        flat = stats.reshape(self.p.outer, self.num_blocks * self.block_groups)
        return flat[:, :self.p.groups].reshape(self.p.stats_shape)

    def load_stats(self, ref) -> jax.Array:
        """A statistics block, shaped to broadcast against a tile."""
        return ref[...].T if self.p.rows else ref[...]

    def store_stats(self, ref, value: jax.Array) -> None:
        ref[...] = (value.T if self.p.rows else value).astype(ref.dtype)

    def param_spec(self, last_phase: bool = False) -> pl.BlockSpec:
        """scale/offset as lane-dense (1, reduced) rows in both layouts (`load_param` turns a
        chunk into the columns layout's (block_reduced, 1) in VMEM): a (reduced, 1) array
        is tiled 128 lanes wide in HBM, 128x its bytes (512 MiB for a float32 scale of the
        1M-element groups of a (1M, 64) standardization over axis 0). `last_phase`: used in
        phase 1 only (the forward's), so phase 0 does not fetch each chunk."""
        def index(u, k, phase, c):
            return (0, self._chunk(phase, c, last_phase))
        return pl.BlockSpec((1, self.block_reduced), index)

    def load_param(self, ref, dtype) -> jax.Array | None:
        """A scale/offset chunk, shaped to broadcast against a tile (None for an absent one)."""
        if ref is None:
            return None
        value = ref[...].astype(dtype)
        return value if self.p.rows else value.T

    def partial_spec(self) -> pl.BlockSpec:
        """One lane-dense (1, block_reduced) chunk of partial row u (as `param_spec`) per step
        (u, k, phase, c): the same block through a range's blocks k, so it stays in VMEM and
        is written back once, at the range's end."""
        def index(u, k, phase, c):
            return (u, 0, self._chunk(phase, c, last_phase=True))
        return pl.BlockSpec((None, 1, self.block_reduced), index)

    def add_partial(self, ref, value: jax.Array) -> None:
        """Adds a tile's column sums, (1, block_reduced) or (block_reduced, 1), to the range's
        partial row, zeroed at the range's first block."""
        @pl.when(pl.program_id(1) == 0)
        def _():
            ref[...] = jnp.zeros_like(ref)

        ref[...] += value if self.p.rows else value.T

    def reduced_valid(self, shape) -> jax.Array | None:
        """Mask of the elements of this step's chunk inside `reduced`; None if all are."""
        if self.p.reduced % self.block_reduced == 0:
            return None
        axis = self.p.reduce_axis
        index = pl.program_id(3) * self.block_reduced + lax.broadcasted_iota(jnp.int32, shape,
                                                                             axis)
        return index < self.p.reduced

    def group_valid(self, shape) -> jax.Array | None:
        """Mask of this step's groups inside `groups` (none on a range's extra step); None if
        all are."""
        if (self.p.groups % self.block_groups == 0
                and self.num_ranges * self.blocks_per_range == self.num_blocks):
            return None
        # The step's block before the clamp: past the last one on an extra step, whose
        # groups are then all masked.
        block = (pl.program_id(0) % self.num_ranges) * self.blocks_per_range + pl.program_id(1)
        axis = 1 - self.p.reduce_axis
        index = block * self.block_groups + lax.broadcasted_iota(jnp.int32, shape, axis)
        return index < self.p.groups


def lane_dense(param: jax.Array | None) -> jax.Array | None:
    """A `p.param_shape` scale/offset as the (1, reduced) row the kernels read."""
    return None if param is None else param.reshape(1, -1)


def all_valid(shape) -> jax.Array:
    return jnp.ones(shape, jnp.bool_)


def and_masks(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def zero_invalid(x: jax.Array, valid: jax.Array | None) -> jax.Array:
    return x if valid is None else jnp.where(valid, x, jnp.zeros_like(x))
