"""normalize as Pallas kernels lowered through Triton (GPU): forward and fused backward.

Both kernels work on the 3-D view of `common` (rows `(1, groups, reduced)` or columns
`(outer, reduced, groups)`) with 2-D tiles of `block_groups` groups by `block_reduced` elements
(`(block_groups, block_reduced)` for rows, `(block_reduced, block_groups)` for columns). Every
load and store is masked to the array: the ragged tail of the groups and of the reduced axis
reads 0 and writes nothing, so any shape works without padding copies.

Forward block schedule
----------------------
grid = (outer, cdiv(groups, block_groups)). Program (o, b) normalizes groups
[b·block_groups, (b+1)·block_groups) of slab o.
- A group that fits one chunk (reduced <= block_reduced, the common layer-norm case): the tile
  is loaded once, its moments computed in registers (mean first, then the mean squared
  deviation), and y written once: one read and one write of HBM.
- Longer groups (e.g. 65536 features): a first loop over the cdiv(reduced, block_reduced)
  chunks merges per-chunk moments (Chan et al.'s parallel variance, stable for data with a large
  mean), a second loop re-reads each chunk (mostly from L2) and writes y.
The program also writes the group's mean and 1/std (statistics dtype) for the backward.

Backward block schedule
-----------------------
grid = (outer, num_partials). Inputs: x, dy, the saved mean and 1/std and their cotangents
(zero unless this is a second-order gradient). Per group the kernel needs sum(dy·scale) and
sum(dy·scale·x̂) before it can write dx.
- One chunk per group: program (o, q) walks the group blocks q, q + num_partials, ... of slab o;
  each block is loaded once (x and dy), its sums and dx computed in registers, dx written once,
  and the block's column sums of dy·x̂ and dy added to register accumulators; the program
  writes its one partial row of dscale and doffset at the end.
- Several chunks per group: num_partials = number of group blocks (one block per program); a
  first loop over chunks accumulates the sums, a second re-reads each chunk, writes dx and the
  chunk of the block's partial dscale/doffset row.
The (outer·num_partials, reduced) partial rows are summed by XLA afterwards: no float atomics,
so the result is the same on every run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import check_triton_config, int32_loop, is_power_of_2, next_power_of_2
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem, unpack_refs

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_MAX_TILE = 4096  # elements per tile (per input): what 4-8 warps hold in registers comfortably.


def _or(value, default):
    return default if value is None else value


def resolve_config(p: Problem, config: NormalizeConfig | None) -> NormalizeConfig:
    """Power-of-2 tiles of at most _MAX_TILE elements (half that for float64).

    Rows: the whole group in one chunk when it fits, then as many groups as fit. Columns: 32
    groups (a 128-byte contiguous run per reduced element, coalesced) then as many reduced
    elements as fit.
    """
    config = config or NormalizeConfig()
    max_tile = _MAX_TILE // 2 if jnp.dtype(p.dtype).itemsize == 8 else _MAX_TILE
    if p.rows:
        block_reduced = _or(config.block_reduced, min(next_power_of_2(p.reduced), max_tile))
        block_groups = _or(config.block_groups, min(
            next_power_of_2(p.groups), max(1, max_tile // max(1, block_reduced))))
    else:
        block_groups = _or(config.block_groups, min(next_power_of_2(p.groups), 32))
        block_reduced = _or(config.block_reduced, min(
            next_power_of_2(p.reduced), max(1, max_tile // max(1, block_groups))))
    tile = block_groups * block_reduced if is_power_of_2(block_groups * block_reduced) else 0
    num_warps = _or(config.num_warps, 8 if tile >= 4096 else 4 if tile >= 1024 else 1)
    return NormalizeConfig(block_groups, block_reduced, _or(config.num_partials, 256),
                           num_warps, _or(config.num_stages, 2))


def check(p: Problem, config: NormalizeConfig | None) -> None:
    """Declines dtypes other than float16/bfloat16/float32/float64; rejects a config Triton
    cannot compile."""
    common.check_dtype(p, _DTYPES)
    if p.size == 0:
        return  # nothing to launch: the wrapper returns the empty result itself
    config = resolve_config(p, config)
    check_triton_config(config, ("block_reduced", "block_groups"), min_block=1)
    if (not isinstance(config.num_partials, int) or isinstance(config.num_partials, bool)
            or config.num_partials < 1):
        raise ValueError(f"config.num_partials must be a positive int, got "
                         f"{config.num_partials!r}")


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

    def _stats_view(self, ref, outer):
        groups = pl.ds(self.group_start, self.block_groups)
        return ref.at[(outer, *self._orient(groups, pl.ds(jnp.int32(0), 1)))]

    def _stats_mask(self):
        return self.group_valid[:, None] if self.p.rows else self.group_valid[None, :]

    def load_stats(self, ref, outer) -> jax.Array:
        return triton_load(self._stats_view(ref, outer), mask=self._stats_mask(), other=0)

    def store_stats(self, ref, outer, value) -> None:
        triton_store(self._stats_view(ref, outer), value.astype(ref.dtype),
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


def _forward_kernel(*refs, p: Problem, config: NormalizeConfig):
    x_ref, scale_ref, offset_ref, outputs = unpack_refs(refs, p.has_scale, p.has_offset)
    y_ref, mean_ref, rstd_ref = outputs
    outer = pl.program_id(0)
    tiles = _Tiles(p, config, pl.program_id(1))
    dtype = p.stat_dtype
    num_chunks = pl.cdiv(p.reduced, config.block_reduced)

    def load(chunk):
        return tiles.load(x_ref, outer, chunk, dtype)

    def write(chunk, x, mean, rstd):
        scale = None if scale_ref is None else tiles.load_param(scale_ref, chunk, dtype)
        offset = None if offset_ref is None else tiles.load_param(offset_ref, chunk, dtype)
        y = common.affine(common.normalized(x, mean, rstd, p), scale, offset)
        tiles.store(y_ref, outer, chunk, y)

    if num_chunks == 1:  # the tile stays in registers: one read, one write
        x = load(0)
        mean, rstd = common.mean_and_rstd(common.chunk_moments(x, tiles.mask(0), p), p)
        write(0, x, mean, rstd)
    else:
        def merge(chunk, moments):
            chunk_moments = common.chunk_moments(load(chunk), tiles.mask(chunk), p)
            return common.Moments(*common.merge_moments(moments, chunk_moments, p))

        first = common.chunk_moments(load(0), tiles.mask(0), p)
        moments = lax.fori_loop(jnp.int32(1), jnp.int32(num_chunks), merge, first)
        mean, rstd = common.mean_and_rstd(moments, p)

        def write_chunk(chunk, carry):
            write(chunk, load(chunk), mean, rstd)
            return carry

        int32_loop(num_chunks, write_chunk, 0)
    tiles.store_stats(mean_ref, outer, mean)
    tiles.store_stats(rstd_ref, outer, rstd)


def forward(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, p: Problem, *,
            config: NormalizeConfig | None, interpret: bool):
    """(y, mean, rstd) for the view-shaped `x` of a problem that `check` accepted."""
    config = resolve_config(p, config)
    stats = jax.ShapeDtypeStruct(p.stats_shape, p.stat_dtype)
    kernel = functools.partial(_forward_kernel, p=p, config=config)
    args = [a for a in (x, scale, offset) if a is not None]
    return triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(p.view_shape, p.dtype), stats, stats),
        grid=(p.outer, pl.cdiv(p.groups, config.block_groups)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        cost_estimate=common.cost_estimate(common.forward_flops_and_bytes(p), p),
        name="normalize_forward_triton",
    )(*args)


def num_partials(p: Problem, config: NormalizeConfig) -> int:
    """Backward programs per slab (= partial dscale/doffset rows per slab)."""
    num_blocks = pl.cdiv(p.groups, config.block_groups)
    if pl.cdiv(p.reduced, config.block_reduced) > 1:
        return num_blocks  # one block per program: its chunks' partials are written directly
    return min(num_blocks, config.num_partials)


def _backward_kernel(*refs, p: Problem, config: NormalizeConfig, partials: int):
    x_ref, scale_ref, _, rest = unpack_refs(refs, p.has_scale, False)
    mean_ref, rstd_ref, gy_ref, gmean_ref, grstd_ref, dx_ref, *partial_refs = rest
    dscale_ref = partial_refs.pop(0) if p.has_scale else None
    doffset_ref = partial_refs.pop(0) if p.has_offset else None
    outer, program = pl.program_id(0), pl.program_id(1)
    partial_row = outer * partials + program
    dtype = p.stat_dtype
    num_chunks = pl.cdiv(p.reduced, config.block_reduced)
    num_blocks = pl.cdiv(p.groups, config.block_groups)
    group_axis = 1 - p.reduce_axis

    def block_gradient(group_block, accumulators):
        """dx of one group block; returns its partial dscale/doffset (single-chunk case) or
        writes them chunk by chunk (multi-chunk case)."""
        tiles = _Tiles(p, config, group_block)
        mean, rstd = tiles.load_stats(mean_ref, outer), tiles.load_stats(rstd_ref, outer)
        gmean, grstd = tiles.load_stats(gmean_ref, outer), tiles.load_stats(grstd_ref, outer)

        def load(chunk):
            x = tiles.load(x_ref, outer, chunk, dtype)
            g = tiles.load(gy_ref, outer, chunk, dtype)
            xhat = common.normalized(x, mean, rstd, p)
            gs = g if scale_ref is None else g * tiles.load_param(scale_ref, chunk, dtype)
            return g, gs, xhat

        def write(chunk, g, gs, xhat, sums):
            dx = common.input_gradient(gs, xhat, rstd, sums, gmean, grstd, p)
            tiles.store(dx_ref, outer, chunk, dx)
            # Groups past the edge loaded 0 but x̂ = -mean·rstd there: keep them out of the sums.
            valid = tiles.mask(chunk)
            zero = jnp.zeros_like(g)
            return (jnp.sum(jnp.where(valid, g * xhat, zero), axis=group_axis),
                    jnp.sum(jnp.where(valid, g, zero), axis=group_axis))

        if num_chunks == 1:
            g, gs, xhat = load(0)
            partial = write(0, g, gs, xhat, common.row_sums(gs, xhat, tiles.mask(0), p))
            return tuple(a + b for a, b in zip(accumulators, partial))

        def add_sums(chunk, sums):
            g, gs, xhat = load(chunk)
            chunk_sums = common.row_sums(gs, xhat, tiles.mask(chunk), p)
            return common.RowSums(*(a + b for a, b in zip(sums, chunk_sums)))

        zeros = jnp.zeros(p.tile_shape(config.block_groups, 1), dtype)
        sums = int32_loop(num_chunks, add_sums, common.RowSums(zeros, zeros))

        def write_chunk(chunk, carry):
            dscale, doffset = write(chunk, *load(chunk), sums)
            columns = pl.ds(tiles.chunk_start(chunk), config.block_reduced)
            valid = tiles.reduced_valid(chunk)
            if dscale_ref is not None:
                triton_store(dscale_ref.at[partial_row, columns], dscale, mask=valid)
            if doffset_ref is not None:
                triton_store(doffset_ref.at[partial_row, columns], doffset, mask=valid)
            return carry

        int32_loop(num_chunks, write_chunk, 0)
        return accumulators

    zeros = jnp.zeros((config.block_reduced,), dtype)
    if num_chunks == 1:
        def step(i, accumulators):
            return block_gradient(program + i * partials, accumulators)

        # Blocks past the last are fully masked: they add 0 and write nothing.
        dscale, doffset = int32_loop(pl.cdiv(num_blocks, partials), step, (zeros, zeros))
        columns = pl.ds(jnp.int32(0), config.block_reduced)  # see _Tiles.chunk_start
        valid = jnp.arange(config.block_reduced, dtype=jnp.int32) < p.reduced
        if dscale_ref is not None:
            triton_store(dscale_ref.at[partial_row, columns], dscale, mask=valid)
        if doffset_ref is not None:
            triton_store(doffset_ref.at[partial_row, columns], doffset, mask=valid)
    else:
        block_gradient(program, (zeros, zeros))


def backward(x, scale, mean, rstd, gy, gmean, grstd, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`."""
    config = resolve_config(p, config)
    partials = num_partials(p, config)
    partial = jax.ShapeDtypeStruct((p.outer * partials, p.reduced), p.stat_dtype)
    out_shape = [jax.ShapeDtypeStruct(p.view_shape, p.dtype)]
    out_shape += [partial] * (p.has_scale + p.has_offset)
    kernel = functools.partial(_backward_kernel, p=p, config=config, partials=partials)
    args = [a for a in (x, scale, mean, rstd, gy, gmean, grstd) if a is not None]
    outs = list(triton_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(p.outer, partials),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        cost_estimate=common.cost_estimate(
            common.backward_flops_and_bytes(p, p.outer * partials), p),
        name="normalize_backward_triton",
    )(*args))
    dx = outs.pop(0)
    dscale = jnp.sum(outs.pop(0), axis=0).reshape(p.param_shape) if p.has_scale else None
    doffset = jnp.sum(outs.pop(0), axis=0).reshape(p.param_shape) if p.has_offset else None
    return dx, dscale, doffset
