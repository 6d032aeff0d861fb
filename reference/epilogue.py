"""The meaning of the epilogue `kernels.matmul` and `kernels.conv2d` fuse:
`activation(product + bias) + residual`, computed in float32 (float64 where an operand is
float64) from the unrounded product and rounded once, to the dtype jnp gives that formula.

The activations are JAX's own functions (`ACTIVATIONS`). The argument checks here (`check`) are
the ones the public ops raise, so the reference and the kernels agree on what is valid.

A layer (`layer`: the epilogue on a product of x and w) has JAX's gradient, except with 16-bit
operands (`sixteen_bit`), whose gradient keeps its intermediates in the layer's dtype as JAX's
own unfused 16-bit layer does: the pre-activation z is saved rounded to it, and
dZ = g·activation'(z), computed in float32, is rounded to it before the two gradient products,
which are then 16-bit products accumulated in float32. dbias is summed from the unrounded dZ.
The operands decide (`preferred_element_type` does not). The rule is a `custom_vjp`, as every
kernel's gradient is: such a layer has reverse-mode derivatives only (no `jax.jvp`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .shardings import typed_like

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


def sixteen_bit(*dtypes: Any) -> jnp.dtype | None:
    """The dtype a layer's gradient keeps z and dZ in: the operands' where they are all one
    16-bit float dtype, else None (float32 and float64 layers keep the accumulator's)."""
    kinds = {jnp.dtype(d) for d in dtypes}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind is not None and kind.itemsize == 2 and jnp.issubdtype(
        kind, jnp.floating) else None


def layer(product: Callable[[jax.Array, jax.Array, Any], jax.Array], x: jax.Array, w: jax.Array,
          bias: Any, activation: str | None, residual: Any, dtype: Any,
          bias_axis: int = -1) -> jax.Array:
    """`apply` on `product(x, w, preferred_element_type)` (a matmul or convolution of the two
    operands): the product kept in the accumulator dtype for a floating `dtype`. For 16-bit
    operands its gradient is the 16-bit layer's (the module's docstring)."""
    accumulator = (accumulator_dtype(x.dtype, w.dtype, dtype) if is_rounded_once(dtype)
                   else None)
    sixteen = sixteen_bit(x.dtype, w.dtype)
    if sixteen is None or accumulator is None:
        return apply(product(x, w, accumulator), bias, activation, residual, dtype, bias_axis)

    @jax.custom_vjp
    def sixteen_bit_layer(x, w, bias, residual):
        return forward(x, w, bias, residual)[0]

    def forward(x, w, bias, residual):
        z = apply(product(x, w, accumulator), bias, None, None, accumulator, bias_axis)
        y = apply(z, None, activation, residual, dtype)
        return y, (x, w, z.astype(sixteen), bias, residual)

    def backward(saved, g):
        x, w, z, bias, residual = saved
        dz = g.astype(accumulator)
        if activation is not None:
            dz = jax.vjp(ACTIVATIONS[activation], z.astype(accumulator))[1](dz)[0]
        dbias = None if bias is None else jnp.sum(dz, axis=tuple(
            d for d in range(dz.ndim) if d != bias_axis % dz.ndim)).astype(bias.dtype)
        dx, dw = jax.vjp(lambda x, w: product(x, w, sixteen), x, w)[1](dz.astype(sixteen))
        dresidual = None if residual is None else _summed_to(
            g.astype(accumulator), jnp.shape(residual)).astype(jnp.result_type(residual))
        return dx, dw, typed_like(dbias, bias), typed_like(dresidual, residual)

    sixteen_bit_layer.defvjp(forward, backward)
    return sixteen_bit_layer(x, w, bias, residual)


def _summed_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`x` summed over the dims a value of `shape` was broadcast along to reach x's shape."""
    x = jnp.sum(x, axis=tuple(range(x.ndim - len(shape))))
    return jnp.sum(x, axis=tuple(d for d, n in enumerate(shape) if n == 1 and x.shape[d] != 1),
                   keepdims=True)


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
