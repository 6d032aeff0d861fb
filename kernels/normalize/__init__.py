"""`kernels.normalize` (and `layer_norm`, `rms_norm`): fused normalization kernels.

The public function validates its inputs (with the reference's own checks, so both raise the
same errors), views `x` as 3-D (`common.plan`: a free reshape, or a transpose when the
normalized axes are not contiguous) and routes to `_forward`, a `custom_vjp` that returns
(y, mean, 1/std). Its backward runs the same implementation's fused backward kernel through
`_backward`, itself a `custom_vjp` whose derivative is JAX's derivative of the backward's jnp
form (`common.backward_jnp`), so `grad` of `grad` works. The statistics are outputs of
`_forward` (not hidden residuals) so that second-order gradients flow through them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from kernels import _dispatch, partition
from kernels._op import Op
from kernels.normalize import common, mosaic, sharding, triton
from kernels.normalize.common import NormalizeConfig, Problem
from reference.normalize import Axis, check_arguments
from reference.normalize import normalize as reference_normalize

__all__ = ["normalize", "layer_norm", "rms_norm", "NormalizeConfig"]

OP = Op("normalize", reference_normalize, {"triton": triton, "mosaic": mosaic},
        NormalizeConfig, sharding)


class _Static(NamedTuple):
    """The hashable, non-differentiable arguments of `_forward` and `_backward`."""

    implementation: str
    interpret: bool | str  # resolved by the dispatch: False, True or "strict"
    config: NormalizeConfig | None
    problem: Problem


def _forward_whole(x, scale, offset, s: _Static):
    return OP.module(s.implementation).forward(x, scale, offset, s.problem, config=s.config,
                                              interpret=s.interpret)


def _backward_whole(x, scale, mean, rstd, gy, gmean, grstd, s: _Static):
    return OP.module(s.implementation).backward(x, scale, mean, rstd, gy, gmean, grstd,
                                               s.problem, config=s.config,
                                               interpret=s.interpret)


# Each device runs the kernels on its blocks of a mesh-sharded array (kernels.partition).
_forward_kernel = partition.partitioned(_forward_whole, sharding.forward_rule,
                                        sharding.forward_factors)
_backward_kernel = partition.partitioned(_backward_whole, sharding.backward_rule,
                                         sharding.backward_factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _forward(x, scale, offset, s: _Static):
    """(y, mean, rstd) on the 3-D view."""
    return _forward_kernel(x, scale, offset, s)


def _forward_fwd(x, scale, offset, s):
    # Calls the custom_vjp function, not the kernel: under grad-of-grad this rule is itself
    # differentiated, and only a custom_vjp tells JAX how to differentiate a pallas_call.
    x, scale, offset = (None if a is None else a.value for a in (x, scale, offset))
    y, mean, rstd = _forward(x, scale, offset, s)
    return (y, mean, rstd), (x, scale, mean, rstd)


def _forward_bwd(s, residuals, cotangents):
    x, scale, mean, rstd = residuals
    gy, gmean, grstd = cotangents
    if isinstance(gmean, SymbolicZero) and isinstance(grstd, SymbolicZero):
        # First order: the public functions return y alone, so the statistics' cotangents are
        # zero; the backward kernel then neither receives nor reads them.
        gmean = grstd = None
    gy, gmean, grstd = (_materialized(g) for g in (gy, gmean, grstd))
    dx, dscale, doffset = _backward(x, scale, mean, rstd, gy, gmean, grstd, s)
    # offset is not a residual; its gradient is typed like scale (same shape and rule)
    return (partition.like(dx, x), partition.like(dscale, scale),
            doffset if scale is None else partition.like(doffset, scale))


def _materialized(g):
    return jnp.zeros(g.aval.shape, g.aval.dtype) if isinstance(g, SymbolicZero) else g


_forward.defvjp(_forward_fwd, _forward_bwd, symbolic_zeros=True)
# Eager calls hit jit's cache instead of re-tracing and re-compiling the kernel each time.
_jitted_forward = jax.jit(_forward, static_argnums=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _backward(x, scale, mean, rstd, gy, gmean, grstd, s: _Static):
    """(dx, dscale, doffset) by the fused backward kernel."""
    return _backward_kernel(x, scale, mean, rstd, gy, gmean, grstd, s)


def _backward_fwd(x, scale, mean, rstd, gy, gmean, grstd, s):
    out = _backward(x, scale, mean, rstd, gy, gmean, grstd, s)
    return out, (x, scale, mean, rstd, gy, gmean, grstd)


def _backward_bwd(s, residuals, cotangents):
    # Second order: JAX's derivative of the backward's jnp form (the fused kernels compute
    # first-order gradients only).
    _, vjp = jax.vjp(functools.partial(common.backward_jnp, s.problem), *residuals)
    return vjp(cotangents)


_backward.defvjp(_backward_fwd, _backward_bwd)


def _validate_options(subtract_mean: bool, config: NormalizeConfig | None, op: str) -> None:
    if not isinstance(subtract_mean, (bool, np.bool_)):
        raise TypeError(f"{op}: subtract_mean must be True or False, got {subtract_mean!r}")
    OP.check_config(config, op)


def _normalize(x, scale, offset, axis, epsilon, subtract_mean, implementation, interpret,
               config, op):
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    offset = None if offset is None else jnp.asarray(offset)
    axes, epsilon = check_arguments(x, scale, offset, axis, epsilon, op)
    _validate_options(subtract_mean, config, op)
    perm, (outer, groups, reduced, rows) = common.plan(x.shape, axes)
    problem = Problem(outer, groups, reduced, rows, jnp.dtype(x.dtype), bool(subtract_mean),
                      epsilon, scale is not None, offset is not None)
    checks = OP.checks(problem, config)

    def call(name, interpret, x, scale, offset):
        if name == "xla" or x.size == 0:
            # Size zero: an empty result of the right shape, nothing for a kernel to do.
            return reference_normalize(x, scale, offset, axis=axis, epsilon=epsilon,
                                       subtract_mean=bool(subtract_mean))
        # The only copy: normalized axes that are not contiguous are moved last (common.plan).
        moved = x if perm is None else jnp.transpose(x, perm)
        params = [None if v is None else v.astype(problem.stat_dtype).reshape(problem.param_shape)
                  for v in (scale, offset)]
        static = _Static(name, interpret, config, problem)
        view, *params = partition.match_varying(moved.reshape(problem.view_shape), *params)
        y, _, _ = _jitted_forward(view, *params, static)
        y = y.reshape(moved.shape)
        return y if perm is None else jnp.transpose(y, np.argsort(perm))

    return _dispatch.run(op, implementation, interpret, checks, call, x, scale, offset,
                         config=config)


def normalize(
    x: jax.Array,
    scale: jax.Array | None = None,
    offset: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-5,
    subtract_mean: bool = True,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array:
    """`(x - mean) / sqrt(var + epsilon) * scale + offset` over `axis`, as fused kernels.

    `axis`: an int or a tuple of ints; `var` is the mean squared deviation. With
    `subtract_mean=False`: `x / sqrt(mean(x²) + epsilon) * scale + offset` (RMS norm).
    `scale`/`offset` have the shape of the normalized axes. Statistics in float32 (float64 for
    float64 `x`); the result has `x.dtype` (see `reference.normalize`). `implementation` and
    `interpret` choose the kernel as in docs/design.md; `config` sets block sizes.
    """
    return _normalize(x, scale, offset, axis, epsilon, subtract_mean, implementation,
                      interpret, config, "normalize")


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    offset: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-5,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array:
    """`normalize(x, scale, offset, axis=axis, epsilon=epsilon)`."""
    return _normalize(x, scale, offset, axis, epsilon, True, implementation, interpret, config,
                      "layer_norm")


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-6,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: NormalizeConfig | None = None,
) -> jax.Array:
    """`normalize(x, scale, axis=axis, epsilon=epsilon, subtract_mean=False)`."""
    return _normalize(x, scale, None, axis, epsilon, False, implementation, interpret, config,
                      "rms_norm")
