"""What the matmul kernels share: the problem they solve, its block config and its cost.

Both kernels compute one batched product `out[i] = op(a[ia]) @ op(b[ib])`, where `op` is an
optional transpose folded into the kernel's indexing (the backward pass uses it to read `Bᵀ` and
`Aᵀ` without materializing them) and `ia`, `ib` follow NumPy broadcasting of the batch dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels._blocks import tensor_float32
from kernels._dtypes import promoted
from kernels._epilogue import Epilogue


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Block sizes of the matmul kernels; `None` fields are picked from the shapes.

    block_m, block_n: the output tile one program (Triton), grid step (Mosaic) or CTA (Mosaic
      GPU, whose two consumer warpgroups take block_m / 2 rows each) computes.
    block_k: the slice of the contraction read per step of the K loop.
    group_m: GPUs; rows of output tiles launched together so they share B tiles in L2.
    num_warps: Triton only; warps per program.
    num_stages: GPUs; pipeline depth (Triton's software pipeline, Mosaic GPU's TMA ring).
    split_k: GPUs; programs (work items) that share one output tile, each summing its own
      range of the contraction into float32 partials that are then added in a fixed order
      (1: never).
    """

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    group_m: int = 8
    num_warps: int | None = None
    num_stages: int | None = None
    split_k: int | None = None


class Problem(NamedTuple):
    """A batched product, after the public wrapper has normalized ranks.

    `a` has shape `a_batch + (M, K)` (`(K, M)` when transpose_a), `b` has `b_batch + (K, N)`
    (`(N, K)` when transpose_b); both batch shapes have the rank of `out_batch` and broadcast
    to it.
    """

    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    out_batch: tuple[int, ...]
    m: int
    n: int
    k: int
    transpose_a: bool
    transpose_b: bool
    a_dtype: jnp.dtype
    b_dtype: jnp.dtype
    out_dtype: jnp.dtype
    epilogue: Epilogue = Epilogue()
    highest: bool = False  # float32 asked at HIGHEST precision (IEEE float32, no TF32)

    @property
    def num_batches(self) -> int:
        return math.prod(self.out_batch)

    @property
    def is_empty(self) -> bool:
        """No kernel runs: the output has no elements, or K = 0 makes it all zeros."""
        return self.num_batches * self.m * self.n * self.k == 0

    @property
    def compute_dtype(self) -> jnp.dtype:
        """Both operands are cast to this inside the kernel before the dot."""
        return promoted(self.a_dtype, self.b_dtype)

    @property
    def accumulator_dtype(self) -> jnp.dtype:
        return jnp.float64 if self.compute_dtype == jnp.float64 else jnp.float32


def make_problem(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool,
                 out_dtype: jnp.dtype, epilogue: Epilogue = Epilogue(),
                 precision=None) -> Problem:
    *a_batch, a_rows, a_cols = a.shape
    *b_batch, b_rows, b_cols = b.shape
    m, k = (a_cols, a_rows) if transpose_a else (a_rows, a_cols)
    n = b_rows if transpose_b else b_cols
    out_batch = tuple(np.broadcast_shapes(tuple(a_batch), tuple(b_batch)))
    return Problem(tuple(a_batch), tuple(b_batch), out_batch, m, n, k, transpose_a,
                   transpose_b, a.dtype, b.dtype, jnp.dtype(out_dtype), epilogue,
                   not tensor_float32(jnp.float32, precision))


def batch_index(out_index: jax.Array, out_batch: tuple[int, ...],
                operand_batch: tuple[int, ...]) -> jax.Array:
    """Flat batch index of an operand for flat output batch index `out_index`.

    Walks the batch dims from the last: the operand contributes the output's coordinate where
    its dim is the output's, and 0 where it is broadcast (size 1).
    """
    operand_index, operand_stride = 0, 1
    for out_size, size in zip(reversed(out_batch), reversed(operand_batch)):
        if size != 1:
            operand_index = operand_index + (out_index % out_size) * operand_stride
        out_index = out_index // out_size
        operand_stride *= size
    return jnp.asarray(operand_index, jnp.int32)


def flops_and_bytes(p: Problem) -> tuple[int, int]:
    """2·M·N·K flops per batch; bytes if each operand is read once and each output written
    once (the op's minimum traffic), with the epilogue's (`Epilogue.bytes_per_output`)."""
    outputs = p.num_batches * p.m * p.n
    nbytes = (math.prod(p.a_batch) * p.m * p.k * jnp.dtype(p.a_dtype).itemsize
              + math.prod(p.b_batch) * p.k * p.n * jnp.dtype(p.b_dtype).itemsize
              + outputs * p.epilogue.bytes_per_output(p.out_dtype))
    return 2 * p.num_batches * p.m * p.n * p.k, nbytes


def num_tiles(p: Problem, block_m: int, block_n: int) -> int:
    """The (block_m, block_n) output tiles of every batch."""
    return p.num_batches * -(-p.m // block_m) * -(-p.n // block_n)


def moved_bytes(p: Problem, block_m: int, block_n: int, partial_bytes: int) -> int:
    """What a tiled launch moves: each output tile of each batch streams its (block_m, K) panel
    of A and (K, block_n) panel of B (the grouped tile order serves most re-reads from L2) and
    writes its output tile (with the epilogue's residual and saved pre-activation), or, split,
    `partial_bytes` of float32 partials that XLA reads back."""
    panels = (p.m * p.k * jnp.dtype(p.a_dtype).itemsize * -(-p.n // block_n)
              + p.k * p.n * jnp.dtype(p.b_dtype).itemsize * -(-p.m // block_m))
    outputs = p.num_batches * p.m * p.n
    written = partial_bytes or outputs * p.epilogue.bytes_per_output(p.out_dtype)
    return p.num_batches * panels + written


def dot(a: jax.Array, b: jax.Array, p: Problem, precision) -> jax.Array:
    """One tile product `op(a) @ op(b)` in the accumulator dtype."""
    dims = (((0,) if p.transpose_a else (1,), (1,) if p.transpose_b else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=p.accumulator_dtype)
