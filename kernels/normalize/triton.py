"""normalize as Pallas kernels lowered through Triton (GPU): forward and backward.

Each kernel's loop nest, per program (tiles and schedule: `triton_config.py`); x[o, b, c] is
the tile of slab o, group block b and chunk c of the reduced axis:

    forward (fused), program (o, b), where with a residual x[o, b, c] means x + r, added on
    load, and the loop writing y also writes it to sum[o, b, c]:
        mean, rstd = merge(moments(x[o, b, c]) for c in chunks)  # one chunk: in registers
        for c in chunks: y[o, b, c] = affine((x[o, b, c] - mean) * rstd)
    moments (split), program (o, b, s):  mean and M2 of the chunks of split s; XLA merges
    normalize (split), program (o, b, c):  y[o, b, c] = affine((x[o, b, c] - mean) * rstd)
    sums (unless sums_in_program), program (o, b, s):  sum(dy·scale), sum(dy·scale·x̂) of split s
    backward, program (c, o, q):
        for b in (q, q + partials, ...):
            sums = the group sums: of tile (o, b, c) with one chunk; of chunks (o, b, 0) and
                   (o, b, 1), re-read in half-chunk tiles, with two; else the sums pass's
            dx[o, b, c] = input_gradient(x[o, b, c], dy[o, b, c], sums)
                          (+ dsum[o, b, c], the sum output's cotangent, with a residual)
            dscale_acc += column sums of dy·x̂;  doffset_acc += column sums of dy
        dscale_partial[o·partials + q, c], doffset_partial[o·partials + q, c] = the accs

Every kernel works on the 3-D view of `common` (rows `(1, groups, reduced)` or columns
`(outer, reduced, groups)`) with 2-D tiles of `block_groups` groups by `block_reduced` elements
(`(block_groups, block_reduced)` for rows, `(block_reduced, block_groups)` for columns); a group
is `num_chunks = cdiv(reduced, block_reduced)` chunks. Every load and store is masked to the
array: the ragged tail of the groups and of the reduced axis reads 0 and writes nothing, so any
shape works without padding copies.

Programs vs the GPU
-------------------
A GPU wants two waves of programs or more (`Target.min_programs`: 264 on an H100's 132 SMs).
Groups give `outer · num_blocks` programs (num_blocks = cdiv(groups, block_groups)); where that
is fewer than the SMs and a group is several chunks long (batch-norm-style statistics over
leading axes, e.g. (1M, 64) over axis 0: 2 group blocks of 8192 chunks), the groups are split
along the reduced axis into `splits` ranges of `per_split` chunks (`schedule`), at least two
waves of them, reduced in parallel and merged by XLA, and the elementwise pass gets one
program per tile.

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

Backward
--------
grid = (num_chunks, outer, num_partials), the chunk first (CUDA's fastest launch axis), so the
programs of a block's chunks run side by side. Inputs: x, dy, the saved mean and 1/std and
their cotangents (zero unless this is a second-order gradient). Program (c, o, q) walks group
blocks q, q + num_partials, ... of slab o in chunk c: loads x and dy (with two chunks, first
the whole group, for the sums: below), writes dx once, and adds the tile's column
sums of dy·x̂ and dy to register accumulators; at the end it writes its chunk of partial row
o·num_partials + q of dscale and doffset, which XLA sums (no float atomics: the same result on
every run). dx needs two per-group sums, sum(dy·scale) and sum(dy·scale·x̂): with one chunk per
group the tile holds them; with up to `triton_config._MAX_REREAD_CHUNKS` (rows up to that many
`_MAX_ROW` chunks; float32 rows with a residual in smaller chunks: `_chunked_float32_residual`;
the register counts are beside those constants) the program reads both chunks for them, in
half-chunk tiles, then its own again (`triton_config.sums_in_program`), mostly from L2, where
its neighbour, the program of the other chunk, is reading the same rows: x and dy come from
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
from jax import lax

from kernels._blocks import Split, int32_loop
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.triton_config import (Schedule, check, num_partials, reduction_traffic,
                                             resolve_config, schedule, sums_in_program)

__all__ = ["forward", "backward", "check", "resolve_config", "schedule"]


class _Tiles:
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


def _fold(first, count, chunk_value, merge):
    """merge(...merge(chunk_value(first), chunk_value(first + 1))..., chunk_value(last)) over
    `count` >= 1 chunks, in order."""
    return lax.fori_loop(jnp.int32(1), jnp.asarray(count, jnp.int32),
                         lambda i, acc: merge(acc, chunk_value(first + i)), chunk_value(first))


def _split_range(s: Schedule):
    """(first chunk, chunk count) of this program's split (grid axis 2)."""
    return Split(s.splits, s.per_split).range_of(pl.program_id(2), s.num_chunks)


