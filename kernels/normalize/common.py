"""What the normalize kernels share: the 3-D view they work on, the block config, the per-tile
maths (chunk moments and their merge, the backward formula) and the cost.

The view
--------
Any `x` and any set of normalized axes become a 3-D array without copying when the normalized
axes are contiguous in `x` (every case but e.g. `axis=(0, 2)`):

- rows layout, `(1, groups, reduced)`: the normalized axes are the trailing ones (layer norm over
  features). Each of the `groups` rows is normalized over its `reduced` contiguous elements.
- columns layout, `(outer, reduced, groups)`: the normalized axes are followed by others (the
  tutorial's `X.std(0)`). Each of the `groups` columns of each outer slab is normalized over
  `reduced` elements strided by `groups`.

Normalized axes that are not contiguous are moved to the end by `jnp.transpose` in the public
wrapper (one HBM copy in and one out; the only case that copies), giving the rows layout.

A kernel's 2-D tile is `(block_groups, block_reduced)` in the rows layout and
`(block_reduced, block_groups)` in the columns layout; `reduce_axis` says which tile axis is
reduced. Statistics (mean, 1/std) have the view's shape with the reduced dim set to 1, so they
broadcast against a tile in both layouts; `scale`/`offset` are viewed as `(1, reduced)` or
`(reduced, 1)` for the same reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels.reference.normalize import statistics_dtype


@dataclasses.dataclass(frozen=True)
class NormalizeConfig:
    """Block sizes of the normalize kernels; `None` fields are picked from the shapes.

    block_groups: groups (rows in layer norm, columns in the axis-0 standardization) that one
        program (Triton) or grid step (Mosaic) normalizes together.
    block_reduced: elements of each group read per chunk; a group longer than this is looped
        over in chunks (its statistics merged across chunks, Chan et al.'s parallel variance).
        Mosaic GPU: the columns of a row a CTA keeps in shared memory across its passes; a
        longer row is streamed, its pieces read again in each pass.
    num_partials: GPU backward only: programs (Triton: per outer slab and chunk; Mosaic GPU:
        CTAs) each accumulating one partial sum of dscale/doffset over the group blocks it
        walks (reduced afterwards, no atomics); by default enough for two waves of the GPU
        (Triton) or one CTA per SM (Mosaic GPU).
    num_warps, num_stages: Triton only; compiler params.
    """

    block_groups: int | None = None
    block_reduced: int | None = None
    num_partials: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


class Problem(NamedTuple):
    """One normalization, in the 3-D view described in the module docstring."""

    outer: int
    groups: int
    reduced: int
    rows: bool
    dtype: jnp.dtype
    subtract_mean: bool
    epsilon: float
    has_scale: bool
    has_offset: bool
    # The fused residual add: x + residual (both `dtype`) is what is normalized, and the
    # forward also writes it; its backward adds the sum's cotangent to dx (= dresidual).
    has_residual: bool = False
    out_dtype: jnp.dtype | None = None  # y's dtype, when it is not `dtype`

    @property
    def y_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype if self.out_dtype is None else self.out_dtype)

    @property
    def stat_dtype(self) -> jnp.dtype:
        return statistics_dtype(self.dtype)

    @property
    def view_shape(self) -> tuple[int, int, int]:
        if self.rows:
            return (self.outer, self.groups, self.reduced)
        return (self.outer, self.reduced, self.groups)

    @property
    def stats_shape(self) -> tuple[int, int, int]:
        return (self.outer, self.groups, 1) if self.rows else (self.outer, 1, self.groups)

    @property
    def param_shape(self) -> tuple[int, int]:
        return (1, self.reduced) if self.rows else (self.reduced, 1)

    @property
    def reduce_axis(self) -> int:
        """The reduced axis of a 2-D tile."""
        return 1 if self.rows else 0

    @property
    def view_reduce_axis(self) -> int:
        """The reduced axis of the 3-D view (and of the statistics, where it has size 1)."""
        return 2 if self.rows else 1

    @property
    def size(self) -> int:
        return self.outer * self.groups * self.reduced


def plan(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[tuple[int, ...] | None,
                                                                 tuple[int, int, int, bool]]:
    """(transpose permutation or None, (outer, groups, reduced, rows)) for normalizing `axes`
    (sorted, non-negative) of an array of `shape`."""
    perm = None
    if axes and axes != tuple(range(axes[0], axes[-1] + 1)):
        kept = tuple(d for d in range(len(shape)) if d not in axes)
        perm = kept + axes
        shape = tuple(shape[d] for d in perm)
        axes = tuple(range(len(kept), len(shape)))
    first = axes[0] if axes else len(shape)
    last = axes[-1] + 1 if axes else len(shape)
    outer, reduced, inner = (math.prod(shape[:first]), math.prod(shape[first:last]),
                             math.prod(shape[last:]))
    if inner == 1:
        return perm, (1, outer, reduced, True)
    return perm, (outer, inner, reduced, False)


# ----------------------------------------------------------------------------- tile maths
# Shared by the Triton and Mosaic kernels: plain jnp on 2-D tiles in the statistics dtype.


class Moments(NamedTuple):
    """Per-group count, mean and sum of squared deviations (M2) of the elements seen so far.
    With subtract_mean=False, `mean` stays 0 and M2 is the sum of squares."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array


def chunk_moments(x: jax.Array, valid: jax.Array, p: Problem) -> Moments:
    """Moments of the valid elements of each group of tile `x` (invalid ones may hold garbage).

    The mean is subtracted before squaring (two passes over the tile in registers/VMEM), so
    data with a large mean and a small spread keeps its precision.
    """
    axis = p.reduce_axis
    count = jnp.sum(valid.astype(x.dtype), axis=axis, keepdims=True)
    zero = jnp.zeros_like(x)
    if not p.subtract_mean:
        m2 = jnp.sum(jnp.where(valid, x * x, zero), axis=axis, keepdims=True)
        return Moments(count, jnp.zeros_like(count), m2)
    mean = jnp.sum(jnp.where(valid, x, zero), axis=axis, keepdims=True) / count
    deviation = jnp.where(valid, x - mean, zero)
    return Moments(count, mean, jnp.sum(deviation * deviation, axis=axis, keepdims=True))


def merge_moments(a: Moments, b: Moments, p: Problem) -> Moments:
    """Moments of the union of two disjoint sets of elements (Chan, Golub and LeVeque)."""
    count = a.count + b.count
    if not p.subtract_mean:
        return Moments(count, a.mean, a.m2 + b.m2)
    delta = b.mean - a.mean
    weight = b.count / count
    return Moments(count, a.mean + delta * weight, a.m2 + b.m2 + delta * delta * a.count * weight)


def merge_split_moments(means: jax.Array, m2s: jax.Array, counts: jax.Array,
                        p: Problem) -> Moments:
    """Moments of whole groups from those of disjoint splits of each group, stacked along the
    view's reduced axis (Chan et al.'s merge, all splits at once: the spread of the split means
    about the overall mean is added to the splits' own M2)."""
    axis = p.view_reduce_axis
    m2 = jnp.sum(m2s, axis=axis, keepdims=True)
    count = jnp.sum(counts, axis=axis, keepdims=True)
    if not p.subtract_mean:
        return Moments(count, jnp.zeros_like(m2), m2)
    mean = jnp.sum(counts * means, axis=axis, keepdims=True) / count
    spread = jnp.sum(counts * (means - mean) ** 2, axis=axis, keepdims=True)
    return Moments(count, mean, m2 + spread)


def mean_and_rstd(m: Moments, p: Problem) -> tuple[jax.Array, jax.Array]:
    """The saved statistics: mean (0 for RMS) and 1 / sqrt(var + epsilon)."""
    var = m.m2 / p.reduced
    return m.mean, lax.rsqrt(var + jnp.asarray(p.epsilon, var.dtype))


def normalized(x: jax.Array, mean: jax.Array, rstd: jax.Array, p: Problem) -> jax.Array:
    return (x - mean) * rstd if p.subtract_mean else x * rstd


def affine(xhat: jax.Array, scale: jax.Array | None, offset: jax.Array | None) -> jax.Array:
    y = xhat if scale is None else xhat * of_rank(scale, xhat.ndim)
    return y if offset is None else y + of_rank(offset, xhat.ndim)


def of_rank(param: jax.Array, ndim: int) -> jax.Array:
    """A scale or offset (a tile's (1, reduced), or the view's parameter shape) with leading
    unit dims up to `ndim`: broadcast explicitly, so the code holds under
    jax_numpy_rank_promotion="raise"."""
    return param.reshape((1,) * (ndim - param.ndim) + param.shape)


class GroupSums(NamedTuple):
    """Per-group sums (over each group's reduced elements: a row's, or a column's in the
    columns layout) the backward needs before it can write dx: sum(g·scale) and
    sum(g·scale·x̂)."""

    gs: jax.Array
    gs_xhat: jax.Array


def group_sums(gs: jax.Array, xhat: jax.Array, valid: jax.Array, p: Problem) -> GroupSums:
    zero = jnp.zeros_like(gs)
    axis = p.reduce_axis
    return GroupSums(jnp.sum(jnp.where(valid, gs, zero), axis=axis, keepdims=True),
                     jnp.sum(jnp.where(valid, gs * xhat, zero), axis=axis, keepdims=True))


def input_gradient(gs: jax.Array, xhat: jax.Array, rstd: jax.Array, sums: GroupSums,
                   gmean: jax.Array | None, grstd: jax.Array | None, p: Problem) -> jax.Array:
    """dx for one tile.

    With x̂ = (x - mean)·rstd and gs = dy·scale:
    dx = rstd·(gs - mean(gs) - x̂·mean(gs·x̂)) (no mean(gs) term for RMS), plus the paths
    through the saved statistics when they have cotangents (second-order gradients; None at
    first order): d mean/dx = 1/n and d rstd/dx = -rstd²·x̂/n.
    """
    n = p.reduced
    core = gs - xhat * (sums.gs_xhat / n)
    if p.subtract_mean:
        core = core - sums.gs / n
    dx = rstd * core
    if grstd is not None:
        dx = dx - grstd * (rstd * rstd) * xhat / n
    return dx + gmean / n if p.subtract_mean and gmean is not None else dx


def backward_jnp(p: Problem, x, scale, mean, rstd, gy, gmean, grstd, gsum=None,
                 across_devices=lambda sums: sums):
    """The backward kernels' function in plain jnp, on the 3-D view (`x`: the normalized
    array, the sum with a residual; `gsum`: the sum's cotangent, added to dx, or None).

    JAX differentiates it for the gradient of the backward kernel (grad of grad), where mean
    and rstd are independent inputs. With a normalized axis sharded over a mesh it is the
    per-device backward: `x` is one device's slice of each group, `across_devices` sums the
    per-group sums over the devices (a psum) and `p` is the whole problem (its `reduced`
    counts them all).
    Returns (dx, dscale, doffset) as the kernels do; dscale/doffset are None when absent.
    """
    axis = p.view_reduce_axis
    dtype = p.stat_dtype
    xhat = normalized(x.astype(dtype), mean, rstd, p)
    g = gy.astype(dtype)
    gs = g if scale is None else g * of_rank(scale, g.ndim)
    sums = GroupSums(across_devices(jnp.sum(gs, axis=axis, keepdims=True)),
                     across_devices(jnp.sum(gs * xhat, axis=axis, keepdims=True)))
    dx = input_gradient(gs, xhat, rstd, sums, gmean, grstd, p)
    dx = (dx if gsum is None else dx + gsum.astype(dtype)).astype(x.dtype)
    over = (0, 1) if p.rows else (0, 2)
    # keepdims then [0]: the (1, reduced) or (reduced, 1) parameter view of this slice.
    dscale = None if scale is None else jnp.sum(g * xhat, axis=over, keepdims=True)[0]
    doffset = jnp.sum(g, axis=over, keepdims=True)[0] if p.has_offset else None
    return dx, dscale, doffset


# ----------------------------------------------------------------------------- cost


def forward_flops_and_bytes(p: Problem) -> tuple[int, int]:
    """About 8 flops an element (moments, normalize, affine); bytes: `minimum_bytes` (x, and
    the residual, read once; y, and the sum, written once), scale/offset read, statistics
    written."""
    stat = jnp.dtype(p.stat_dtype).itemsize
    params = (p.has_scale + p.has_offset) * p.reduced * stat
    stats = 2 * p.outer * p.groups * stat
    return 8 * p.size + p.has_residual * p.size, minimum_bytes(p) + params + stats


def backward_flops_and_bytes(p: Problem, num_partials: int, stat_cotangents: bool,
                             sum_cotangent: bool = False) -> tuple[int, int]:
    """About 12 flops an element; bytes: x (the sum, with a residual) and dy read once, the
    sum's cotangent read when given, dx written once, statistics (and their cotangents, when
    given) read, and `num_partials` partial rows of dscale/doffset written."""
    item, stat = jnp.dtype(p.dtype).itemsize, jnp.dtype(p.stat_dtype).itemsize
    partials = (p.has_scale + p.has_offset) * num_partials * p.reduced * stat
    stats = (4 if stat_cotangents else 2) * p.outer * p.groups * stat
    tiles = p.size * ((2 + sum_cotangent) * item + jnp.dtype(p.y_dtype).itemsize)
    return 12 * p.size, tiles + p.has_scale * p.reduced * stat + stats + partials


def minimum_bytes(p: Problem) -> int:
    """x (and the residual) read once, y (and the sum) written once: the floor any forward
    implementation pays."""
    item = jnp.dtype(p.dtype).itemsize
    return p.size * ((1 + 2 * p.has_residual) * item + jnp.dtype(p.y_dtype).itemsize)


def check_dtype(p: Problem, allowed: tuple, device: str = "TPU") -> None:
    """Declines an `x` (or `out_dtype`) dtype the kernel does not take."""
    for what, dtype in (("x has dtype", p.dtype), ("out_dtype is", p.y_dtype)):
        if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in allowed):
            name = jnp.dtype(dtype).name
            if name == "float64":
                raise NotImplementedError(f"float64 is not supported on {device} ({what} "
                                          "float64)")
            raise NotImplementedError(f"{what} {name}; the kernel takes "
                                      f"{', '.join(jnp.dtype(d).name for d in allowed)}")
