"""normalize's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a). Work in progress: the rows layout (rows of a multiple of 128 elements, up
to `config._MAX_ROW`), forward and backward, one pass each; everything else declines with its
reason.

Loop nests, per CTA (one warpgroup), rows r of a block::

    forward (`forward.py`), one block per CTA:
        x[r, :] (+ residual[r, :])            -> registers (float32); sum[r, :] written
        mean[r] = sum(x[r, :]) / n            # RMS: none
        rstd[r] = rsqrt(sum((x[r, :] - mean[r])²) / n + epsilon)
        y[r, :] = (x[r, :] - mean[r]) * rstd[r] * scale + offset
    backward (`backward.py`), CTA q walks blocks q, q + num_programs, ...:
        x̂ = (x[r, :] - mean[r]) * rstd[r];  gs = dy[r, :] * scale
        dx[r, :] = rstd[r] * (gs - mean(gs) - x̂ * mean(gs * x̂)) (+ dsum[r, :])
        acc_dscale += dy * x̂;  acc_doffset += dy      # written as CTA q's partial rows
"""

from __future__ import annotations

from kernels.normalize.mosaic_gpu.backward import backward
from kernels.normalize.mosaic_gpu.config import check, resolve_config
from kernels.normalize.mosaic_gpu.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config"]
