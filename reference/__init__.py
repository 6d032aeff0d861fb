"""Pure `jax.numpy`/`lax` definitions of every op: the semantics the kernels must match."""

from reference.matmul import matmul

__all__ = ["matmul"]
