"""How big the Triton matmul kernel's tiles are (the kernel itself is in
`forward.py` beside it): the config (`resolve_config`: tiles by shape class, shrunk until
every SM has one, split-K where the tiles alone leave SMs idle), the K split each program takes
(`k_split`) and the checks that decline a problem or reject a config (`check`); the bytes a
launch moves are `common.moved_bytes`."""

from __future__ import annotations

import math

import jax.numpy as jnp

from kernels._blocks import (K_MAJOR_MIN_REUSE, MIN_PIPELINED_STEPS, Split, check_triton_config,
                             fill_sms, is_positive_int, is_power_of_2, max_splits, nonempty_splits,
                             require_floating, require_shared_memory, split_reduction,
                             tensor_float32, triton_block, triton_dot_shared_bytes)
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes, num_tiles

__all__ = ["resolve_config", "check", "k_split", "k_major_copies"]


def _largest_blocks(p: Problem) -> tuple[int, int]:
    """(output tile side, K slice) caps: float64 tiles take twice the registers; 16-bit tiles
    afford a deeper K slice."""
    itemsize = jnp.dtype(p.compute_dtype).itemsize
    if itemsize >= 8:
        return 64, 32
    return 128, 64 if itemsize <= 2 else 32


def _split_k(p: Problem, block_m: int, block_n: int, block_k: int, asked: int | None) -> int:
    """Programs per output tile: `asked`, less any split that would get no K block, or, when
    None, from the shape ("Configs by shape")."""
    num_k_blocks = pl.cdiv(p.k, block_k)
    if asked is not None:
        return nonempty_splits(num_k_blocks, asked)
    partial_bytes = p.num_batches * p.m * p.n * 4
    return split_reduction(num_tiles(p, block_m, block_n), num_k_blocks,
                           min_steps=MIN_PIPELINED_STEPS,
                           max_splits=max_splits(flops_and_bytes(p)[1], partial_bytes)).splits


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields from the shape class (module docstring, "Configs by shape")."""
    config = config or MatmulConfig()
    max_block, max_k = _largest_blocks(p)
    block_m, block_n = fill_sms(triton_block(p.m, max_block), triton_block(p.n, max_block),
                                lambda rows, cols: num_tiles(p, rows, cols))
    block_m = block_m if config.block_m is None else config.block_m
    block_n = block_n if config.block_n is None else config.block_n
    block_k = triton_block(p.k, max_k) if config.block_k is None else config.block_k
    split_k = config.split_k
    blocks_valid = all(is_power_of_2(b) for b in (block_m, block_n, block_k))
    if blocks_valid and (split_k is None or is_positive_int(split_k)):  # else check() rejects
        split_k = _split_k(p, block_m, block_n, block_k, split_k)
    # A transposed A tile is relaid out in registers before the MMA: at 4 warps a 64x64 tile
    # with a 64-deep 16-bit K slice spills on sm_80 (128 registers), at 8 it takes 74.
    num_warps = config.num_warps or (8 if block_m * block_n >= 128 * 128 or p.transpose_a
                                     else 4)
    return MatmulConfig(block_m, block_n, block_k, config.group_m, num_warps,
                        config.num_stages or 3, split_k)


def k_major_copies(p: Problem, precision) -> tuple[bool, bool]:
    """(A, B): which float32 operands XLA copies transposed for a TF32 product, so the kernel
    loads both K-major (`kernels._blocks.K_MAJOR_MIN_REUSE`): B stored (K, N) (every
    forward), A stored (K, M) (the weight gradient Aᵀ @ dC), where each element meets enough
    output rows (B) or columns (A), counted over the batches that share it. A 16-bit operand
    of a TF32 product (bfloat16 weights against a float32 input) still loads 16 bytes
    at a time MN-major (sm_90 PTX), cast in registers: it is not copied."""
    if not tensor_float32(p.compute_dtype, precision):
        return False, False
    rows_per_b = p.num_batches * p.m // math.prod(p.b_batch)
    cols_per_a = p.num_batches * p.n // math.prod(p.a_batch)
    return (p.transpose_a and p.a_dtype.itemsize == 4 and cols_per_a >= K_MAJOR_MIN_REUSE,
            not p.transpose_b and p.b_dtype.itemsize == 4 and rows_per_b >= K_MAJOR_MIN_REUSE)


def k_split(p: Problem, config: MatmulConfig) -> Split:
    num_k_blocks = pl.cdiv(p.k, config.block_k)
    return Split(config.split_k, pl.cdiv(num_k_blocks, config.split_k))


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines non-float operands, an epilogue it cannot apply and blocks over the GPU's
    shared memory; rejects a config that Triton cannot compile."""
    require_floating(a=p.a_dtype, b=p.b_dtype)
    require_supported(p.epilogue, p.a_dtype, p.b_dtype, p.out_dtype)
    config = resolve_config(p, config)
    check_triton_config(config, ("block_m", "block_n", "block_k"))
    itemsize = max(jnp.dtype(p.a_dtype).itemsize, jnp.dtype(p.b_dtype).itemsize)
    require_shared_memory(triton_dot_shared_bytes(config.block_m, config.block_n, config.block_k,
                                                  itemsize, config.num_stages))
    for field in ("group_m", "split_k"):
        if not is_positive_int(getattr(config, field)):
            raise ValueError(f"config.{field} must be a positive int, got "
                             f"{getattr(config, field)!r}")
