"""How big the Mosaic GPU matmul kernel's tiles are (the kernel is in `forward.py` beside it):
the plan of one launch (`plan_of`: CTA tile, K slice, pipeline stages within shared memory,
split-K, the persistent grid) and the checks that decline a problem (`check`); the bytes a
launch moves are `common.moved_bytes`."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import (MIN_PIPELINED_STEPS, fill_sms, is_positive_int, max_splits,
                             nonempty_splits)
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes, num_tiles

__all__ = ["Plan", "plan_of", "kernel_problem", "resolve_config", "check", "epilogue_bytes",
           "CONSUMERS", "WG_ROWS",
           "EPILOGUE_COLUMNS", "SWIZZLE", "TMA_ROWS", "TMA_COLUMNS"]

CONSUMERS = 2  # compute warpgroups per CTA, each owning block_m / 2 rows of the CTA tile
WG_ROWS = 64  # wgmma's M: a consumer's rows are a multiple of it
SWIZZLE = 128  # bytes: the widest TMA swizzle; a K slice of this many bytes a row
# The accumulator leaves registers through shared memory in column slices this wide (a slice
# of the output, of z and of the residual per consumer), so the epilogue's buffers stay small
# beside the pipeline's stages.
EPILOGUE_COLUMNS = 64
# TMA copies whole tiles of the shared-memory layout: rows in 8s, a row's minor dim in 128-byte
# swizzle spans (64 16-bit elements; 32 float32). Mosaic GPU rejects a GMEM array whose last
# two dims are not multiples of them (jax 0.12.0.1: "dimension 2 must have size smaller or a
# multiple of its tiling 64, but got 1000"), so the wrapper pads an odd M, K or N to these.
TMA_ROWS, TMA_COLUMNS = 8, 64
MAX_STAGES = 4  # JAX's Hopper matmul's depth; more only adds shared memory at these tiles
# Shared memory beside the planned buffers: the pipeline's and the residual's barriers (8 bytes
# each) and alignment. `Target.shared_memory` (232,448 on an H100) is the opt-in limit per
# block, net of what the hardware reserves; Pallas' cross-warp reduction scratch is taken only
# by reductions, which this kernel has none of. Measured: the 3-stage 256x128x64 bfloat16 plan
# of 180,224 bytes compiled to 180,225 (jax 0.12.0.1, sm_90a).
BARRIER_BYTES = 1024
# A consumer's float32 accumulator elements: 128 x 192 is 192 registers a thread of its 232
# (setmaxnreg), leaving room for addresses and the epilogue.
MAX_ACCUMULATOR = 128 * 192
# Registers per thread of the TMA producer warpgroup (setmaxnreg): it holds only addresses
# and barrier phases, so the consumers get the rest (JAX's Hopper matmul: 40).
PRODUCER_REGISTERS = 40


class Plan(NamedTuple):
    """One launch: CTA tiles of (block_m, block_n) over K slices of block_k, `stages` of them
    in flight, each output tile's K range in `splits` pieces, `num_ctas` persistent CTAs."""

    block_m: int
    block_n: int
    block_k: int
    group: int  # output tiles a group of the planar snake walks along M before moving on
    stages: int
    splits: int
    num_ctas: int

    def tiles(self, p: Problem) -> int:
        return num_tiles(p, self.block_m, self.block_n)

    def k_blocks_per_split(self, p: Problem) -> int:
        return pl.cdiv(pl.cdiv(p.k, self.block_k), self.splits)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def epilogue_bytes(p: Problem, block_m: int, block_n: int, splits: int) -> int:
    """Shared memory of the epilogue: per consumer one column slice of the output (float32
    partials when split), of z and of the residual (in the output's dtype: `forward.matmul`)."""
    if splits > 1:
        per_element = 4
    else:
        per_element = _itemsize(p.out_dtype) * (1 + p.epilogue.has_residual) + (
            _itemsize(p.epilogue.saved) if p.epilogue.saved is not None else 0)
    return block_m * min(EPILOGUE_COLUMNS, block_n) * per_element


