"""The GEMM engine that matmul and conv2d share: the kernels, their work items, the NHWC
images they read in place and the fused epilogue live here, and each op's folder lays its
operands out for them (`kernels.matmul.mosaic_gpu`, `kernels.conv2d.mosaic_gpu`). No op's
kernels import another op's kernels: what two ops run in common is in this package, whose
problem is matmul's (`kernels.matmul.common.Problem`, the GEMM every op's kernels here
state theirs in). Mosaic GPU's engine is `mosaic_gpu/`, imported only where the installed
jax has the backend (`kernels.registry`)."""
