"""Matmul as a Pallas kernel lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >=
0.12, Hopper sm_90a): persistent and warp-specialized, with the epilogue fused.

The loop nest, per CTA (tiles, stages and splits: `config.py`; the block schedule:
`forward.py`):

    for item in (split, batch, tile) items c, c + num_ctas, ...:   # tiles in planar-snake order
        producer warpgroup:   for kb in the split's K range:
                                  TMA a[i, rows, kb], b[i, kb, cols] -> ring slot kb % stages
        consumer w in 0, 1:   acc = 0                                # float32 registers
                              for kb in the split's K range:
                                  acc += a_slot[w's rows] @ b_slot    # wgmma, then release
                              for each column slice of acc:          # the epilogue
                                  out[s, i, rows, cols] = activation(acc + bias) + residual
                                  (TMA store through shared memory; z beside it when saved)

16-bit operands go to wgmma as stored, transposed or not (the backward's dA = dZ @ Bᵀ and
dB = Aᵀ @ dZ read the same arrays); float32 and mixed products run as TF32 on K-major copies
(`forward._operands`); an M, K or N that is not a whole TMA tile is padded by XLA
(`config.kernel_problem`). Declined: Blackwell (no wgmma; a tcgen05 kernel is not written),
float64, float32 at HIGHEST precision, and the interpreter under `jax_enable_x64`.
"""

from kernels.matmul.mosaic_gpu.config import check, resolve_config
from kernels.matmul.mosaic_gpu.forward import matmul

__all__ = ["matmul", "check", "resolve_config"]
