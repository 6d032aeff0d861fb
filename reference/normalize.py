"""The meaning of `kernels.normalize`, `kernels.layer_norm` and `kernels.rms_norm`.

`y = (x - mean) * rsqrt(var + epsilon) * scale + offset` over `axis`, where `var` is the mean
squared deviation from the mean (computed as such, two passes, never as `E[x²] - E[x]²`).
With `subtract_mean=False`: `y = x * rsqrt(mean(x²) + epsilon) * scale + offset`.

Dtypes, defined here once for every implementation:
- the statistics and the whole expression are computed in float32, or in float64 when `x` is
  float64 (so bfloat16/float16 inputs are normalized in float32);
- `scale` and `offset` (any floating dtype, the shape of the normalized axes in their order in
  `x`) are cast to that computation dtype before use;
- the result is rounded once, to `out_dtype` (default `x.dtype`), whatever the dtypes of
  `scale` and `offset`.
Gradients are JAX's gradients of this function (`scale`'s gradient has `scale`'s dtype).

With `residual` (same shape and dtype as `x`), the normalized array is `x + residual`, and the
result is the pair `(y, x + residual)`: the pre-norm transformer's `h = x + residual;
y = norm(h)`, where `h` is the next layer's residual. The sum is computed in the computation
dtype (exact for 16-bit inputs but in rare cases) and normalized unrounded; the returned sum
is rounded to `x.dtype` (bit for bit XLA's `x + residual`). Rounding it before normalizing
would be a rounding that compilers may legally skip (XLA's excess precision), so the fused
kernels and this reference agree on every backend only this way.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Axis = int | Sequence[int]


def statistics_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """float64 for float64 input, float32 for every narrower float."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _normalized_axes(axis: Axis, ndim: int, op: str) -> tuple[int, ...]:
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:
        raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
    out = []
    for a in axes:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {int(a)} is out of range for x of rank {ndim}")
        out.append(operator.index(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: axis {axis!r} repeats an axis")
    return tuple(sorted(out))


def check_arguments(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None,
                    axis: Axis, epsilon: float, op: str = "normalize",
                    residual: jax.Array | None = None, out_dtype=None
                    ) -> tuple[tuple[int, ...], float, jnp.dtype]:
    """Validates the arguments; returns (sorted non-negative axes, epsilon as a float, the
    result's dtype).

    Raises TypeError for a non-floating `x`, `scale`, `offset` or `out_dtype`, a `residual`
    whose dtype is not `x`'s, a malformed `axis` or a traced `epsilon`; ValueError for an axis
    out of range or repeated, a negative or NaN `epsilon`, a `residual` whose shape is not
    `x`'s, and a `scale`/`offset` whose shape is not that of the normalized axes.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must have a floating-point dtype, got {x.dtype}")
    if residual is not None:
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got "
                             f"{tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual must have x's dtype {x.dtype} (the sum is returned "
                            f"in it), got {residual.dtype}; cast one of them first")
    try:
        result_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    except TypeError:
        raise TypeError(f"{op}: out_dtype must be a floating-point dtype, got {out_dtype!r}"
                        ) from None
    if not jnp.issubdtype(result_dtype, jnp.floating):
        raise TypeError(f"{op}: out_dtype must be a floating-point dtype, got {out_dtype!r}")
    axes = _normalized_axes(axis, x.ndim, op)
    try:  # a traced epsilon raises here too (ConcretizationTypeError is a TypeError)
        eps = float(epsilon)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: epsilon must be a concrete real number, got {epsilon!r}"
                        ) from None
    if not eps >= 0:
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon!r}")
    param_shape = tuple(x.shape[a] for a in axes)
    for name, param in (("scale", scale), ("offset", offset)):
        if param is None:
            continue
        if not jnp.issubdtype(param.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must have a floating-point dtype, got {param.dtype}")
        if tuple(param.shape) != param_shape:
            raise ValueError(f"{op}: {name} must have the shape of the normalized axes "
                             f"{param_shape} (axis={axis!r} of x with shape {x.shape}), got "
                             f"shape {tuple(param.shape)}")
    return axes, eps, result_dtype


def normalize(
    x: jax.Array,
    scale: jax.Array | None = None,
    offset: jax.Array | None = None,
    *,
    axis: Axis = -1,
    epsilon: float = 1e-5,
    subtract_mean: bool = True,
    residual: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Layer/RMS normalization (or standardization) of `x` over `axis`; see the module doc.
    With `residual`: `(normalize(x + residual), x + residual)`."""
    x = jnp.asarray(x)
    scale, offset, residual = (None if a is None else jnp.asarray(a)
                               for a in (scale, offset, residual))
    axes, eps, result_dtype = check_arguments(x, scale, offset, axis, epsilon,
                                              residual=residual, out_dtype=out_dtype)
    dtype = statistics_dtype(x.dtype)
    xs = x.astype(dtype)
    if residual is not None:
        xs = xs + residual.astype(dtype)
    if subtract_mean:
        centered = xs - jnp.mean(xs, axis=axes, keepdims=True)
    else:
        centered = xs
    var = jnp.mean(jnp.square(centered), axis=axes, keepdims=True)
    y = centered * lax.rsqrt(var + jnp.asarray(eps, dtype))
    param_shape = tuple(n if d in axes else 1 for d, n in enumerate(x.shape))
    if scale is not None:
        y = y * scale.astype(dtype).reshape(param_shape)
    if offset is not None:
        y = y + offset.astype(dtype).reshape(param_shape)
    y = y.astype(result_dtype)
    return y if residual is None else (y, xs.astype(x.dtype))


def layer_norm(x: jax.Array, scale: jax.Array | None = None, offset: jax.Array | None = None,
               *, axis: Axis = -1, epsilon: float = 1e-5, residual: jax.Array | None = None,
               out_dtype=None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`normalize(x, scale, offset, axis=axis, epsilon=epsilon, ...)`."""
    return normalize(x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=True,
                     residual=residual, out_dtype=out_dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, *, axis: Axis = -1,
             epsilon: float = 1e-6, residual: jax.Array | None = None,
             out_dtype=None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`normalize(x, scale, axis=axis, epsilon=epsilon, subtract_mean=False, ...)`."""
    return normalize(x, scale, axis=axis, epsilon=epsilon, subtract_mean=False,
                     residual=residual, out_dtype=out_dtype)
