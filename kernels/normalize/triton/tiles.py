"""The tiles and the launch both normalize passes share (`forward.py`, `backward.py`): a
program's tile views and masks (`Tiles`), the chunk loops (`fold`, `split_range`), the split
statistics' shape (`split_shape`) and the one Triton launch (`launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import Split
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.triton.config import Schedule

__all__ = ["Tiles", "fold", "split_range", "split_shape", "launch"]


class Tiles:
    """Index arithmetic of one program's tiles: which groups, which chunk, which masks."""

    def __init__(self, p: Problem, config: NormalizeConfig, group_block):
        self.p, self.block_groups, self.block_reduced = p, config.block_groups, config.block_reduced
        self.group_start = group_block * config.block_groups
        self.group_valid = (self.group_start + jnp.arange(config.block_groups, dtype=jnp.int32)
                            < p.groups)

    def _orient(self, group_part, reduced_part):
        return (group_part, reduced_part) if self.p.rows else (reduced_part, group_part)

    def chunk_start(self, chunk) -> jax.Array:
        # A jnp scalar even for chunk 0: jax >= 0.11 rejects a slice whose static bounds pass
        # the array's edge, and a single chunk wider than `reduced` is one (a masked one).
        return jnp.asarray(chunk * self.block_reduced, jnp.int32)

    def reduced_valid(self, chunk) -> jax.Array:
        start = self.chunk_start(chunk)
        return start + jnp.arange(self.block_reduced, dtype=jnp.int32) < self.p.reduced

    def mask(self, chunk) -> jax.Array:
        groups, reduced = self._orient(self.group_valid, self.reduced_valid(chunk))
        return groups[:, None] & reduced[None, :]

    def view(self, ref, outer, chunk):
        """A `ref.at[...]` of the view-shaped array `ref`: this chunk of this program's groups."""
        groups = pl.ds(self.group_start, self.block_groups)
        reduced = pl.ds(self.chunk_start(chunk), self.block_reduced)
        return ref.at[(outer, *self._orient(groups, reduced))]

    def load(self, ref, outer, chunk, dtype) -> jax.Array:
        return triton_load(self.view(ref, outer, chunk), mask=self.mask(chunk),
                           other=0).astype(dtype)

    def store(self, ref, outer, chunk, value) -> None:
        triton_store(self.view(ref, outer, chunk), value.astype(ref.dtype),
                     mask=self.mask(chunk))

    def _stats_view(self, ref, outer, split):
        groups = pl.ds(self.group_start, self.block_groups)
        return ref.at[(outer, *self._orient(groups, pl.ds(jnp.asarray(split, jnp.int32), 1)))]

    def _stats_mask(self):
        return self.group_valid[:, None] if self.p.rows else self.group_valid[None, :]

    def load_stats(self, ref, outer, split=0) -> jax.Array:
        """Per-group values, stats-shaped (`split` indexes a per-split array's reduced dim)."""
        return triton_load(self._stats_view(ref, outer, split), mask=self._stats_mask(),
                           other=0)

    def store_stats(self, ref, outer, value, split=0) -> None:
        triton_store(self._stats_view(ref, outer, split), value.astype(ref.dtype),
                     mask=self._stats_mask())

    def load_param(self, ref, chunk, dtype) -> jax.Array:
        """This chunk of scale/offset, viewed (1, reduced) or (reduced, 1): broadcasts over
        the tile."""
        reduced = pl.ds(self.chunk_start(chunk), self.block_reduced)
        valid = self.reduced_valid(chunk)
        if self.p.rows:
            return triton_load(ref.at[pl.ds(jnp.int32(0), 1), reduced], mask=valid[None, :],
                               other=0).astype(dtype)
        return triton_load(ref.at[reduced, pl.ds(jnp.int32(0), 1)], mask=valid[:, None],
                           other=0).astype(dtype)


def fold(first, count, chunk_value, merge):
    """merge(...merge(chunk_value(first), chunk_value(first + 1))..., chunk_value(last)) over
    `count` >= 1 chunks, in order."""
    return lax.fori_loop(jnp.int32(1), jnp.asarray(count, jnp.int32),
                         lambda i, acc: merge(acc, chunk_value(first + i)), chunk_value(first))


def split_range(schedule: Schedule):
    """(first chunk, chunk count) of this program's split (grid axis 2)."""
    return Split(schedule.splits, schedule.per_split).range_of(pl.program_id(2),
                                                               schedule.num_chunks)


def split_shape(p: Problem, schedule: Schedule) -> jax.ShapeDtypeStruct:
    """One value per group and split, the splits along the view's reduced dim."""
    shape = (p.outer, p.groups, schedule.splits) if p.rows else (p.outer, schedule.splits, p.groups)
    return jax.ShapeDtypeStruct(shape, p.stat_dtype)


def launch(kernel, p: Problem, config: NormalizeConfig, grid, out_shape, flops_and_bytes, name,
          interpret, steps=1):
    """`steps`: the tiles one program walks in turn."""
    flops, nbytes = flops_and_bytes
    return triton_call(kernel, out_shape=out_shape, grid=grid, num_warps=config.num_warps,
                       num_stages=config.num_stages, interpret=interpret, flops=flops,
                       transcendentals=p.outer * p.groups, bytes_accessed=nbytes, name=name,
                       steps_per_program=steps)