def _stages(p: Problem, block_m: int, block_n: int, block_k: int, splits: int) -> int:
    budget = _targets.current("gpu").shared_memory - BARRIER_BYTES
    stage = (block_m + block_n) * block_k * _itemsize(p.compute_dtype)
    return min(MAX_STAGES, (budget - epilogue_bytes(p, block_m, block_n, splits)) // stage)


def kernel_problem(p: Problem) -> Problem:
    """The problem the kernel runs (`forward._operands` lays the arrays out so): 16-bit
    operands of one dtype as they are; anything else as float32 (TF32), both K-major; M, K
    and N padded to TMA's tiles (`TMA_ROWS`, `TMA_COLUMNS`; M to a row of `TMA_COLUMNS` where
    A is stored (K, M))."""
    if not (p.a_dtype == p.b_dtype and _itemsize(p.a_dtype) == 2):
        f32 = jnp.dtype(jnp.float32)
        p = p._replace(transpose_a=False, transpose_b=True, a_dtype=f32, b_dtype=f32)
    m_step = TMA_COLUMNS if p.transpose_a else TMA_ROWS
    return p._replace(**{dim: pl.cdiv(size, step) * step for dim, size, step in
                         (("m", p.m, m_step), ("k", p.k, TMA_COLUMNS), ("n", p.n, TMA_COLUMNS))})


def _splits(p: Problem, tiles: int, num_k_blocks: int, asked: int | None) -> int:
    """K splits: `asked` (less any that would get no K block), else, where the output tiles
    leave SMs idle, as many as keep every work item in one round of the persistent CTAs
    (tiles x splits <= SMs) with at least `MIN_PIPELINED_STEPS` K steps each, and within
    `max_splits` of partial traffic."""
    if num_k_blocks <= 1:  # K = 0 (an empty product, never launched) or one block
        return 1
    if asked is not None:
        return nonempty_splits(num_k_blocks, asked)
    num_sms = _targets.current("gpu").num_sms
    if not 0 < tiles < num_sms:  # no output (never launched), or every SM has a tile
        return 1
    wanted = min(num_sms // tiles, num_k_blocks // MIN_PIPELINED_STEPS,
                 max_splits(flops_and_bytes(p)[1], p.num_batches * p.m * p.n * 4))
    return nonempty_splits(num_k_blocks, wanted)


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields for the kernel's problem (`kernel_problem`): a CTA tile of 2 x 128
    rows by 128 columns (64 rows a consumer where M fits in 128, 64 columns where N fits in
    64), halved while its tiles leave SMs idle (`fill_sms`, down to 64 rows a consumer and 64
    columns), with 64 rows a consumer where the epilogue's buffers leave no room for two
    stages; a K slice of `SWIZZLE` bytes, as many stages as shared memory holds (up to
    `MAX_STAGES`), split-K where the tiles still leave SMs idle (`_splits`). Smaller tiles
    first: they cost no extra traffic, where split-K writes float32 partials that XLA sums
    (the H100 record, `mosaic_gpu_runs`: at 1024^3 bfloat16, 32 tiles split 4 ways took 1.12x
    cuBLAS's time, where Triton's smaller tiles took 0.75x)."""
    config, p = config or MatmulConfig(), kernel_problem(p)
    block_m = config.block_m or (CONSUMERS * WG_ROWS if p.m <= CONSUMERS * WG_ROWS
                                 else CONSUMERS * 128)
    block_n = config.block_n or (64 if p.n <= 64 else 128)
    if config.block_m is None and config.block_n is None:
        consumer_rows, block_n = fill_sms(
            block_m // CONSUMERS, block_n,
            lambda rows, cols: num_tiles(p, CONSUMERS * rows, cols), min_block=WG_ROWS)
        block_m = CONSUMERS * consumer_rows
    block_k = config.block_k or SWIZZLE // _itemsize(p.compute_dtype)

    def plan(block_m):
        splits = _splits(p, num_tiles(p, block_m, block_n), pl.cdiv(p.k, block_k),
                         config.split_k)
        return splits, config.num_stages or _stages(p, block_m, block_n, block_k, splits)

    splits, stages = plan(block_m)
    if stages < 2 and config.block_m is None and block_m > CONSUMERS * WG_ROWS:
        block_m = CONSUMERS * WG_ROWS  # a float32 output with z and a residual
        splits, stages = plan(block_m)
    return MatmulConfig(block_m, block_n, block_k, config.group_m, None, stages, splits)


def plan_of(p: Problem, config: MatmulConfig | None) -> Plan:
    """The launch of `kernel_problem(p)`."""
    config = resolve_config(p, config)
    kernel = kernel_problem(p)
    plan = Plan(config.block_m, config.block_n, config.block_k, config.group_m,
                config.num_stages, config.split_k, 1)
    num_ctas = min(_targets.current("gpu").num_sms, plan.tiles(kernel) * plan.splits)
    return plan._replace(num_ctas=num_ctas)


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines a GPU without wgmma (Blackwell), what wgmma cannot take (operands other than
    16-bit floats and float32, which runs as TF32: not at HIGHEST precision) and an epilogue
    the kernels cannot apply; rejects a config that is not a
    valid tiling or leaves no room for two pipeline stages."""
    require_supported(p.epilogue, p.a_dtype, p.b_dtype, p.out_dtype)
    if jnp.float64 in (p.a_dtype, p.b_dtype, p.out_dtype):
        raise NotImplementedError("float64: Mosaic GPU's wgmma takes 16-bit floats and float32")
    capability = _targets.current("gpu").compute_capability
    if capability is not None and capability // 10 != 9:
        raise NotImplementedError(f"Mosaic GPU's matmul multiplies with Hopper's wgmma (sm_90a); "
                                  f"this GPU is sm_{capability} (a tcgen05 kernel for "
                                  "Blackwell is not written)")
    for name, dtype in (("a", p.a_dtype), ("b", p.b_dtype)):
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
            raise NotImplementedError(f"Mosaic GPU's wgmma takes 16-bit floats and float32 "
                                      f"(TF32); {name} is {jnp.dtype(dtype).name}")
    if p.highest and jnp.dtype(p.compute_dtype).itemsize > 2:
        raise NotImplementedError("Mosaic GPU multiplies float32 as TF32 (wgmma); "
                                  "precision=HIGHEST runs in xla or triton")
    if config is not None and config.split_k is not None and not is_positive_int(config.split_k):
        raise ValueError(f"config.split_k must be a positive int, got {config.split_k!r}")
    config = resolve_config(p, config)
    consumer_rows = config.block_m // CONSUMERS
    columns = min(EPILOGUE_COLUMNS, config.block_n)
    if (config.block_m % CONSUMERS or consumer_rows % WG_ROWS or config.block_n % 8
            or config.block_n % columns or consumer_rows * config.block_n > MAX_ACCUMULATOR
            or config.block_k * _itemsize(kernel_problem(p).compute_dtype) % 32):
        raise ValueError(
            f"Mosaic GPU matmul tiles: block_m a multiple of {CONSUMERS * WG_ROWS}, block_n a "
            f"multiple of 8 up to {EPILOGUE_COLUMNS} or of {EPILOGUE_COLUMNS} (the epilogue's "
            f"slices), a consumer's (block_m / {CONSUMERS}) x block_n at most "
            f"{MAX_ACCUMULATOR} (its float32 accumulator in registers) and a K slice of a "
            f"multiple of 32 bytes, got {config}")
    if config.num_stages < 2:
        raise NotImplementedError(
            f"Mosaic GPU matmul: tiles {config.block_m}x{config.block_n}x{config.block_k} "
            f"leave room for {config.num_stages} pipeline stages in shared memory; need 2")
