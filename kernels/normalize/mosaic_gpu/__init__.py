"""normalize's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a). Work in progress: the forward of the rows layout (rows of a multiple of
128 elements, up to `config._MAX_ROW`), one pass; everything else declines with its reason.
The backward runs XLA's computation of the backward's formula (`common.backward_jnp`) until
its kernel is written.

Loop nest of the forward, per CTA (one warpgroup), rows r of its block (`forward.py`)::

    x[r, :] (+ residual[r, :])            -> registers (float32); sum[r, :] written
    mean[r] = sum(x[r, :]) / n            # RMS: none
    rstd[r] = rsqrt(sum((x[r, :] - mean[r])²) / n + epsilon)
    y[r, :] = (x[r, :] - mean[r]) * rstd[r] * scale + offset
"""

from __future__ import annotations

from kernels.normalize import common
from kernels.normalize.mosaic_gpu.config import check, resolve_config
from kernels.normalize.mosaic_gpu.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config"]


def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: common.Problem, *, config,
             interpret):
    """(dx, dscale, doffset) by XLA: the backward formula in jnp (`common.backward_jnp`), which
    the other implementations' backward kernels compute. Not a kernel yet."""
    del config, interpret
    return common.backward_jnp(p, x, scale, mean, rstd, gy, gmean, grstd, gsum)
