"""The meaning of `kernels.matmul`: `jnp.matmul`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`a @ b` with NumPy broadcasting of batch dimensions and rank-1 promotion; `out_sharding`
    as `jnp.matmul` takes it."""
    return jnp.matmul(a, b, precision=precision, preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding)
