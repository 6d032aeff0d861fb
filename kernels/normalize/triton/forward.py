"""normalize's forward as Pallas kernels lowered through Triton (GPU) (the package's docstring
has every kernel's loop nest and the programs against the GPU).

Forward
-------
- Fused, grid (outer, num_blocks): program (o, b) normalizes groups [b·block_groups, ...) of
  slab o. One chunk per group (layer norm's common case): the tile is loaded once, its moments
  computed in registers (mean first, then the squared deviations) and y written once. Longer
  groups with enough group blocks to fill the GPU: a first loop merges per-chunk moments (Chan
  et al.'s parallel variance), a second re-reads each chunk (mostly from L2) and writes y.
  The program writes the groups' mean and 1/std (statistics dtype) for the backward.
- Two-phase (several chunks, too few group blocks): `_moments_kernel`, grid (outer, num_blocks,
  splits), program (o, b, s) merges the moments of chunks [s·per_split, (s+1)·per_split) and
  writes their mean and M2; XLA merges the splits (`common.merge_split_moments`) into mean and
  1/std; `_normalize_kernel`, grid (outer, num_blocks, num_chunks), writes one tile of y per
  program. x is read twice, y written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels._blocks import int32_loop
from kernels._pallas import pl
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.triton.config import Schedule, reduction_traffic, resolve_config, schedule_of
from kernels.normalize.triton.tiles import Tiles, fold, launch, split_range, split_shape

__all__ = ["forward"]


def _load_input(tiles: Tiles, x_ref, residual_ref, outer, chunk, p: Problem,
                sum_ref=None) -> jax.Array:
    """The tile to normalize, in the statistics dtype: x, or x + residual added in that dtype
    (see `reference.normalize`), then also stored, rounded, in `sum_ref` when given."""
    x = tiles.load(x_ref, outer, chunk, p.stat_dtype)
    if residual_ref is None:
        return x
    summed = x + tiles.load(residual_ref, outer, chunk, p.stat_dtype)
    if sum_ref is not None:
        tiles.store(sum_ref, outer, chunk, summed)
    return summed


def _moments(tiles: Tiles, x_ref, residual_ref, outer, chunk, p: Problem) -> common.Moments:
    x = _load_input(tiles, x_ref, residual_ref, outer, chunk, p)
    return common.chunk_moments(x, tiles.mask(chunk), p)


def _write_y(tiles: Tiles, refs, outer, chunk, x, mean, rstd, p: Problem) -> None:
    """Normalizes tile `x` of `chunk`, applies scale/offset and stores it in y."""
    scale_ref, offset_ref, y_ref = refs
    dtype = p.stat_dtype
    scale = None if scale_ref is None else tiles.load_param(scale_ref, chunk, dtype)
    offset = None if offset_ref is None else tiles.load_param(offset_ref, chunk, dtype)
    tiles.store(y_ref, outer, chunk, common.affine(common.normalized(x, mean, rstd, p),
                                                   scale, offset))


def _forward_kernel(x_ref, residual_ref, scale_ref, offset_ref, y_ref, sum_ref, mean_ref,
                    rstd_ref, *, p: Problem, config: NormalizeConfig, schedule: Schedule):
    """residual/sum: None refs without a residual; scale/offset: None refs when absent."""
    outer = pl.program_id(0)
    tiles = Tiles(p, config, pl.program_id(1))
    write = functools.partial(_write_y, tiles, (scale_ref, offset_ref, y_ref), outer, p=p)
    if schedule.num_chunks == 1:  # the tile stays in registers: one read, one write
        x = _load_input(tiles, x_ref, residual_ref, outer, 0, p, sum_ref)
        mean, rstd = common.mean_and_rstd(common.chunk_moments(x, tiles.mask(0), p), p)
        write(0, x, mean, rstd)
    else:
        moments = fold(0, schedule.num_chunks,
                       lambda c: _moments(tiles, x_ref, residual_ref, outer, c, p),
                       functools.partial(common.merge_moments, p=p))
        mean, rstd = common.mean_and_rstd(moments, p)

        def write_chunk(chunk, carry):
            # The sum is re-added here, not read back: this program's own stores need not be
            # visible to its loads.
            write(chunk, _load_input(tiles, x_ref, residual_ref, outer, chunk, p, sum_ref),
                  mean, rstd)
            return carry

        int32_loop(schedule.num_chunks, write_chunk, 0)
    tiles.store_stats(mean_ref, outer, mean)
    tiles.store_stats(rstd_ref, outer, rstd)


def _moments_kernel(x_ref, residual_ref, means_ref, m2s_ref, *, p: Problem,
                    config: NormalizeConfig, schedule: Schedule):
    outer, split = pl.program_id(0), pl.program_id(2)
    tiles = Tiles(p, config, pl.program_id(1))
    moments = fold(*split_range(schedule),
                   lambda c: _moments(tiles, x_ref, residual_ref, outer, c, p),
                   functools.partial(common.merge_moments, p=p))
    tiles.store_stats(means_ref, outer, moments.mean, split)
    tiles.store_stats(m2s_ref, outer, moments.m2, split)


def _normalize_kernel(x_ref, residual_ref, scale_ref, offset_ref, mean_ref, rstd_ref, y_ref,
                      sum_ref, *, p: Problem, config: NormalizeConfig):
    outer, chunk = pl.program_id(0), pl.program_id(2)
    tiles = Tiles(p, config, pl.program_id(1))
    _write_y(tiles, (scale_ref, offset_ref, y_ref), outer, chunk,
             _load_input(tiles, x_ref, residual_ref, outer, chunk, p, sum_ref),
             tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer), p)


def _split_counts(p: Problem, config: NormalizeConfig, schedule: Schedule) -> jax.Array:
    """Elements in each split, shaped to broadcast against `split_shape`. Computed by XLA
    (an iota), not a NumPy constant: custom_partitioning cannot trace a function that
    captures array constants."""
    split_size = schedule.per_split * config.block_reduced
    counts = jnp.clip(p.reduced - jnp.arange(schedule.splits, dtype=jnp.int32) * split_size, 0,
                      split_size)
    return counts.reshape((1, 1, -1) if p.rows else (1, -1, 1)).astype(p.stat_dtype)


def forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
            offset: jax.Array | None, p: Problem, *, config: NormalizeConfig | None,
            interpret: bool | str):
    """(y, x + residual or None, mean, rstd) for the view-shaped `x` (and `residual`) of a
    problem that `check` accepted."""
    config = resolve_config(p, config)
    schedule = schedule_of(p, config)
    stats = jax.ShapeDtypeStruct(p.stats_shape, p.stat_dtype)
    y = jax.ShapeDtypeStruct(p.view_shape, p.y_dtype)
    summed = jax.ShapeDtypeStruct(p.view_shape, p.dtype) if p.has_residual else None
    cost = common.forward_flops_and_bytes(p)
    if schedule.splits == 1:
        kernel = functools.partial(_forward_kernel, p=p, config=config, schedule=schedule)
        return launch(kernel, p, config, (p.outer, schedule.num_blocks),
                      (y, summed, stats, stats), cost, "normalize_forward_triton", interpret,
                      schedule.num_chunks)(x, residual, scale, offset)
    kernel = functools.partial(_moments_kernel, p=p, config=config, schedule=schedule)
    means, m2s = launch(kernel, p, config, (p.outer, schedule.num_blocks, schedule.splits),
                        (split_shape(p, schedule),) * 2,
                        reduction_traffic(p, 1 + p.has_residual, 4, schedule),
                        "normalize_moments_triton", interpret, schedule.per_split)(x, residual)
    counts = _split_counts(p, config, schedule)
    mean, rstd = common.mean_and_rstd(common.merge_split_moments(means, m2s, counts, p), p)
    y, summed = launch(functools.partial(_normalize_kernel, p=p, config=config), p, config,
                       (p.outer, schedule.num_blocks, schedule.num_chunks), (y, summed), cost,
                       "normalize_forward_triton", interpret)(
                           x, residual, scale, offset, mean, rstd)
    return y, summed, mean, rstd
