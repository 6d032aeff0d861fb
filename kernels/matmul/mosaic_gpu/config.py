"""How big the Mosaic GPU matmul kernel's tiles are (the kernel is in `forward.py` beside it):
the plan of one launch (`plan_of`: CTA tile, K slice, pipeline stages within shared memory,
split-K, the persistent grid) and the checks that decline a problem (`check`); the bytes a
launch moves are `common.moved_bytes`."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import MIN_PIPELINED_STEPS, is_positive_int, max_splits, split_reduction
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import RESERVED_SMEM
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes

__all__ = ["Plan", "plan_of", "resolve_config", "check", "CONSUMERS", "WG_ROWS",
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
        return p.num_batches * pl.cdiv(p.m, self.block_m) * pl.cdiv(p.n, self.block_n)

    def k_blocks_per_split(self, p: Problem) -> int:
        return pl.cdiv(pl.cdiv(p.k, self.block_k), self.splits)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def epilogue_bytes(p: Problem, block_m: int, block_n: int, splits: int) -> int:
    """Shared memory of the epilogue: per consumer one column slice of the output (float32
    partials when split), of z and of the residual."""
    if splits > 1:
        per_element = 4
    else:
        per_element = _itemsize(p.out_dtype) + (
            _itemsize(p.epilogue.saved) if p.epilogue.saved is not None else 0) + (
            _itemsize(p.out_dtype) if p.epilogue.has_residual else 0)
    return block_m * min(EPILOGUE_COLUMNS, block_n) * per_element


def _stages(p: Problem, block_m: int, block_n: int, block_k: int, splits: int) -> int:
    budget = _targets.current("gpu").shared_memory - RESERVED_SMEM
    stage = (block_m + block_n) * block_k * _itemsize(p.compute_dtype)
    return min(MAX_STAGES, (budget - epilogue_bytes(p, block_m, block_n, splits)) // stage)


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields: a CTA tile of 2 x 128 rows by 128 columns (64 rows a consumer where M
    fits in 128, 64 columns where N fits in 64), a K slice of `SWIZZLE` bytes, as many stages
    as shared memory holds (up to `MAX_STAGES`), split-K where the tiles leave SMs idle."""
    config = config or MatmulConfig()
    block_m = config.block_m or (CONSUMERS * WG_ROWS if p.m <= CONSUMERS * WG_ROWS
                                 else CONSUMERS * 128)
    block_n = config.block_n or (64 if p.n <= 64 else 128)
    block_k = config.block_k or SWIZZLE // _itemsize(p.compute_dtype)
    split_k = config.split_k
    if split_k is None:
        num_k_blocks = pl.cdiv(p.k, block_k)
        tiles = p.num_batches * pl.cdiv(p.m, block_m) * pl.cdiv(p.n, block_n)
        split_k = split_reduction(
            tiles, num_k_blocks, min_steps=MIN_PIPELINED_STEPS,
            max_splits=max_splits(flops_and_bytes(p)[1], p.num_batches * p.m * p.n * 4)).splits
    stages = config.num_stages or _stages(p, block_m, block_n, block_k, split_k)
    if stages < 2 and config.block_m is None and block_m > CONSUMERS * WG_ROWS:
        # A float32 output with z and a float32 residual: 12 bytes of epilogue buffers an
        # element; half the rows leave room for the pipeline.
        block_m = CONSUMERS * WG_ROWS
        stages = config.num_stages or _stages(p, block_m, block_n, block_k, split_k)
    return MatmulConfig(block_m, block_n, block_k, config.group_m, None, stages, split_k)


def plan_of(p: Problem, config: MatmulConfig | None) -> Plan:
    config = resolve_config(p, config)
    plan = Plan(config.block_m, config.block_n, config.block_k, config.group_m,
                config.num_stages, config.split_k, 1)
    num_ctas = min(_targets.current("gpu").num_sms, plan.tiles(p) * plan.splits)
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
    config = resolve_config(p, config)
    consumer_rows = config.block_m // CONSUMERS
    if (config.block_m % CONSUMERS or consumer_rows % WG_ROWS
            or not 8 <= config.block_n <= 256 or config.block_n % 8
            or config.block_k * _itemsize(p.compute_dtype) % 32):
        raise ValueError(f"Mosaic GPU matmul tiles: block_m a multiple of {CONSUMERS * WG_ROWS}"
                         f", block_n a multiple of 8 up to 256 and a K slice of a multiple of "
                         f"32 bytes, got {config}")
    if not is_positive_int(config.split_k) or config.num_stages < 2:
        raise NotImplementedError(
            f"Mosaic GPU matmul: tiles {config.block_m}x{config.block_n}x{config.block_k} "
            f"leave room for {config.num_stages} pipeline stages in shared memory; need 2")
