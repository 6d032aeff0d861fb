"""normalize's fused backward as a Pallas kernel lowered through Mosaic (TPU), on the grid and
blocks of `schedule.py` (the package's docstring has both kernels' loop nests).

Inputs: x, dy, the saved mean and 1/std and their cotangents (zero unless this is a
second-order gradient), and the cotangent of the `sum` output with a residual. One chunk per
group: step (u, k, 0, 0) computes its groups' two sums, sum(dy·scale) and sum(dy·scale·x̂), from
the block in VMEM and writes dx in the same step. Several chunks: phase 0 accumulates the sums
over the chunks in VMEM scratch, phase 1 re-reads each chunk and writes dx. Every step adds its
tile's column sums of dy·x̂ and dy into the range's partial dscale/doffset row, held in VMEM
across the range's blocks (zeroed at its first) and written once; XLA sums the rows.

Memory traffic: x and dy read once (twice for multi-chunk groups), dx written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels._pallas import mosaic_call, pl, pltpu, vmem_limit
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic.config import resolve_config, vmem_bytes
from kernels.normalize.mosaic.schedule import (SEMANTICS, Schedule, all_valid, and_masks,
                                           lane_dense, zero_invalid)

__all__ = ["backward"]


def _backward_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gmean_ref, grstd_ref,
                     gsum_ref, dx_ref, dscale_ref, doffset_ref, *sum_refs, p: Problem,
                     schedule: Schedule):
    """x: the normalized array (x + residual with a residual); gmean/grstd: None refs unless a
    second-order gradient; gsum: the forward's sum output's cotangent, added to dx (None
    without a residual or when the sum is unused); dscale/doffset: None without parameters;
    `sum_refs`: the per-group sums accumulated by a two-phase schedule."""
    dtype = p.stat_dtype
    mean, rstd = schedule.load_stats(mean_ref), schedule.load_stats(rstd_ref)
    valid = schedule.reduced_valid(x_ref.shape)
    x = zero_invalid(x_ref[...].astype(dtype), valid)
    g = zero_invalid(gy_ref[...].astype(dtype), valid)
    xhat = common.normalized(x, mean, rstd, p)
    gs = g if scale_ref is None else g * schedule.load_param(scale_ref, dtype)

    def chunk_sums():
        return common.group_sums(gs, xhat, all_valid(x.shape) if valid is None else valid, p)

    def write(sums: common.GroupSums):
        gmean, grstd = (None if ref is None else schedule.load_stats(ref)
                        for ref in (gmean_ref, grstd_ref))
        dx = common.input_gradient(gs, xhat, rstd, sums, gmean, grstd, p)
        if gsum_ref is not None:
            dx = dx + gsum_ref[...].astype(dtype)
        dx_ref[...] = dx.astype(dx_ref.dtype)
        # Groups past the edge hold garbage (their dx writes are dropped); sum without them.
        in_groups = schedule.group_valid(x.shape)
        group_axis = 1 - p.reduce_axis
        if dscale_ref is not None:
            weighted = zero_invalid(g * xhat, and_masks(in_groups, valid))
            schedule.add_partial(dscale_ref, jnp.sum(weighted, axis=group_axis, keepdims=True))
        if doffset_ref is not None:
            schedule.add_partial(doffset_ref, jnp.sum(zero_invalid(g, in_groups), axis=group_axis,
                                                      keepdims=True))

    if schedule.phases == 1:
        write(chunk_sums())
        return
    gs_ref, gs_xhat_ref = sum_refs
    phase, chunk = pl.program_id(2), pl.program_id(3)

    @pl.when((phase == 0) & (chunk == 0))
    def _():
        gs_ref[...], gs_xhat_ref[...] = chunk_sums()

    @pl.when((phase == 0) & (chunk > 0))
    def _():
        sums = chunk_sums()
        gs_ref[...] += sums.gs
        gs_xhat_ref[...] += sums.gs_xhat

    @pl.when(phase == 1)
    def _():
        write(common.GroupSums(gs_ref[...], gs_xhat_ref[...]))


def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool | str):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`. `x` is the
    normalized array (the forward's sum, with a residual); `gsum`, the sum's cotangent or
    None, is added to dx."""
    config = resolve_config(p, config)
    schedule = Schedule(p, config)
    num_partials = schedule.num_partials
    partial_shape = (num_partials, 1, p.reduced)
    partial = jax.ShapeDtypeStruct(partial_shape, p.stat_dtype)
    stats_block = schedule.orient(schedule.block_groups, 1)
    stat_cotangents = gmean is not None
    cotangent_spec = schedule.stats_spec() if stat_cotangents else None
    in_specs = [schedule.tile_spec(), schedule.param_spec() if p.has_scale else None,
                schedule.stats_spec(), schedule.stats_spec(), schedule.tile_spec(), cotangent_spec,
                cotangent_spec, None if gsum is None else schedule.tile_spec(last_phase=True)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=schedule.grid, in_specs=in_specs,
        out_specs=[schedule.tile_spec(last_phase=True),
                   schedule.partial_spec() if p.has_scale else None,
                   schedule.partial_spec() if p.has_offset else None],
        scratch_shapes=[pltpu.VMEM(stats_block, p.stat_dtype)] * 2 if schedule.phases == 2
        else [])
    mean, rstd, gmean, grstd = map(schedule.to_kernel_stats, (mean, rstd, gmean, grstd))
    dx, dscale, doffset = mosaic_call(
        functools.partial(_backward_kernel, p=p, schedule=schedule),
        out_shape=(jax.ShapeDtypeStruct(p.view_shape, p.dtype),
                   partial if p.has_scale else None, partial if p.has_offset else None),
        grid_spec=grid_spec,
        dimension_semantics=SEMANTICS,
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        flops=common.backward_flops_and_bytes(p, num_partials, stat_cotangents)[0],
        transcendentals=p.outer * p.groups,
        name="normalize_backward_mosaic",
    )(x, lane_dense(scale), mean, rstd, gy, gmean, grstd, gsum)
    return dx, *(None if d is None else jnp.sum(d, axis=0).reshape(p.param_shape)
                 for d in (dscale, doffset))
