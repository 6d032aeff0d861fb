"""Matmul on Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12, Hopper sm_90a and
Blackwell sm_100a): the GEMM engine's persistent, warp-specialized kernels with the epilogue
fused, run on the product's operands as they are (`forward.py`'s block schedule;
`kernels.gemm.mosaic_gpu`'s docstring has the loop nests, the tiles and what is declined).
conv2d runs on the same engine."""

from kernels.matmul.mosaic_gpu.config import check, resolve_config
from kernels.matmul.mosaic_gpu.forward import matmul

__all__ = ["matmul", "check", "resolve_config"]
