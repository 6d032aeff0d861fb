"""How normalization runs over a mesh (see `kernels.partition`), on the kernels' 3-D view.

Sharded groups (the rows of a layer norm: batch, sequence) and outer slabs run the fused
kernels locally; scale and offset are replicated (their gradients are summed over those
shards). A sharded normalized axis (a tensor-parallel hidden dim) cannot run the fused kernel,
which needs a whole group per program: each device computes its slice's moments, the moments
are combined by Chan's parallel merge (two all-reduces of per-group statistics: the mean from
the counts and means, then M2 from each slice's M2 and its mean's offset), and each device
normalizes its own slice (XLA's fused elementwise ops). Its backward likewise all-reduces the
two per-group sums of the gradient formula.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from kernels.normalize import common
from kernels.partition import Dims, Layout, Plan, Reduction


def _view_axes(static: Any, layout: Layout, params_at: slice
               ) -> tuple[Dims, Dims, Dims, tuple[str, ...]]:
    """(x dims, statistics dims, scale/offset dims, axes of outer+group shards); `params_at`:
    where scale/offset are among the operands."""
    p = static.problem
    x_dims = layout.dims[0]
    param_dims = next((d for d in layout.dims[params_at] if d is not None), None)
    used: set[str] = set()
    r = 2 if p.rows else 1
    g = 1 if p.rows else 2
    outer = layout.fit(p.outer, x_dims[0], used)
    groups = layout.fit(p.groups, x_dims[g], used)
    param_reduced = () if param_dims is None else param_dims[r - 1]
    reduced = layout.fit(p.reduced, x_dims[r] or param_reduced, used)
    view = [outer, (), ()]
    view[g], view[r] = groups, reduced
    stats = list(view)
    stats[r] = ()
    params = [(), ()]
    params[r - 1] = reduced
    return tuple(view), tuple(stats), tuple(params), (*outer, *groups)


def _local_static(static: Any, layout: Layout, view: Dims) -> Any:
    p = static.problem
    sizes = [n // layout.size(axes) for n, axes in zip(p.view_shape, view)]
    reduced = sizes[2] if p.rows else sizes[1]
    groups = sizes[1] if p.rows else sizes[2]
    return static._replace(problem=p._replace(outer=sizes[0], groups=groups, reduced=reduced))


def _shards(static: Any, layout: Layout, params_at: slice):
    """What both rules derive from the layout: the view's, statistics' and parameters' dims,
    the axes of the group shards, the per-device static, and the mesh axes of the normalized
    axis (empty when each device holds whole groups)."""
    view, stats, params, shards = _view_axes(static, layout, params_at)
    reduced = view[2 if static.problem.rows else 1]
    return view, stats, params, shards, _local_static(static, layout, view), reduced


def _factors(p: Any) -> tuple[str, str, str]:
    """Factor names of the view, the statistics and scale/offset."""
    if p.rows:
        return "o g r", "o g s", "t r"
    return "o r g", "o s g", "r t"


# The forward's operands are (x, residual, scale, offset); the backward's (x, scale, mean, rstd,
# dy, dmean, drstd, dsum). The residual and the sum (an output, and dsum) are laid out like x.
_FORWARD_PARAMS, _BACKWARD_PARAMS = slice(2, 4), slice(1, 2)


def forward_factors(static: Any, shapes: tuple) -> str:
    view, stats, params = _factors(static.problem)
    residual = [view] if shapes[1] is not None else []
    operands = ", ".join([view, *residual] + [params for shape in shapes[2:] if shape is not None])
    return f"{operands} -> {', '.join([view, *residual, stats, stats])}"


def forward_rule(forward: Any, static: Any, layout: Layout) -> Plan:
    view, stats, params, _, local_static, reduced = _shards(static, layout, _FORWARD_PARAMS)
    p = static.problem
    residual = None if layout.shapes[1] is None else view
    in_dims = (view, residual,
               *(None if shape is None else params for shape in layout.shapes[2:]))

    def local(x, residual, scale, offset):
        if not reduced:
            return forward(x, residual, scale, offset, local_static)
        return _forward_merged(x, residual, scale, offset, p, reduced)

    return Plan(in_dims, (view, residual, stats, stats), local, multiple=True)


def _forward_merged(x, residual, scale, offset, p: Any, axes: tuple[str, ...]):
    """(y, x + residual or None, mean, rstd) of a slice of each group, its moments merged over
    mesh `axes`."""
    axis = p.view_reduce_axis
    xs = x.astype(p.stat_dtype)
    if residual is not None:  # added in the statistics dtype (see reference.normalize)
        xs = xs + residual.astype(p.stat_dtype)
    summed = None if residual is None else xs.astype(p.dtype)
    count = x.shape[axis]
    if p.subtract_mean:
        local_mean = jnp.mean(xs, axis=axis, keepdims=True)
        local_m2 = jnp.sum(jnp.square(xs - local_mean), axis=axis, keepdims=True)
        mean = lax.psum(local_mean * count, axes) / p.reduced
        m2 = lax.psum(local_m2 + count * jnp.square(local_mean - mean), axes)
    else:
        mean = jnp.zeros(x.shape[:axis] + (1,) + x.shape[axis + 1:], p.stat_dtype)
        m2 = lax.psum(jnp.sum(jnp.square(xs), axis=axis, keepdims=True), axes)
    rstd = lax.rsqrt(m2 / p.reduced + jnp.asarray(p.epsilon, p.stat_dtype))
    y = common.affine(common.normalized(xs, mean, rstd, p), scale, offset)
    return y.astype(p.y_dtype), summed, mean, rstd


def backward_factors(static: Any, shapes: tuple) -> str:
    view, stats, params = _factors(static.problem)
    names = [view, params, stats, stats, view, stats, stats, view]
    operands = ", ".join(n for n, shape in zip(names, shapes) if shape is not None)
    has_scale, has_offset = shapes[1] is not None, static.problem.has_offset
    results = [view, params if has_scale else None, params if has_offset else None]
    return f"{operands} -> {', '.join(r for r in results if r)}"


def backward_rule(backward: Any, static: Any, layout: Layout) -> Plan:
    view, stats, params, shards, local_static, reduced = _shards(static, layout,
                                                                 _BACKWARD_PARAMS)
    p = static.problem
    sum_shards = Reduction(shards)  # dscale/doffset: partial sums over the group shards
    has_scale = layout.shapes[1] is not None
    stat_cotangents = stats if layout.shapes[5] is not None else None
    in_dims = (view, params if has_scale else None, stats, stats, view, stat_cotangents,
               stat_cotangents, None if layout.shapes[7] is None else view)

    def local(x, scale, mean, rstd, gy, gmean, grstd, gsum):
        if reduced:
            dx, dscale, doffset = common.backward_jnp(
                p, x, scale, mean, rstd, gy, gmean, grstd, gsum,
                across_devices=lambda sums: lax.psum(sums, reduced))
        else:
            dx, dscale, doffset = backward(x, scale, mean, rstd, gy, gmean, grstd, gsum,
                                           local_static)
        return (dx, *(None if d is None else sum_shards(d) for d in (dscale, doffset)))

    out_dims = (view, params if has_scale else None, params if p.has_offset else None)
    return Plan(in_dims, out_dims, local, multiple=True)
