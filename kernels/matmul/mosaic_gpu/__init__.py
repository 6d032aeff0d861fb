"""Matmul on Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12, Hopper sm_90a and
Blackwell sm_100a): the GEMM engine's persistent, warp-specialized kernels with the epilogue
fused, run on the product's operands as they are (`kernels.gemm.mosaic_gpu`, whose docstring
has the loop nests, the tiles and what is declined). conv2d runs on the same engine."""

from kernels.gemm.mosaic_gpu import check, matmul, resolve_config

__all__ = ["matmul", "check", "resolve_config"]