def _load_input(tiles: _Tiles, x_ref, residual_ref, outer, chunk, p: Problem,
                sum_ref=None) -> jax.Array:
    """The tile to normalize, in the statistics dtype: x, or x + residual added in that dtype
    (see `reference.normalize`), then also stored, rounded, in `sum_ref` when given."""
    x = tiles.load(x_ref, outer, chunk, p.stat_dtype)
    if residual_ref is None:
        return x
    total = x + tiles.load(residual_ref, outer, chunk, p.stat_dtype)
    if sum_ref is not None:
        tiles.store(sum_ref, outer, chunk, total)
    return total


def _moments(tiles: _Tiles, x_ref, residual_ref, outer, chunk, p: Problem) -> common.Moments:
    x = _load_input(tiles, x_ref, residual_ref, outer, chunk, p)
    return common.chunk_moments(x, tiles.mask(chunk), p)


def _write_y(tiles: _Tiles, refs, outer, chunk, x, mean, rstd, p: Problem) -> None:
    """Normalizes tile `x` of `chunk`, applies scale/offset and stores it in y."""
    scale_ref, offset_ref, y_ref = refs
    dtype = p.stat_dtype
    scale = None if scale_ref is None else tiles.load_param(scale_ref, chunk, dtype)
    offset = None if offset_ref is None else tiles.load_param(offset_ref, chunk, dtype)
    tiles.store(y_ref, outer, chunk, common.affine(common.normalized(x, mean, rstd, p),
                                                   scale, offset))


def _forward_kernel(x_ref, residual_ref, scale_ref, offset_ref, y_ref, sum_ref, mean_ref,
                    rstd_ref, *, p: Problem, config: NormalizeConfig, s: Schedule):
    """residual/sum: None refs without a residual; scale/offset: None refs when absent."""
    outer = pl.program_id(0)
    tiles = _Tiles(p, config, pl.program_id(1))
    write = functools.partial(_write_y, tiles, (scale_ref, offset_ref, y_ref), outer, p=p)
    if s.num_chunks == 1:  # the tile stays in registers: one read, one write
        x = _load_input(tiles, x_ref, residual_ref, outer, 0, p, sum_ref)
        mean, rstd = common.mean_and_rstd(common.chunk_moments(x, tiles.mask(0), p), p)
        write(0, x, mean, rstd)
    else:
        moments = _fold(0, s.num_chunks,
                        lambda c: _moments(tiles, x_ref, residual_ref, outer, c, p),
                        functools.partial(common.merge_moments, p=p))
        mean, rstd = common.mean_and_rstd(moments, p)

        def write_chunk(chunk, carry):
            # The sum is re-added here, not read back: this program's own stores need not be
            # visible to its loads.
            write(chunk, _load_input(tiles, x_ref, residual_ref, outer, chunk, p, sum_ref),
                  mean, rstd)
            return carry

        int32_loop(s.num_chunks, write_chunk, 0)
    tiles.store_stats(mean_ref, outer, mean)
    tiles.store_stats(rstd_ref, outer, rstd)


def _moments_kernel(x_ref, residual_ref, means_ref, m2s_ref, *, p: Problem,
                    config: NormalizeConfig, s: Schedule):
    outer, split = pl.program_id(0), pl.program_id(2)
    tiles = _Tiles(p, config, pl.program_id(1))
    moments = _fold(*_split_range(s),
                    lambda c: _moments(tiles, x_ref, residual_ref, outer, c, p),
                    functools.partial(common.merge_moments, p=p))
    tiles.store_stats(means_ref, outer, moments.mean, split)
    tiles.store_stats(m2s_ref, outer, moments.m2, split)


