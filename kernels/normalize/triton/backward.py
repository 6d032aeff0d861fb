"""normalize's backward as Pallas kernels lowered through Triton (GPU) (the package's docstring
has every kernel's loop nest and the programs against the GPU).

Backward
--------
grid = (num_chunks, outer, num_partials), the chunk first (CUDA's fastest launch axis), so the
programs of a block's chunks run side by side. Inputs: x, dy, the saved mean and 1/std and
their cotangents (zero unless this is a second-order gradient). Program (c, o, q) walks group
blocks q, q + num_partials, ... of slab o in chunk c: loads x and dy (with two chunks, first
the whole group, for the sums: below), writes dx once, and adds the tile's column
sums of dy·x̂ and dy to register accumulators; at the end it writes its chunk of partial row
o·num_partials + q of dscale and doffset, which XLA sums (no float atomics: the same result on
every run). Its chunks are `config.backward_config`'s (a row the forward holds in one chunk of
more than `_BACKWARD_MAX_CHUNK` is two here: two CTAs an SM). dx needs two per-group sums,
sum(dy·scale) and sum(dy·scale·x̂): with one chunk per group the tile holds them; with up to
`config._MAX_REREAD_CHUNKS` (rows up to that many `_MAX_ROW` chunks; float32 rows with a
residual in smaller chunks: `_chunked_float32_residual`; the register counts are beside those
constants) the program reads both chunks for them, in half-chunk tiles, then its own again
(`config.sums_in_program`), mostly from L2, where its neighbour, the program of the other
chunk, is reading the same rows: x and dy come from
HBM about once (an estimate, not measured on a GPU). Longer groups get them from
`_sums_kernel` (grid (outer, num_blocks, splits), like `_moments_kernel`), run first, and XLA
adds the splits: a second read of x and dy. So a long row never makes the backward write a
float32 partial row per group row, and never runs fewer programs than the GPU has SMs when the
problem has that many tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels._blocks import int32_loop
from kernels._pallas import pl, triton_store
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.triton.config import (Schedule, backward_config, num_partials,
                                             reduction_traffic, schedule_of, sums_in_program)
from kernels.normalize.triton.tiles import Tiles, fold, launch, split_range, split_shape

__all__ = ["backward"]


def _gradient_inputs(tiles: Tiles, refs, outer, chunk, mean, rstd, p: Problem):
    """(dy, dy·scale, x̂) of one tile, in the statistics dtype."""
    x_ref, gy_ref, scale_ref = refs
    dtype = p.stat_dtype
    x = tiles.load(x_ref, outer, chunk, dtype)
    g = tiles.load(gy_ref, outer, chunk, dtype)
    gs = g if scale_ref is None else g * tiles.load_param(scale_ref, chunk, dtype)
    return g, gs, common.normalized(x, mean, rstd, p)


def _group_sums(tiles: Tiles, refs, outer, first, count, mean, rstd,
                p: Problem) -> common.GroupSums:
    """sum(dy·scale) and sum(dy·scale·x̂) over chunks [first, first + count) of the groups."""
    def chunk_sums(chunk):
        _, gs, xhat = _gradient_inputs(tiles, refs, outer, chunk, mean, rstd, p)
        return common.group_sums(gs, xhat, tiles.mask(chunk), p)

    return fold(first, count, chunk_sums,
                lambda a, b: common.GroupSums(a.gs + b.gs, a.gs_xhat + b.gs_xhat))


def _sums_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gs_ref, gs_xhat_ref, *,
                 p: Problem, config: NormalizeConfig, schedule: Schedule):
    outer, split = pl.program_id(0), pl.program_id(2)
    tiles = Tiles(p, config, pl.program_id(1))
    mean, rstd = tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer)
    sums = _group_sums(tiles, (x_ref, gy_ref, scale_ref), outer, *split_range(schedule), mean,
                       rstd, p)
    tiles.store_stats(gs_ref, outer, sums.gs, split)
    tiles.store_stats(gs_xhat_ref, outer, sums.gs_xhat, split)


def _backward_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gmean_ref, grstd_ref,
                     gsum_ref, gs_ref, gs_xhat_ref, dx_ref, dscale_ref, doffset_ref, *,
                     p: Problem, config: NormalizeConfig, schedule: Schedule, partials: int):
    """x: the normalized array (x + residual with a residual); gmean/grstd: None unless a
    second-order gradient; gsum: the cotangent of the forward's sum output (None without a
    residual or when the sum is unused), added to dx; gs/gs_xhat (the per-group sums from
    `_sums_kernel`): None where the programs compute them (`sums_in_program`); dscale/doffset:
    None without parameters."""
    chunk, outer, program = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group_axis = 1 - p.reduce_axis
    # In-program sums read the group in half-chunk tiles: whole chunks left fewer registers
    # for the program's own tile, and a float32 row of two chunks spilled 96-108 bytes.
    sums_config = dataclasses.replace(config, block_reduced=max(1, config.block_reduced // 2))

    def block_gradient(i, accumulators):
        """dx of group block program + i·partials in this chunk; adds the block's column sums
        of dy·x̂ and dy to the accumulators. Blocks past the last are fully masked: they add 0
        and write nothing."""
        tiles = Tiles(p, config, program + i * partials)
        mean, rstd = tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer)
        refs = (x_ref, gy_ref, scale_ref)
        if gs_ref is not None:  # from the sums pass
            sums = common.GroupSums(tiles.load_stats(gs_ref, outer),
                                    tiles.load_stats(gs_xhat_ref, outer))
        elif schedule.num_chunks > 1:  # before this chunk's tiles load: not live together
            sums = _group_sums(Tiles(p, sums_config, program + i * partials), refs, outer, 0,
                               pl.cdiv(p.reduced, sums_config.block_reduced), mean, rstd, p)
        g, gs, xhat = _gradient_inputs(tiles, refs, outer, chunk, mean, rstd, p)
        valid = tiles.mask(chunk)
        if schedule.num_chunks == 1:
            sums = common.group_sums(gs, xhat, valid, p)
        gmean, grstd = (None if ref is None else tiles.load_stats(ref, outer)
                        for ref in (gmean_ref, grstd_ref))
        dx = common.input_gradient(gs, xhat, rstd, sums, gmean, grstd, p)
        if gsum_ref is not None:
            dx = dx + tiles.load(gsum_ref, outer, chunk, p.stat_dtype)
        tiles.store(dx_ref, outer, chunk, dx)
        # No select for the padding (one made a float32 two-chunk row spill): g loads 0 there,
        # and x̂ is finite in padded groups (their statistics load as 0); a 0·inf past the
        # row's end (rstd = inf) lands in a column that is never stored.
        return (accumulators[0] + jnp.sum(g * xhat, axis=group_axis),
                accumulators[1] + jnp.sum(g, axis=group_axis))

    zeros = jnp.zeros((config.block_reduced,), p.stat_dtype)
    dscale, doffset = int32_loop(pl.cdiv(schedule.num_blocks, partials), block_gradient,
                                 (zeros, zeros))
    tiles = Tiles(p, config, program)
    columns = pl.ds(tiles.chunk_start(chunk), config.block_reduced)
    partial_row = outer * partials + program
    for ref, value in ((dscale_ref, dscale), (doffset_ref, doffset)):
        if ref is not None:
            triton_store(ref.at[partial_row, columns], value, mask=tiles.reduced_valid(chunk))


def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool | str):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`. `x` is the
    normalized array (the forward's sum, with a residual); `gsum`, the sum's cotangent or
    None, is added to dx."""
    config = backward_config(p, config)
    schedule = schedule_of(p, config)
    partials = num_partials(p, config, schedule)
    sums = (None, None)
    if not sums_in_program(schedule):  # the per-group sums dx needs come from a first pass
        split_sums = launch(
            functools.partial(_sums_kernel, p=p, config=config, schedule=schedule), p, config,
            (p.outer, schedule.num_blocks, schedule.splits), (split_shape(p, schedule),) * 2,
            reduction_traffic(p, 2, 6, schedule),
            "normalize_sums_triton", interpret, schedule.per_split,
        )(x, scale, mean, rstd, gy)
        sums = [jnp.sum(a, axis=p.view_reduce_axis, keepdims=True) for a in split_sums]
    partial = jax.ShapeDtypeStruct((p.outer * partials, p.reduced), p.stat_dtype)
    out_shape = (jax.ShapeDtypeStruct(p.view_shape, p.dtype), partial if p.has_scale else None,
                 partial if p.has_offset else None)
    dx, dscale, doffset = launch(
        functools.partial(_backward_kernel, p=p, config=config, schedule=schedule,
                          partials=partials),
        p, config, (schedule.num_chunks, p.outer, partials), out_shape,
        common.backward_flops_and_bytes(p, p.outer * partials, gmean is not None,
                                        gsum is not None),
        "normalize_backward_triton", interpret, pl.cdiv(schedule.num_blocks, partials),
    )(x, scale, mean, rstd, gy, gmean, grstd, gsum, *sums)
    return dx, *(None if d is None else jnp.sum(d, axis=0).reshape(p.param_shape)
                 for d in (dscale, doffset))
