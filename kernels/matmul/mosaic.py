"""Matmul as a Pallas kernel lowered through Mosaic (TPU).

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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _targets
from kernels._blocks import LANES, require_floating, sublanes
from kernels._pallas import mosaic_call, mosaic_precision, pl, pltpu, vmem_limit
from kernels.matmul.common import MatmulConfig, Problem, batch_index, dot, flops_and_bytes

_MAX_BLOCK = 512


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset block sizes: the whole dim when it is <= 512, else 512."""
    config = config or MatmulConfig()

    def fit(dim: int) -> int:
        return dim if dim <= _MAX_BLOCK else _MAX_BLOCK

    return dataclasses.replace(config, block_m=config.block_m or fit(p.m),
                               block_n=config.block_n or fit(p.n),
                               block_k=config.block_k or fit(p.k))


def _layouts(p: Problem):
    """Per array (A, B, output): its dtype and the (config field, array dim) of its last two
    dims in stored layout, the ones TPU tiling constrains."""
    a = (("block_k", p.k), ("block_m", p.m)) if p.transpose_a else (("block_m", p.m),
                                                                    ("block_k", p.k))
    b = (("block_n", p.n), ("block_k", p.k)) if p.transpose_b else (("block_k", p.k),
                                                                    ("block_n", p.n))
    return ((p.a_dtype, a), (p.b_dtype, b), (p.out_dtype, (("block_m", p.m), ("block_n", p.n))))


def _block_shapes(p: Problem, config: MatmulConfig) -> list[tuple[int, int]]:
    """(A block, B block, output block) in the arrays' stored layouts."""
    return [tuple(getattr(config, field) for field, _ in dims) for _, dims in _layouts(p)]


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines float64, non-float operands and blocks over the TPU's VMEM; rejects blocks
    that break TPU tiling."""
    require_floating(a=p.a_dtype, b=p.b_dtype)
    if jnp.float64 in (p.a_dtype, p.b_dtype, p.out_dtype):
        raise NotImplementedError("float64 is not supported on TPU")
    if p.is_empty:
        return
    config = resolve_config(p, config)
    for dtype, dims in _layouts(p):
        for (field, dim), multiple in zip(dims, (sublanes(dtype), LANES)):
            size = getattr(config, field)
            if not isinstance(size, int) or size < 1 or (size % multiple and size != dim):
                raise ValueError(
                    f"config.{field}={size!r} breaks TPU tiling for mosaic: this block dim of a "
                    f"{jnp.dtype(dtype).name} array must be a multiple of {multiple} or equal "
                    f"the array dim {dim}")
    needed, target = vmem_bytes(p, config), _targets.current("tpu")
    if needed > target.vmem_budget:
        raise NotImplementedError(
            f"blocks of {config.block_m}x{config.block_n}x{config.block_k} need about {needed} "
            f"bytes of VMEM a step, over {target.name}'s budget of {target.vmem_budget}")


def vmem_bytes(p: Problem, config: MatmulConfig) -> int:
    """VMEM of one step: A, B and output blocks double-buffered, the float32 accumulator, and
    the float32 product of the step's dot before it is added."""
    a_block, b_block, out_block = _block_shapes(p, config)
    blocks = (math.prod(a_block) * jnp.dtype(p.a_dtype).itemsize
              + math.prod(b_block) * jnp.dtype(p.b_dtype).itemsize
              + math.prod(out_block) * jnp.dtype(p.out_dtype).itemsize)
    return 2 * blocks + 2 * 4 * math.prod(out_block)


def _zero_past_k(x: jax.Array, k_axis: int, p: Problem, block_k: int) -> jax.Array:
    """Zeroes the padding past K in a ragged last K block (padding may hold NaN or Inf)."""
    k = pl.program_id(3) * block_k + lax.broadcasted_iota(jnp.int32, x.shape, k_axis)
    return jnp.where(k < p.k, x, jnp.zeros_like(x))


def _matmul_kernel(a_ref, b_ref, out_ref, acc_ref, *, p: Problem, block_k: int, precision):
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
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def matmul(a: jax.Array, b: jax.Array, p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array:
    """`op(a) @ op(b)` for a problem that `check` accepted; returns out_batch + (M, N)."""
    config = resolve_config(p, config)
    a_block, b_block, out_block = _block_shapes(p, config)

    def a_index(i, r, c, k):
        block = (k, r) if p.transpose_a else (r, k)
        return (batch_index(i, p.out_batch, p.a_batch), *block)

    def b_index(i, r, c, k):
        block = (c, k) if p.transpose_b else (k, c)
        return (batch_index(i, p.out_batch, p.b_batch), *block)

    grid = (p.num_batches, pl.cdiv(p.m, config.block_m), pl.cdiv(p.n, config.block_n),
            pl.cdiv(p.k, config.block_k))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=grid,
        in_specs=[pl.BlockSpec((None, *a_block), a_index),
                  pl.BlockSpec((None, *b_block), b_index)],
        out_specs=pl.BlockSpec((None, *out_block), lambda i, r, c, k: (i, r, c)),
        scratch_shapes=[pltpu.VMEM(out_block, jnp.float32)],
    )
    kernel = functools.partial(_matmul_kernel, p=p, block_k=config.block_k,
                               precision=mosaic_precision(precision))
    out = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.num_batches, p.m, p.n), p.out_dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, config)),
        name="matmul_mosaic",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]))
    return out.reshape(*p.out_batch, p.m, p.n)
