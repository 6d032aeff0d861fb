"""matmul's tiles on the Mosaic GPU GEMM engine: the engine plans a product itself
(`kernels.gemm.mosaic_gpu.config`: the CTA tile, K slice, stages, split-K and persistent grid
for the program's GPU, and the checks that decline a problem or a config), so the op's config
is the engine's plan of its problem."""

from kernels.gemm.mosaic_gpu.config import check, resolve_config

__all__ = ["check", "resolve_config"]
