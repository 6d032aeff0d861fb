"""The meaning of `kernels.matmul`: `jnp.matmul`, and its fused epilogue
(`reference.epilogue`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import epilogue


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    residual: jax.Array | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`activation(a @ b + bias) + residual`, with NumPy broadcasting of batch dimensions and
    rank-1 promotion; `out_sharding` as `jnp.matmul` takes it. Without an epilogue this is
    `jnp.matmul`; with one, the product is kept in float32 (float64) until the one rounding,
    and a 16-bit layer's gradient keeps z and dZ in its dtype (`epilogue.layer`)."""
    if epilogue.is_identity(bias, activation, residual):
        return jnp.matmul(a, b, precision=precision,
                          preferred_element_type=preferred_element_type,
                          out_sharding=out_sharding)
    product_dtype = preferred_element_type or jnp.result_type(a, b)
    dtype = epilogue.result_dtype(product_dtype, bias, residual)

    def product(a, b, preferred):
        return jnp.matmul(a, b, precision=precision,
                          preferred_element_type=preferred or preferred_element_type,
                          out_sharding=out_sharding)

    return epilogue.layer(product, a, b, bias, activation, residual, dtype)
