"""normalize's forward as a Pallas kernel lowered through Mosaic (TPU), on the grid and blocks of
`schedule.py` (the package's docstring has both kernels' loop nests).

One chunk per group (phases = 1, the common case): step (u, k, 0, 0) receives the block of x
(and of the residual, added on load in the statistics dtype) in VMEM through the BlockSpec
pipeline, computes its groups' mean and then the squared deviations from it, and writes y (and
x + residual to `sum`) in the same step. Several chunks (phases = 2): phase 0 merges each
chunk's moments into VMEM scratch (Chan et al.'s parallel variance); phase 1 re-reads each chunk
and writes y. The groups' mean and 1/std (statistics dtype) go out as lane-dense
(1, block_groups) blocks for the backward.

Memory traffic: x read once and y written once when a group fits one block; x read twice
otherwise.
"""

from __future__ import annotations

import functools

import jax

from kernels._pallas import mosaic_call, pl, pltpu, vmem_limit
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic.config import resolve_config, vmem_bytes
from kernels.normalize.mosaic.schedule import (SEMANTICS, Schedule, all_valid, lane_dense,
                                           zero_invalid)

__all__ = ["forward"]


def _forward_kernel(x_ref, residual_ref, scale_ref, offset_ref, y_ref, sum_ref, mean_ref,
                    rstd_ref, *moment_refs, p: Problem, schedule: Schedule):
    """residual/sum: None refs without a residual; scale/offset: None refs when absent;
    `moment_refs`: the (count, mean, M2) accumulators of a two-phase schedule, none with one
    phase."""
    dtype = p.stat_dtype
    x = x_ref[...].astype(dtype)
    if residual_ref is not None:  # added in the statistics dtype (see reference.normalize)
        x = x + residual_ref[...].astype(dtype)
    valid = schedule.reduced_valid(x.shape)
    # Padding may be NaN: zero it before it meets any arithmetic.
    x = zero_invalid(x, valid)

    def moments():
        return common.chunk_moments(x, all_valid(x.shape) if valid is None else valid, p)

    def write(mean, rstd):
        scale = schedule.load_param(scale_ref, dtype)
        offset = schedule.load_param(offset_ref, dtype)
        y_ref[...] = common.affine(common.normalized(x, mean, rstd, p), scale,
                                   offset).astype(y_ref.dtype)
        if sum_ref is not None:
            sum_ref[...] = x.astype(sum_ref.dtype)
        schedule.store_stats(mean_ref, mean)
        schedule.store_stats(rstd_ref, rstd)

    if schedule.phases == 1:
        write(*common.mean_and_rstd(moments(), p))
        return
    count_ref, mean_acc, m2_ref = moment_refs
    phase, chunk = pl.program_id(2), pl.program_id(3)

    @pl.when((phase == 0) & (chunk == 0))
    def _():
        count_ref[...], mean_acc[...], m2_ref[...] = moments()

    @pl.when((phase == 0) & (chunk > 0))
    def _():
        seen = common.Moments(count_ref[...], mean_acc[...], m2_ref[...])
        count_ref[...], mean_acc[...], m2_ref[...] = common.merge_moments(seen, moments(), p)

    @pl.when(phase == 1)
    def _():
        seen = common.Moments(count_ref[...], mean_acc[...], m2_ref[...])
        write(*common.mean_and_rstd(seen, p))


def forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
            offset: jax.Array | None, p: Problem, *, config: NormalizeConfig | None,
            interpret: bool | str):
    """(y, x + residual or None, mean, rstd) for the view-shaped `x` (and `residual`) of a
    problem that `check` accepted."""
    config = resolve_config(p, config)
    schedule = Schedule(p, config)
    stats = jax.ShapeDtypeStruct(schedule.kernel_stats_shape(), p.stat_dtype)
    stats_block = schedule.orient(schedule.block_groups, 1)
    in_specs = [schedule.tile_spec(), schedule.tile_spec() if p.has_residual else None,
                schedule.param_spec(last_phase=True) if p.has_scale else None,
                schedule.param_spec(last_phase=True) if p.has_offset else None]
    scratch = [pltpu.VMEM(stats_block, p.stat_dtype)] * 3 if schedule.phases == 2 else []
    written = schedule.tile_spec(last_phase=True)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=schedule.grid, in_specs=in_specs,
        out_specs=[written, written if p.has_residual else None, schedule.stats_spec(),
                   schedule.stats_spec()],
        scratch_shapes=scratch)
    summed = jax.ShapeDtypeStruct(p.view_shape, p.dtype) if p.has_residual else None
    y, summed, mean, rstd = mosaic_call(
        functools.partial(_forward_kernel, p=p, schedule=schedule),
        out_shape=(jax.ShapeDtypeStruct(p.view_shape, p.y_dtype), summed, stats, stats),
        grid_spec=grid_spec,
        dimension_semantics=SEMANTICS,
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        flops=common.forward_flops_and_bytes(p)[0],
        transcendentals=p.outer * p.groups,
        name="normalize_forward_mosaic",
    )(x, residual, *map(lane_dense, (scale, offset)))
    return y, summed, schedule.from_kernel_stats(mean), schedule.from_kernel_stats(rstd)
