"""Dtype rules the kernels share, independent of the caller's promotion mode.

Under `jax_numpy_dtype_promotion="strict"` `jnp.result_type` and `jnp.promote_types` refuse
any two different dtypes, even bfloat16 with float32. The library's own choices (the dtype a
kernel computes in, the float32 accumulator of a 16-bit gradient) are not user arithmetic: they
follow JAX's standard lattice whatever the mode, so an op raises under "strict" exactly where
jnp does (mixed operands without `preferred_element_type`), and nowhere else.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["promoted"]


def promoted(*dtypes: Any) -> jnp.dtype:
    """`jnp.result_type(*dtypes)` under JAX's standard promotion, whatever the caller's mode."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*dtypes)
