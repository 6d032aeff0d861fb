"""The meaning of the epilogue `kernels.matmul` and `kernels.conv2d` fuse:
`activation(product + bias) + residual`, computed in float32 (float64 where an operand is
float64) from the unrounded product and rounded once, to the dtype jnp gives that formula.

The activations are JAX's own functions (`ACTIVATIONS`). The argument checks here (`check`) are
the ones the public ops raise, so the reference and the kernels agree on what is valid.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ACTIVATIONS: dict[str | None, Callable[[jax.Array], jax.Array]] = {
    None: lambda z: z,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,
}


def is_identity(bias: Any, activation: str | None, residual: Any = None) -> bool:
    return bias is None and activation is None and residual is None


def check(op: str, out_shape: tuple[int, ...], features: int | None, bias: Any,
          activation: Any, residual: Any) -> None:
    """Raises naming the argument: an unknown activation, a bias that is not (features,) (or
    given where the output has no feature dim, `features` None), a residual that does not
    broadcast to the output."""
    if not isinstance(activation, (str, type(None))) or activation not in ACTIVATIONS:
        names = ", ".join(repr(a) for a in ACTIVATIONS)
        raise ValueError(f"{op}: activation must be one of {names}, got {activation!r}")
    if bias is not None:
        shape = tuple(np.shape(bias))
        if features is None:
            raise ValueError(f"{op}: bias needs an output with a feature dim (b of rank >= 2), "
                             f"got bias of shape {shape}")
        if shape != (features,):
            raise ValueError(f"{op}: bias must have shape ({features},) (the output features), "
                             f"got {shape}")
    if residual is not None:
        shape = tuple(np.shape(residual))
        try:
            fits = np.broadcast_shapes(shape, out_shape) == tuple(out_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{op}: residual of shape {shape} does not broadcast to the output "
                             f"shape {tuple(out_shape)}")


def result_dtype(product_dtype: Any, bias: Any, residual: Any) -> jnp.dtype:
    """The dtype jnp gives `activation(product + bias) + residual` (weak Python scalars and
    strict promotion as jnp treats them; activations keep their input's dtype)."""
    others = (x for x in (bias, residual) if x is not None)
    return jnp.dtype(jnp.result_type(jnp.dtype(product_dtype), *others))


def accumulator_dtype(*dtypes: Any) -> jnp.dtype:
    """float64 if any dtype is, else float32: where the epilogue is computed."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes if d is not None)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def is_rounded_once(dtype: Any) -> bool:
    """Whether the formula's result is computed from a float32 (float64) product and rounded
    once: floating results. Integer and complex ones take jnp's own arithmetic."""
    return jnp.issubdtype(dtype, jnp.floating)


def apply(product: jax.Array, bias: Any, activation: str | None, residual: Any,
          dtype: Any, bias_axis: int = -1) -> jax.Array:
    """`activation(product + bias) + residual` with the bias along `bias_axis` of the product:
    for a floating `dtype`, in `product`'s (accumulator) dtype and rounded once to `dtype`;
    else in jnp's own promotion."""
    rounded = is_rounded_once(dtype)
    cast = (lambda x: jnp.asarray(x, product.dtype)) if rounded else jnp.asarray
    z = product
    if bias is not None:
        axis = bias_axis % product.ndim
        z = z + cast(bias).reshape((1,) * axis + (-1,) + (1,) * (product.ndim - 1 - axis))
    y = ACTIVATIONS[activation](z)
    if residual is not None:
        y = y + jnp.broadcast_to(cast(residual), y.shape)
    return y.astype(dtype) if rounded else y
