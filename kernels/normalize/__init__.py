"""`kernels.normalize` (and `layer_norm`, `rms_norm`): fused normalization kernels.

The public function validates its inputs (with the reference's own checks, so both raise the
same errors), views `x` as 3-D (`common.plan`: a free reshape, or a transpose when the
normalized axes are not contiguous) and routes to `_forward`, a `custom_vjp` that returns
(y, x + residual or None, mean, 1/std). Its backward runs the same implementation's fused backward
kernel through `_backward`, itself a `custom_vjp` whose derivative is JAX's derivative of the
backward's jnp form (`common.backward_jnp`), so `grad` of `grad` works. The statistics are
outputs of `_forward` (not hidden residuals) so that second-order gradients flow through them.

With `residual=`, the kernels add it on load and also write the sum (the next layer's
residual), so XLA neither writes `x + residual` nor reads it back; the backward saves the sum
(not x), and its kernel adds the sum's cotangent to dx, which is both x's and the residual's
gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding, PartitionSpec

from kernels import _dispatch, _targets, partition, registry
from kernels.registry import Op
from kernels.normalize import common, sharding
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.reference.normalize import Axis, check_arguments
from kernels.reference.normalize import normalize as reference_normalize

__all__ = ["normalize", "layer_norm", "rms_norm", "NormalizeConfig"]

OP = Op("normalize", reference_normalize, __name__, NormalizeConfig, sharding)


class _Static(NamedTuple):
    """The hashable, non-differentiable arguments of `_forward` and `_backward`."""

    implementation: str
    interpret: bool | str  # resolved by the dispatch: False, True or "strict"
    config: NormalizeConfig | None
    problem: Problem
    # The device the program is traced for (`_targets.program_device`), so that the backward,
    # traced later, is built for it too (`partition.partitioned`).
    device: Any = None


def _forward_whole(x, residual, scale, offset, static: _Static):
    return OP.module(static.implementation).forward(x, residual, scale, offset, static.problem,
                                                    config=static.config,
                                                    interpret=static.interpret)


def _backward_whole(x, scale, mean, rstd, gy, gmean, grstd, gsum, static: _Static):
    return OP.module(static.implementation).backward(x, scale, mean, rstd, gy, gmean, grstd,
                                                     gsum, static.problem, config=static.config,
                                                     interpret=static.interpret)


# Each device runs the kernels on its blocks of a mesh-sharded array (kernels.partition).
_forward_sharded = partition.partitioned(_forward_whole, sharding.forward_rule,
                                         sharding.forward_factors)
_backward_sharded = partition.partitioned(_backward_whole, sharding.backward_rule,
                                          sharding.backward_factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _forward(x, residual, scale, offset, static: _Static):
    """(y, x + residual or None, mean, rstd) on the 3-D view."""
    return _forward_sharded(x, residual, scale, offset, static)


def _forward_fwd(x, residual, scale, offset, static):
    # Calls the custom_vjp function, not the kernel: under grad-of-grad this rule is itself
    # differentiated, and only a custom_vjp tells JAX how to differentiate a pallas_call.
    x, residual, scale, offset = (None if a is None else a.value
                                  for a in (x, residual, scale, offset))
    y, summed, mean, rstd = _forward(x, residual, scale, offset, static)
    # The backward needs the array that was normalized: the sum, with a residual.
    return (y, summed, mean, rstd), (x if summed is None else summed, scale, mean, rstd)


def _forward_bwd(static, residuals, cotangents):
    x, scale, mean, rstd = residuals
    gy, gsum, gmean, grstd = cotangents
    if isinstance(gmean, SymbolicZero) and isinstance(grstd, SymbolicZero):
        # First order: the public functions return y alone, so the statistics' cotangents are
        # zero; the backward kernel then neither receives nor reads them.
        gmean = grstd = None
    if isinstance(gsum, SymbolicZero):
        gsum = None  # the sum is unused (or absent): nothing to add to dx
    gy, gmean, grstd = (_materialized(g) for g in (gy, gmean, grstd))
    dx, dscale, doffset = _backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, static)
    dx = partition.like(dx, x)
    # offset is not a residual; its gradient is typed like scale (same shape and rule)
    return (dx, dx if static.problem.has_residual else None, partition.like(dscale, scale),
            doffset if scale is None else partition.like(doffset, scale))


def _materialized(g):
    return jnp.zeros(g.aval.shape, g.aval.dtype) if isinstance(g, SymbolicZero) else g


_forward.defvjp(_forward_fwd, _forward_bwd, symbolic_zeros=True)
# Eager calls hit jit's cache instead of re-tracing and re-compiling the kernel each time.
_jitted_forward = jax.jit(_forward, static_argnums=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, static: _Static):
    """(dx, dscale, doffset) by the fused backward kernel."""
    return _backward_sharded(x, scale, mean, rstd, gy, gmean, grstd, gsum, static)


def _backward_fwd(x, scale, mean, rstd, gy, gmean, grstd, gsum, static):
    out = _backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, static)
    return out, (x, scale, mean, rstd, gy, gmean, grstd, gsum)


def _backward_bwd(static, residuals, cotangents):
    # Second order: JAX's derivative of the backward's jnp form (the fused kernels compute
    # first-order gradients only).
    _, vjp = jax.vjp(functools.partial(common.backward_jnp, static.problem), *residuals)
    return vjp(cotangents)


_backward.defvjp(_backward_fwd, _backward_bwd)


def _validate_options(subtract_mean: bool, config: NormalizeConfig | None, op: str) -> None:
    if not isinstance(subtract_mean, (bool, np.bool_)):
        raise TypeError(f"{op}: subtract_mean must be True or False, got {subtract_mean!r}")
    OP.validate(config, op)


def _normalize(x, scale, offset, residual, axis, epsilon, subtract_mean, out_dtype,
               out_sharding, implementation, interpret, config, op):
    x = jnp.asarray(x)
    scale, offset, residual = (None if a is None else jnp.asarray(a)
                               for a in (scale, offset, residual))
    axes, epsilon, y_dtype = check_arguments(x, scale, offset, axis, epsilon, op, residual,
                                             out_dtype)
    _validate_options(subtract_mean, config, op)
    perm, (outer, groups, reduced, rows) = common.plan(x.shape, axes)
    problem = Problem(outer, groups, reduced, rows, jnp.dtype(x.dtype), bool(subtract_mean),
                      epsilon, scale is not None, offset is not None, residual is not None,
                      None if y_dtype == x.dtype else y_dtype)
    checks = OP.checks(problem, config)
    out_sharding = partition.out_sharding(out_sharding, op, x.ndim)

    def call(name, interpret, out_sharding, x, scale, offset, residual):
        # y is elementwise in x: asked another sharding, only y moves (the sum keeps x's).
        if not registry.get(name).is_kernel:
            out = reference_normalize(x, scale, offset, axis=axis, epsilon=epsilon,
                                      subtract_mean=bool(subtract_mean), residual=residual,
                                      out_dtype=y_dtype)
            return _with_sharding(out, out_sharding)
        # The only copy: normalized axes that are not contiguous are moved last (common.plan).
        # The view merges runs of dims (before, normalized, after), sharded on Explicit axes
        # as `partition.grouped` can keep them; the results come back with x's sharding.
        first = x.ndim - len(axes) if perm is not None else axes[0]
        runs = ((0, first, len(axes)) if problem.rows else
                (first, len(axes), x.ndim - first - len(axes)))
        ordered_shape = x.shape if perm is None else tuple(x.shape[d] for d in perm)

        def view(a):
            return None if a is None else partition.grouped(
                a if perm is None else jnp.transpose(a, perm), runs)

        def unview(a):
            if a is None:
                return None
            a = partition.ungrouped(a, ordered_shape, runs)
            return partition.like(a if perm is None else jnp.transpose(a, np.argsort(perm)), x)

        params = [None if v is None else v.astype(problem.stat_dtype).reshape(problem.param_shape)
                  for v in (scale, offset)]
        static = _Static(name, interpret, config, problem, _targets.program_device())
        # The kernel's residual is sharded as x (its gradient is dx): a residual sharded
        # otherwise (replicated, say) is resharded here, and JAX's transpose of that reshard
        # types its gradient like it.
        residual = partition.like(residual, x)
        operands = partition.match_varying(view(x), view(residual), *params)
        y, summed, _, _ = _jitted_forward(*operands, static)
        return _with_sharding(unview(y) if residual is None else (unview(y), unview(summed)),
                              out_sharding)

    return _dispatch.run(op, implementation, interpret, checks, call, x, scale, offset,
                         residual, config=config, out_sharding=out_sharding,
                         empty=x.size == 0, dtype=x.dtype)


def _with_sharding(out, out_sharding):
    """y (alone or first of (y, x + residual)) with `out_sharding`."""
    if isinstance(out, tuple):
        return partition.constrain(out[0], out_sharding), out[1]
    return partition.constrain(out, out_sharding)


def normalize(
    x: jax.Array,
    scale: jax.Array | None = None,
    offset: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-5,
    subtract_mean: bool = True,
    residual: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`(x - mean) / sqrt(var + epsilon) * scale + offset` over `axis`, as fused kernels.

    `axis`: an int or a tuple of ints; `var` is the mean squared deviation. With
    `subtract_mean=False`: `x / sqrt(mean(x²) + epsilon) * scale + offset` (RMS norm).
    `scale`/`offset` have the shape of the normalized axes. Statistics in float32 (float64 for
    float64 `x`); the result has `out_dtype` (default `x.dtype`), rounded once.
    `residual` (x's shape and dtype): normalizes `x + residual` and returns the pair
    `(y, x + residual)`, both from one kernel, which reads x and residual once.
    `out_sharding`: y's sharding, as JAX's ops take it (the sum keeps x's).
    `implementation` and `interpret` choose the kernel as in docs/design.md; `config` sets
    block sizes. See `reference.normalize` for the meaning in plain jnp.
    """
    return _normalize(x, scale, offset, residual, axis, epsilon, subtract_mean, out_dtype,
                      out_sharding, implementation, interpret, config, "normalize")


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    offset: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-5,
    residual: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`normalize(x, scale, offset, axis=axis, epsilon=epsilon, ...)`; with `residual`, the
    pair `(layer_norm(x + residual), x + residual)`."""
    return _normalize(x, scale, offset, residual, axis, epsilon, True, out_dtype,
                      out_sharding, implementation, interpret, config, "layer_norm")


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-6,
    residual: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`normalize(x, scale, axis=axis, epsilon=epsilon, subtract_mean=False, ...)`; with
    `residual`, the pair `(rms_norm(x + residual), x + residual)`."""
    return _normalize(x, scale, None, residual, axis, epsilon, False, out_dtype,
                      out_sharding, implementation, interpret, config, "rms_norm")
