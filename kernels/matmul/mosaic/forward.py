"""The matmul kernel lowered through Mosaic (TPU) and its launch (the package's docstring has its
loop nest). The backward is this kernel on transposed operands (`kernels/matmul/__init__.py`).

Block schedule
--------------
grid = (num_batches, cdiv(M, block_m), cdiv(N, block_n), cdiv(K, block_k)), semantics
("parallel", "parallel", "parallel", "arbitrary"): the contraction is the last, sequential axis,
so the grid steps that revisit one output tile are consecutive.

Step (i, r, c, k) receives, already in VMEM through the BlockSpec pipeline (which prefetches
the next step's blocks while this one computes), the (block_m, block_k) block of A and the
(block_k, block_n) block of B, multiplies them on the MXU and adds the product into a float32
accumulator in VMEM scratch. The first K step zeroes the accumulator; the last casts it to the
output dtype and writes the (block_m, block_n) output block, which the pipeline copies to HBM
once.

Blocks respect TPU tiling: each block's last two dims are a multiple of (8, 128) (16 rows for
16-bit dtypes) or equal the array's. The defaults take a whole dim when it is <= 512 and 512
otherwise. Edge blocks past M or N read padding and their out-of-range writes are dropped, which
is harmless for rows and columns; past K the padding would be summed, so a ragged last K block
is masked to zero in both operands (zero, not just in one: padding may hold NaN or Inf).

A transposed operand (the backward pass's Aᵀ, Bᵀ) is read as a (block_k, block_m) block of its
stored layout and the transpose is folded into the dot's dimension numbers.

Memory traffic: the output is written once; A is read cdiv(N, block_n) times and B
cdiv(M, block_m) times, except that a block whose index does not change between consecutive
steps is not copied again: with one K block A is read once (`kernels._traffic.pipelined_bytes`
counts this for the cost estimate).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _epilogue
from kernels._pallas import mosaic_call, mosaic_precision, pl, pltpu, vmem_limit
from kernels.matmul.common import MatmulConfig, Problem, batch_index, dot, flops_and_bytes
from kernels.matmul.mosaic.config import block_shapes, resolve_config, vmem_bytes

__all__ = ["matmul"]


def _zero_past_k(x: jax.Array, k_axis: int, p: Problem, block_k: int) -> jax.Array:
    """Zeroes the padding past K in a ragged last K block (padding may hold NaN or Inf)."""
    k = pl.program_id(3) * block_k + lax.broadcasted_iota(jnp.int32, x.shape, k_axis)
    return jnp.where(k < p.k, x, jnp.zeros_like(x))


def _matmul_kernel(*refs, p: Problem, block_k: int, precision):
    (a_ref, b_ref), bias_ref, residual_ref, out_ref, z_ref = _epilogue.split_refs(
        refs[:-1], p.epilogue, 2)
    acc_ref = refs[-1]
    k_step = pl.program_id(3)
    a, b = a_ref[...], b_ref[...]
    if p.k % block_k:
        a = _zero_past_k(a, 0 if p.transpose_a else 1, p, block_k)
        b = _zero_past_k(b, 1 if p.transpose_b else 0, p, block_k)
    product = dot(a.astype(p.compute_dtype), b.astype(p.compute_dtype), p, precision)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += product

    @pl.when(k_step == pl.num_programs(3) - 1)
    def _():
        bias = None if bias_ref is None else bias_ref[...]
        residual = None if residual_ref is None else residual_ref[...]
        y, z = _epilogue.on_accumulator(acc_ref[...], bias, residual, p.epilogue)
        out_ref[...] = y.astype(out_ref.dtype)
        if z_ref is not None:
            z_ref[...] = z.astype(z_ref.dtype)


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` with `p.epilogue`, for a problem that `check` accepted: out_batch +
    (M, N), and the pre-activation beside it where the epilogue saves it."""
    config = resolve_config(p, config)
    a_block, b_block, out_block = block_shapes(p, config)

    def a_index(i, r, c, k):
        block = (k, r) if p.transpose_a else (r, k)
        return (batch_index(i, p.out_batch, p.a_batch), *block)

    def b_index(i, r, c, k):
        block = (c, k) if p.transpose_b else (k, c)
        return (batch_index(i, p.out_batch, p.b_batch), *block)

    grid = (p.num_batches, pl.cdiv(p.m, config.block_m), pl.cdiv(p.n, config.block_n),
            pl.cdiv(p.k, config.block_k))
    out_spec = pl.BlockSpec((None, *out_block), lambda i, r, c, k: (i, r, c))
    bias_spec = pl.BlockSpec((1, out_block[1]), lambda i, r, c, k: (0, c))
    epilogue_specs = [spec for spec, x in ((bias_spec, bias), (out_spec, residual))
                      if x is not None]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=grid,
        in_specs=[pl.BlockSpec((None, *a_block), a_index),
                  pl.BlockSpec((None, *b_block), b_index), *epilogue_specs],
        out_specs=out_spec if p.epilogue.saved is None else (out_spec, out_spec),
        scratch_shapes=[pltpu.VMEM(out_block, jnp.float32)],
    )
    kernel = functools.partial(_matmul_kernel, p=p, block_k=config.block_k,
                               precision=mosaic_precision(precision))
    outs = mosaic_call(
        kernel,
        out_shape=_epilogue.out_shapes((p.num_batches, p.m, p.n), p.out_dtype, p.epilogue),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        name="matmul_mosaic",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]),
      *_epilogue.operands(None if bias is None else bias.reshape(1, p.n),
                          None if residual is None else residual.reshape(p.num_batches, p.m, p.n)))
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, p.m, p.n), outs)
