"""Pure `jax.numpy`/`lax` definitions of every op: the semantics the kernels must match."""

from .conv2d import conv2d
from .gather import gather
from .matmul import matmul
from .normalize import layer_norm, normalize, rms_norm

__all__ = ["conv2d", "matmul", "normalize", "layer_norm", "rms_norm", "gather"]
