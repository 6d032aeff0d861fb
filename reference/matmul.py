"""The meaning of `kernels.matmul`: `jnp.matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """`a @ b` with NumPy broadcasting of batch dimensions and rank-1 promotion."""
    return jnp.matmul(a, b, precision=precision, preferred_element_type=preferred_element_type)
