"""normalize as Pallas kernels lowered through Mosaic (TPU): forward and fused backward.

Each kernel's loop nest, per grid step (blocks: `mosaic_config.py`); x[o, b, c] is the VMEM
block of slab o, group block b and chunk c of the reduced axis, and step (u, k, phase, c)
works on block b = r·blocks_per_range + k of slab o, where u = o·ranges + r:

    forward, step (u, k, phase, c), where with a residual x[o, b, c] means x + r, added on
    load, and the step writing y also writes it to sum[o, b, c]:
        one chunk:  mean, rstd = moments(x[o, b, 0]);  y[o, b, 0] = affine((x - mean) * rstd)
        phase 0:    acc = merge(acc, moments(x[o, b, c]))              # VMEM scratch
        phase 1:    y[o, b, c] = affine((x[o, b, c] - mean(acc)) * rstd(acc))
    backward, step (u, k, phase, c):
        phase 0:    sums += (sum(dy·scale), sum(dy·scale·x̂)) over chunk c   # one chunk: in place
        phase 1:    dx[o, b, c] = input_gradient(x[o, b, c], dy[o, b, c], sums)
                                  (+ dsum[o, b, c], the sum output's cotangent, with a residual)
                    dscale_partial[u, c] += column sums of dy·x̂;  doffset_partial: of dy
                    # in VMEM through the range's blocks k; zeroed at k = 0

Both kernels work on the 3-D view of `common` (rows `(1, groups, reduced)` or columns
`(outer, reduced, groups)`) with VMEM blocks of `block_groups` groups by `block_reduced`
elements: `(block_groups, block_reduced)` for rows, `(block_reduced, block_groups)` for columns.
Blocks respect TPU tiling: the sublane dim is a multiple of 8 (16 for 16-bit dtypes) or the
whole array dim, the lane dim a multiple of 128 or the whole array dim. The defaults take the
whole group (reduced <= 16384) and as many groups as keep a block near 128K elements.

Block schedule (forward and backward alike)
-------------------------------------------
grid = (outer · ranges, blocks_per_range, phases, num_chunks), semantics ("parallel",
"arbitrary", "arbitrary", "arbitrary"), num_chunks = cdiv(reduced, block_reduced). With one
chunk per group the cdiv(groups, block_groups) group blocks are cut into ranges of consecutive
blocks, one per TensorCore (`core_ranges`: 2 on a megacore v4, else 1; a short last range's
extra step repeats its last block, and its masked groups add nothing); a core walks its range
in order, adding each block's dscale/doffset column sums into one partial row that stays in
VMEM. With two phases each block is its own range.
- One chunk per group (phases = 1, the common case): step (u, k, 0, 0) receives the block of x
  (and dy) in VMEM through the BlockSpec pipeline, computes the statistics (forward) or the two
  per-group sums (backward) and writes y (or dx) in the same step: x is read from HBM once and y
  written once.
- Several chunks (phases = 2): phase 0 walks the chunks accumulating, in VMEM scratch, the
  merged moments (forward; Chan et al.'s parallel variance) or the sums (backward); phase 1
  walks them again and writes y (dx). The output's index map sends every phase-0 step to chunk
  0, which phase 1 writes first, so each output block is written back once, after it is final.
Statistics and their cotangents are (1, block_groups) blocks, lane-dense in both layouts (see
`_Schedule.stats_spec`), and so are the scale/offset chunks and the partial dscale/doffset rows,
(1, block_reduced) in both layouts (`_Schedule.param_spec`).

Ragged edges: padding past `reduced` may hold anything (NaN in TPU interpret mode), so it is
masked out of every sum; padding past `groups` computes garbage whose writes are dropped, and
is masked out of the backward's dscale/doffset sums. Each range writes its own partial dscale
and doffset row of shape (1, reduced) once; XLA sums the rows afterwards (no atomics: the same
result on every run). One chunk per group: outer · ranges rows (1 for a layer norm on a v5e,
however many blocks); two phases: one per block.

Memory traffic: one read of x and one write of y per forward when a group fits one block (two
reads otherwise); backward: x and dy read once (twice for multi-chunk groups), dx written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import core_ranges, range_block
from kernels._pallas import mosaic_call, pl, pltpu, vmem_limit
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_config import check, resolve_config, vmem_bytes

__all__ = ["forward", "backward", "check", "resolve_config", "vmem_bytes"]

# A core walks its range of blocks in order: the backward's partial rows accumulate across
# them, and a short range's repeated block revisits its outputs (in order, so written back once).
_SEMANTICS = ("parallel", "arbitrary", "arbitrary", "arbitrary")


class _Schedule:
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

    def _orient(self, group_part, reduced_part):
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
            return (o, *self._orient(b, self._chunk(phase, c, last_phase)))
        return pl.BlockSpec((None, *self._orient(self.block_groups, self.block_reduced)), index)

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


def _lane_dense(param: jax.Array | None) -> jax.Array | None:
    """A `p.param_shape` scale/offset as the (1, reduced) row the kernels read."""
    return None if param is None else param.reshape(1, -1)


def _all_valid(shape) -> jax.Array:
    return jnp.ones(shape, jnp.bool_)


def _and(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def _zero_invalid(x: jax.Array, valid: jax.Array | None) -> jax.Array:
    return x if valid is None else jnp.where(valid, x, jnp.zeros_like(x))


def _forward_kernel(x_ref, residual_ref, scale_ref, offset_ref, y_ref, sum_ref, mean_ref,
                    rstd_ref, *moment_refs, p: Problem, s: _Schedule):
    """residual/sum: None refs without a residual; scale/offset: None refs when absent;
    `moment_refs`: the (count, mean, M2) accumulators of a two-phase schedule, none with one
    phase."""
    dtype = p.stat_dtype
    x = x_ref[...].astype(dtype)
    if residual_ref is not None:  # added in the statistics dtype (see reference.normalize)
        x = x + residual_ref[...].astype(dtype)
    valid = s.reduced_valid(x.shape)
    # Padding may be NaN: zero it before it meets any arithmetic.
    x = _zero_invalid(x, valid)

    def moments():
        return common.chunk_moments(x, _all_valid(x.shape) if valid is None else valid, p)

    def write(mean, rstd):
        scale, offset = s.load_param(scale_ref, dtype), s.load_param(offset_ref, dtype)
        y_ref[...] = common.affine(common.normalized(x, mean, rstd, p), scale,
                                   offset).astype(y_ref.dtype)
        if sum_ref is not None:
            sum_ref[...] = x.astype(sum_ref.dtype)
        s.store_stats(mean_ref, mean)
        s.store_stats(rstd_ref, rstd)

    if s.phases == 1:
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
    s = _Schedule(p, config)
    stats = jax.ShapeDtypeStruct(s.kernel_stats_shape(), p.stat_dtype)
    stats_block = s._orient(s.block_groups, 1)
    in_specs = [s.tile_spec(), s.tile_spec() if p.has_residual else None,
                s.param_spec(last_phase=True) if p.has_scale else None,
                s.param_spec(last_phase=True) if p.has_offset else None]
    scratch = [pltpu.VMEM(stats_block, p.stat_dtype)] * 3 if s.phases == 2 else []
    written = s.tile_spec(last_phase=True)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=s.grid, in_specs=in_specs,
        out_specs=[written, written if p.has_residual else None, s.stats_spec(),
                   s.stats_spec()],
        scratch_shapes=scratch)
    total = jax.ShapeDtypeStruct(p.view_shape, p.dtype) if p.has_residual else None
    y, total, mean, rstd = mosaic_call(
        functools.partial(_forward_kernel, p=p, s=s),
        out_shape=(jax.ShapeDtypeStruct(p.view_shape, p.y_dtype), total, stats, stats),
        grid_spec=grid_spec,
        dimension_semantics=_SEMANTICS,
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        flops=common.forward_flops_and_bytes(p)[0],
        transcendentals=p.outer * p.groups,
        name="normalize_forward_mosaic",
    )(x, residual, *map(_lane_dense, (scale, offset)))
    return y, total, s.from_kernel_stats(mean), s.from_kernel_stats(rstd)


def _backward_kernel(x_ref, scale_ref, mean_ref, rstd_ref, gy_ref, gmean_ref, grstd_ref,
                     gsum_ref, dx_ref, dscale_ref, doffset_ref, *sum_refs, p: Problem,
                     s: _Schedule):
    """x: the normalized array (x + residual with a residual); gmean/grstd: None refs unless a
    second-order gradient; gsum: the forward's sum output's cotangent, added to dx (None
    without a residual or when the sum is unused); dscale/doffset: None without parameters;
    `sum_refs`: the per-group sums accumulated by a two-phase schedule."""
    dtype = p.stat_dtype
    mean, rstd = s.load_stats(mean_ref), s.load_stats(rstd_ref)
    valid = s.reduced_valid(x_ref.shape)
    x = _zero_invalid(x_ref[...].astype(dtype), valid)
    g = _zero_invalid(gy_ref[...].astype(dtype), valid)
    xhat = common.normalized(x, mean, rstd, p)
    gs = g if scale_ref is None else g * s.load_param(scale_ref, dtype)

    def sums():
        return common.row_sums(gs, xhat, _all_valid(x.shape) if valid is None else valid, p)

    def write(total: common.RowSums):
        gmean, grstd = (None if ref is None else s.load_stats(ref)
                        for ref in (gmean_ref, grstd_ref))
        dx = common.input_gradient(gs, xhat, rstd, total, gmean, grstd, p)
        if gsum_ref is not None:
            dx = dx + gsum_ref[...].astype(dtype)
        dx_ref[...] = dx.astype(dx_ref.dtype)
        # Groups past the edge hold garbage (their dx writes are dropped); sum without them.
        in_groups = s.group_valid(x.shape)
        group_axis = 1 - p.reduce_axis
        if dscale_ref is not None:
            s.add_partial(dscale_ref, jnp.sum(_zero_invalid(g * xhat, _and(in_groups, valid)),
                                              axis=group_axis, keepdims=True))
        if doffset_ref is not None:
            s.add_partial(doffset_ref, jnp.sum(_zero_invalid(g, in_groups), axis=group_axis,
                                               keepdims=True))

    if s.phases == 1:
        write(sums())
        return
    gs_ref, gs_xhat_ref = sum_refs
    phase, chunk = pl.program_id(2), pl.program_id(3)

    @pl.when((phase == 0) & (chunk == 0))
    def _():
        gs_ref[...], gs_xhat_ref[...] = sums()

    @pl.when((phase == 0) & (chunk > 0))
    def _():
        chunk_sums = sums()
        gs_ref[...] += chunk_sums.gs
        gs_xhat_ref[...] += chunk_sums.gs_xhat

    @pl.when(phase == 1)
    def _():
        write(common.RowSums(gs_ref[...], gs_xhat_ref[...]))


def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool | str):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`. `x` is the
    normalized array (the forward's sum, with a residual); `gsum`, the sum's cotangent or
    None, is added to dx."""
    config = resolve_config(p, config)
    s = _Schedule(p, config)
    num_partials = s.num_partials
    partial_shape = (num_partials, 1, p.reduced)
    partial = jax.ShapeDtypeStruct(partial_shape, p.stat_dtype)
    stats_block = s._orient(s.block_groups, 1)
    stat_cotangents = gmean is not None
    cotangent_spec = s.stats_spec() if stat_cotangents else None
    in_specs = [s.tile_spec(), s.param_spec() if p.has_scale else None, s.stats_spec(),
                s.stats_spec(), s.tile_spec(), cotangent_spec, cotangent_spec,
                None if gsum is None else s.tile_spec(last_phase=True)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0, grid=s.grid, in_specs=in_specs,
        out_specs=[s.tile_spec(last_phase=True), s.partial_spec() if p.has_scale else None,
                   s.partial_spec() if p.has_offset else None],
        scratch_shapes=[pltpu.VMEM(stats_block, p.stat_dtype)] * 2 if s.phases == 2 else [])
    mean, rstd, gmean, grstd = map(s.to_kernel_stats, (mean, rstd, gmean, grstd))
    dx, dscale, doffset = mosaic_call(
        functools.partial(_backward_kernel, p=p, s=s),
        out_shape=(jax.ShapeDtypeStruct(p.view_shape, p.dtype),
                   partial if p.has_scale else None, partial if p.has_offset else None),
        grid_spec=grid_spec,
        dimension_semantics=_SEMANTICS,
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        flops=common.backward_flops_and_bytes(p, num_partials, stat_cotangents)[0],
        transcendentals=p.outer * p.groups,
        name="normalize_backward_mosaic",
    )(x, _lane_dense(scale), mean, rstd, gy, gmean, grstd, gsum)
    return dx, *(None if d is None else jnp.sum(d, axis=0).reshape(p.param_shape)
                 for d in (dscale, doffset))