def _normalize_kernel(x_ref, residual_ref, scale_ref, offset_ref, mean_ref, rstd_ref, y_ref,
                      sum_ref, *, p: Problem, config: NormalizeConfig):
    outer, chunk = pl.program_id(0), pl.program_id(2)
    tiles = _Tiles(p, config, pl.program_id(1))
    _write_y(tiles, (scale_ref, offset_ref, y_ref), outer, chunk,
             _load_input(tiles, x_ref, residual_ref, outer, chunk, p, sum_ref),
             tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer), p)


def _split_shape(p: Problem, s: Schedule) -> jax.ShapeDtypeStruct:
    """One value per group and split, the splits along the view's reduced dim."""
    shape = (p.outer, p.groups, s.splits) if p.rows else (p.outer, s.splits, p.groups)
    return jax.ShapeDtypeStruct(shape, p.stat_dtype)


def _split_counts(p: Problem, config: NormalizeConfig, s: Schedule) -> jax.Array:
    """Elements in each split, shaped to broadcast against `_split_shape`. Computed by XLA
    (an iota), not a NumPy constant: custom_partitioning cannot trace a function that
    captures array constants."""
    split_size = s.per_split * config.block_reduced
    counts = jnp.clip(p.reduced - jnp.arange(s.splits, dtype=jnp.int32) * split_size, 0,
                      split_size)
    return counts.reshape((1, 1, -1) if p.rows else (1, -1, 1)).astype(p.stat_dtype)


def _call(kernel, p: Problem, config: NormalizeConfig, grid, out_shape, flops_and_bytes, name,
          interpret, steps=1):
    """`steps`: the tiles one program walks in turn."""
    flops, nbytes = flops_and_bytes
    return triton_call(kernel, out_shape=out_shape, grid=grid, num_warps=config.num_warps,
                       num_stages=config.num_stages, interpret=interpret, flops=flops,
                       transcendentals=p.outer * p.groups, bytes_accessed=nbytes, name=name,
                       steps_per_program=steps)


def forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
            offset: jax.Array | None, p: Problem, *, config: NormalizeConfig | None,
            interpret: bool | str):
    """(y, x + residual or None, mean, rstd) for the view-shaped `x` (and `residual`) of a
    problem that `check` accepted."""
    config = resolve_config(p, config)
    s = schedule(p, config)
    stats = jax.ShapeDtypeStruct(p.stats_shape, p.stat_dtype)
    y = jax.ShapeDtypeStruct(p.view_shape, p.y_dtype)
    total = jax.ShapeDtypeStruct(p.view_shape, p.dtype) if p.has_residual else None
    cost = common.forward_flops_and_bytes(p)
    if s.splits == 1:
        return _call(functools.partial(_forward_kernel, p=p, config=config, s=s), p, config,
                     (p.outer, s.num_blocks), (y, total, stats, stats), cost,
                     "normalize_forward_triton", interpret, s.num_chunks)(
                         x, residual, scale, offset)
    means, m2s = _call(functools.partial(_moments_kernel, p=p, config=config, s=s), p, config,
                       (p.outer, s.num_blocks, s.splits), (_split_shape(p, s),) * 2,
                       reduction_traffic(p, 1 + p.has_residual, 4, s),
                       "normalize_moments_triton", interpret, s.per_split)(x, residual)
    counts = _split_counts(p, config, s)
    mean, rstd = common.mean_and_rstd(common.merge_split_moments(means, m2s, counts, p), p)
    y, total = _call(functools.partial(_normalize_kernel, p=p, config=config), p, config,
                     (p.outer, s.num_blocks, s.num_chunks), (y, total), cost,
                     "normalize_forward_triton", interpret)(
                         x, residual, scale, offset, mean, rstd)
    return y, total, mean, rstd


def _gradient_inputs(tiles: _Tiles, refs, outer, chunk, mean, rstd, p: Problem):
    """(dy, dy·scale, x̂) of one tile, in the statistics dtype."""
    x_ref, gy_ref, scale_ref = refs
    dtype = p.stat_dtype
    x = tiles.load(x_ref, outer, chunk, dtype)
    g = tiles.load(gy_ref, outer, chunk, dtype)
    gs = g if scale_ref is None else g * tiles.load_param(scale_ref, chunk, dtype)
    return g, gs, common.normalized(x, mean, rstd, p)


