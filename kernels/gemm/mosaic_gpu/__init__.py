"""The GEMM engine on Mosaic GPU (jax >= 0.12), the kernels behind `implementation="mosaic_gpu"`
of matmul (`kernels.matmul.mosaic_gpu`) and conv2d (`kernels.conv2d.mosaic_gpu`): persistent
and warp-specialized, with the epilogue fused; Hopper's wgmma kernel (sm_90a, `hopper.py`) or
Blackwell's tcgen05 kernel (sm_100a, `blackwell.py`), picked for the program's GPU
(`config.mma_of`), launched by `launch.py` (`gemm` lays a product's operands out; `launch`
runs the kernel on operands laid out, or on NHWC images read in place, as conv2d's implicit
GEMM does: `tiles.Pixels`, `tiles.PixelSums`).

The loop nests, per CTA (tiles, stages and splits: `config.py`; what the kernels share, the
work items' order and the epilogue: `tiles.py`):

    for item in (split, batch, tile) items c, c + num_ctas, ...:   # tiles in planar-snake order
      Hopper (3 warpgroups):
        producer warpgroup:   for kb in the split's K range:
                                  TMA a[i, rows, kb], b[i, kb, cols]
                                      -> ring slot (the CTA's step) % stages
        consumer w in 0, 1:   acc = 0                                # float32 registers
                              for kb in the split's K range:
                                  acc += a_slot[w's rows] @ b_slot    # wgmma, then release
                              epilogue(acc)
      Blackwell (2 warpgroups):
        warp 0 of wg 0:       for kb: TMA a, b -> ring slot (the CTA's step) % stages
        warp 1 of wg 0:       acc[i % 2] = sum over kb of a_slot @ b_slot  # tcgen05, TMEM
        wg 1:                 epilogue(acc[i % 2]), slices loaded from tensor memory
                              (i: the item's place among this CTA's items)
      epilogue(acc): for each column slice:
                         out[s, i, rows, cols] = activation(acc + bias) + residual
                         (TMA store through shared memory; z beside it when saved)

16-bit operands go to the MMA as stored, transposed or not (the backward's dA = dZ @ Bᵀ and
dB = Aᵀ @ dZ read the same arrays). float32 and mixed products run on Hopper as TF32 on
K-major copies rounded to nearest TF32 (`launch.launch`), on Blackwell (whose tcgen05 has no
TF32 kind in jax 0.12.0.1) as bfloat16 parts hi + lo, each laid out once along K, whose terms
the kernel walks (`config.split_terms`, `tiles.Terms`); an M, K or N that is not a whole TMA
tile is padded by XLA (`config.kernel_problem`, `launch._operands`). Declined: float64,
float32 at HIGHEST precision, and the interpreter under `jax_enable_x64`. The interpreter
(which has no compute capability) runs Hopper's kernel; under a B200's abstract device
(`kernels._pallas.on_target`), with `interpret="strict"`, it runs Blackwell's
(tests/test_matmul_blackwell.py).
"""

from kernels.gemm.mosaic_gpu.config import check, resolve_config
from kernels.gemm.mosaic_gpu.launch import gemm, launch

__all__ = ["gemm", "launch", "check", "resolve_config"]
