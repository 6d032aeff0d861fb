"""matmul's forward and backward on the Mosaic GPU GEMM engine (`kernels.gemm.mosaic_gpu`,
whose docstring has the loop nests): the product of the op's arrays, as stored or transposed.

Block schedule
--------------
One launch of the engine's persistent kernel a product (`launch.gemm`): grid = (num_ctas,), at
most one CTA an SM, walking work items of (split, batch, output tile), the tiles of a batch in
planar-snake order. A CTA's item reads, K step by K step, the (block_m, block_k) tile of A and
the (block_k, block_n) tile of B by TMA into a ring of `Plan.stages` shared-memory slots, and
multiplies them on the tensor cores into a float32 accumulator (Hopper: two consumer
warpgroups of block_m / 2 rows each, in registers; Blackwell: one tcgen05 tile of 128 rows in
tensor memory); the epilogue (bias, activation, residual; z beside it where saved) runs on the
accumulator in column slices and stores each by TMA into the (M, N) output. Where the tiles
leave SMs idle K is split, each split's items writing float32 partials that XLA sums,
applying the epilogue in the same pass. The backward's dA = dZ @ Bᵀ and dB = Aᵀ @ dZ are the
same launch on the stored arrays, transposed (16-bit) or copied K-major (TF32).
"""

from __future__ import annotations

import jax

from kernels.gemm.mosaic_gpu.launch import gemm
from kernels.matmul.common import MatmulConfig, Problem

__all__ = ["matmul"]


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` with `p.epilogue`, for a problem that `check` accepted (or the backward
    of one): out_batch + (M, N), and the pre-activation beside it where the epilogue saves it."""
    del precision  # `p.highest`: declined by `check`
    return gemm(a, b, bias, residual, p, config=config, interpret=interpret)