def _group_sums(tiles: _Tiles, refs, outer, first, count, mean, rstd,
                p: Problem) -> common.RowSums:
    """sum(dy·scale) and sum(dy·scale·x̂) over chunks [first, first + count) of the groups."""
    def chunk_sums(chunk):
        _, gs, xhat = _gradient_inputs(tiles, refs, outer, chunk, mean, rstd, p)
        return common.row_sums(gs, xhat, tiles.mask(chunk), p)

    return _fold(first, count, chunk_sums,
                 lambda a, b: common.RowSums(a.gs + b.gs, a.gs_xhat + b.gs_xhat))


def _sums_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gs_ref, gs_xhat_ref, *,
                 p: Problem, config: NormalizeConfig, s: Schedule):
    outer, split = pl.program_id(0), pl.program_id(2)
    tiles = _Tiles(p, config, pl.program_id(1))
    mean, rstd = tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer)
    sums = _group_sums(tiles, (x_ref, gy_ref, scale_ref), outer, *_split_range(s), mean, rstd, p)
    tiles.store_stats(gs_ref, outer, sums.gs, split)
    tiles.store_stats(gs_xhat_ref, outer, sums.gs_xhat, split)


def _backward_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gmean_ref, grstd_ref,
                     gsum_ref, gs_ref, gs_xhat_ref, dx_ref, dscale_ref, doffset_ref, *,
                     p: Problem, config: NormalizeConfig, s: Schedule, partials: int):
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
        tiles = _Tiles(p, config, program + i * partials)
        mean, rstd = tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer)
        refs = (x_ref, gy_ref, scale_ref)
        if gs_ref is not None:  # from the sums pass
            sums = common.RowSums(tiles.load_stats(gs_ref, outer),
                                  tiles.load_stats(gs_xhat_ref, outer))
        elif s.num_chunks > 1:  # before this chunk's tiles load, so they are not live together
            sums = _group_sums(_Tiles(p, sums_config, program + i * partials), refs, outer, 0,
                               pl.cdiv(p.reduced, sums_config.block_reduced), mean, rstd, p)
        g, gs, xhat = _gradient_inputs(tiles, refs, outer, chunk, mean, rstd, p)
        valid = tiles.mask(chunk)
        if s.num_chunks == 1:
            sums = common.row_sums(gs, xhat, valid, p)
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
    dscale, doffset = int32_loop(pl.cdiv(s.num_blocks, partials), block_gradient,
                                 (zeros, zeros))
    tiles = _Tiles(p, config, program)
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
    config = resolve_config(p, config)
    s = schedule(p, config)
    partials = num_partials(p, config, s)
    sums = (None, None)
    if not sums_in_program(s):  # the per-group sums dx needs come from a first pass
        split_sums = _call(
            functools.partial(_sums_kernel, p=p, config=config, s=s), p, config,
            (p.outer, s.num_blocks, s.splits), (_split_shape(p, s),) * 2,
            reduction_traffic(p, 2, 6, s),
            "normalize_sums_triton", interpret, s.per_split,
        )(x, scale, mean, rstd, gy)
        sums = [jnp.sum(a, axis=p.view_reduce_axis, keepdims=True) for a in split_sums]
    partial = jax.ShapeDtypeStruct((p.outer * partials, p.reduced), p.stat_dtype)
    out_shape = (jax.ShapeDtypeStruct(p.view_shape, p.dtype), partial if p.has_scale else None,
                 partial if p.has_offset else None)
    dx, dscale, doffset = _call(
        functools.partial(_backward_kernel, p=p, config=config, s=s, partials=partials), p,
        config, (s.num_chunks, p.outer, partials), out_shape,
        common.backward_flops_and_bytes(p, p.outer * partials, gmean is not None,
                                        gsum is not None),
        "normalize_backward_triton", interpret, pl.cdiv(s.num_blocks, partials),
    )(x, scale, mean, rstd, gy, gmean, grstd, gsum, *sums)
    return dx, *(None if d is None else jnp.sum(d, axis=0).reshape(p.param_shape)
                 for d in (dscale, doffset))
