"""How big the Mosaic GPU matmul kernels' tiles are (Hopper's in `hopper.py`, Blackwell's in
`blackwell.py`, which kernel by `mma_of`): the problem a kernel runs (`kernel_problem`:
padding, TF32 or split bfloat16), the plan of one launch (`plan_of`: CTA tile, K slice,
pipeline stages within shared memory, split-K, the persistent grid) and the checks that
decline a problem (`check`); the bytes a launch moves are `kernels.matmul.common.moved_bytes`."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import (MIN_PIPELINED_STEPS, fill_sms, is_positive_int, max_splits,
                             nonempty_splits, round_up)
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes, num_tiles

__all__ = ["Plan", "plan_of", "kernel_problem", "resolve_config", "check", "epilogue_bytes",
           "epilogue_columns", "mma_of", "split_terms", "is_split", "WGMMA", "TCGEN05",
           "TCGEN05_ROWS", "TCGEN05_COLUMNS", "TENSOR_MEMORY_COLUMNS", "ACCUMULATORS",
           "tcgen05_columns", "TCGEN05_EPILOGUE_COLUMNS", "CONSUMERS", "WG_ROWS",
           "EPILOGUE_COLUMNS", "SWIZZLE", "TMA_ROWS", "TMA_COLUMNS", "registers"]

# The tensor-core instructions a plan multiplies with: Hopper's wgmma (`hopper.kernel`, the
# accumulator in the consumers' registers) or Blackwell's tcgen05 (`blackwell.kernel`, the
# accumulator in tensor memory).
WGMMA, TCGEN05 = "wgmma", "tcgen05"
# Blackwell's CTA tile: tcgen05's 128 rows (one CTA's MMA; 64 would take another tensor-memory
# layout, and rows past M cost no more bytes, as TMA zero-fills them) by up to 256 columns,
# its accumulators within tensor memory's 512 float32 columns (`tcgen05_columns`).
TCGEN05_ROWS = 128
TCGEN05_COLUMNS = (64, 128, 256)
TENSOR_MEMORY_COLUMNS = 512
ACCUMULATORS = 2  # a Blackwell CTA's tiles in tensor memory: one filling while one drains
CONSUMERS = 2  # compute warpgroups per CTA, each owning block_m / 2 rows of the CTA tile
WG_ROWS = 64  # wgmma's M: a consumer's rows are a multiple of it
SWIZZLE = 128  # bytes: the widest TMA swizzle; a K slice of this many bytes a row
# The accumulator leaves registers through shared memory in column slices this wide (a slice
# of the output, of z and of the residual per consumer), so the epilogue's buffers stay small
# beside the pipeline's stages.
EPILOGUE_COLUMNS = 64
# Blackwell's slices are half as wide: its one epilogue warpgroup holds a slice's 128 rows, a
# row a thread, so 32 columns are 32 float32 registers a thread, as a Hopper consumer's 64 x 64
# slice is. At 64 columns the gelu epilogue with bias, residual and z took 243 registers
# (jax 0.12.0.1, sm_100a).
TCGEN05_EPILOGUE_COLUMNS = 32
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
# (setmaxnreg), leaving room for addresses and the epilogue (conv2d's consumers get 224:
# `registers`; its default tiles hold 64 or 128 columns).
MAX_ACCUMULATOR = 128 * 192
# Registers per thread of the TMA producer warpgroup (setmaxnreg): it holds only addresses
# and barrier phases, so the consumers get the rest (JAX's Hopper matmul: 40).
PRODUCER_REGISTERS = 40
# The producer's where it copies NHWC boxes (`tiles.Pixels`, `tiles.PixelSums`): each box's
# image, row and column are divisions of its piece's index. Measured (jax 0.12.0.1, sm_90a):
# the weight gradient of 32x28x28x128 * 3x3x128x256 stride 2 spilled 16 bytes at 40; at 56
# every conv2d case compiles without spills.
PIXEL_PRODUCER_REGISTERS = 56


def registers(boxes_pixels: bool) -> tuple[int, int]:
    """(producer, consumer) registers a thread (setmaxnreg) of Hopper's kernel: the producer's
    budget, and the rest of an SM's 512 a thread slot split over the consumers (in steps of
    8, at most 256)."""
    producer = PIXEL_PRODUCER_REGISTERS if boxes_pixels else PRODUCER_REGISTERS
    return producer, min(256, (512 - producer) // CONSUMERS) // 8 * 8


class Plan(NamedTuple):
    """One launch: CTA tiles of (block_m, block_n) over K slices of block_k, `stages` of them
    in flight, each output tile's K range in `splits` pieces, `num_ctas` persistent CTAs, on
    the tensor core's `mma` instructions (`WGMMA` or `TCGEN05`)."""

    block_m: int
    block_n: int
    block_k: int
    group: int  # output tiles a group of the planar snake walks along M before moving on
    stages: int
    splits: int
    num_ctas: int
    mma: str = WGMMA

    def tiles(self, p: Problem) -> int:
        return num_tiles(p, self.block_m, self.block_n)

    def k_blocks_per_split(self, p: Problem) -> int:
        return pl.cdiv(pl.cdiv(p.k, self.block_k), self.splits)


def mma_of(capability: int | None) -> str:
    """The kernel for a GPU of compute capability `capability`: tcgen05 on Blackwell (10.x),
    else wgmma (Hopper; also the interpreter's, which has no capability)."""
    return TCGEN05 if capability is not None and capability // 10 == 10 else WGMMA


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def epilogue_columns(mma: str, block_n: int) -> int:
    """The width of the epilogue's column slices (`EPILOGUE_COLUMNS`, on Blackwell
    `TCGEN05_EPILOGUE_COLUMNS`), at most the tile's."""
    return min(TCGEN05_EPILOGUE_COLUMNS if mma == TCGEN05 else EPILOGUE_COLUMNS, block_n)


def epilogue_bytes(p: Problem, block_m: int, block_n: int, splits: int, mma: str) -> int:
    """Shared memory of the epilogue: for the tile's rows one column slice of the output
    (float32 partials when split), of z and of the residual (in the output's dtype:
    `launch.gemm`)."""
    if splits > 1:
        per_element = 4
    else:
        per_element = _itemsize(p.out_dtype) * (1 + p.epilogue.has_residual) + (
            _itemsize(p.epilogue.saved) if p.epilogue.saved is not None else 0)
    return block_m * epilogue_columns(mma, block_n) * per_element


def _stages(p: Problem, block_m: int, block_n: int, block_k: int, splits: int, mma: str) -> int:
    budget = _targets.current("gpu").shared_memory - BARRIER_BYTES
    stage = (block_m + block_n) * block_k * _itemsize(p.compute_dtype)
    return min(MAX_STAGES, (budget - epilogue_bytes(p, block_m, block_n, splits, mma)) // stage)


def split_terms(p: Problem) -> tuple[tuple[int, int], ...]:
    """Blackwell's float32: the bfloat16 products that stand for `p`'s, as (part of A, part of
    B) pairs. Mosaic GPU's tcgen05 has no TF32 kind (jax 0.12.0.1 fails "Unsupported input
    element type: tf32" when compiling), so an operand that is not bfloat16 is split into
    bfloat16 parts hi + lo (hi = x rounded, lo = x - hi rounded: 16 significant bits, where
    TF32 keeps 11), a bfloat16 one is its own single part, and the product is the sum of the
    part products but lo·lo (XLA's BF16_BF16_F32_X3 for float32 · float32, two products for
    float32 · bfloat16, such as a float32 layer's input against bfloat16 weights). Each
    operand's parts are laid out once, side by side along K (`launch.split_parts`), and the
    kernel walks each K slice once a term (`tiles.Terms`), summing the first term (hi · hi)
    apart from the corrections, which its epilogue adds where that sum is finite: Inf and NaN
    come from hi · hi as in float32, not from Inf · lo where lo is 0 or of the other sign
    (`blackwell._summed`)."""
    parts = [1 if jnp.dtype(dtype) == jnp.bfloat16 else 2 for dtype in (p.a_dtype, p.b_dtype)]
    return tuple((i, j) for i in range(parts[0]) for j in range(parts[1]) if i + j < 2)


def tcgen05_columns(p: Problem) -> tuple[int, ...]:
    """Blackwell's tile widths for `p`: those whose `ACCUMULATORS` fit tensor memory's
    columns, each one sum, or two for split parts (the first term's and the corrections':
    `split_terms`), which leaves 128 columns at most."""
    sums = 2 if is_split(p) else 1
    return tuple(c for c in TCGEN05_COLUMNS if ACCUMULATORS * sums * c <= TENSOR_MEMORY_COLUMNS)


def is_split(p: Problem) -> bool:
    """Whether `kernel_problem(p)` runs `p` as `split_terms` (float32 or mixed on Blackwell)."""
    return (not (p.a_dtype == p.b_dtype and _itemsize(p.a_dtype) == 2)
            and mma_of(_targets.current("gpu").compute_capability) == TCGEN05)


def kernel_problem(p: Problem) -> Problem:
    """The problem the kernel runs (`launch._operands` lays the arrays out so): 16-bit
    operands of one dtype as they are; anything else as float32 (TF32), both K-major, on
    Hopper, and as bfloat16 parts on Blackwell (`split_terms`: the problem is one part's,
    each term a product of it); M, K and N padded to TMA's tiles (`TMA_ROWS`, `TMA_COLUMNS`;
    M to a row of `TMA_COLUMNS` where A is stored (K, M))."""
    if is_split(p):
        bf16 = jnp.dtype(jnp.bfloat16)
        p = p._replace(a_dtype=bf16, b_dtype=bf16)
    elif not (p.a_dtype == p.b_dtype and _itemsize(p.a_dtype) == 2):
        f32 = jnp.dtype(jnp.float32)
        p = p._replace(transpose_a=False, transpose_b=True, a_dtype=f32, b_dtype=f32)
    m_step = TMA_COLUMNS if p.transpose_a else TMA_ROWS
    return p._replace(m=round_up(p.m, m_step), n=round_up(p.n, TMA_COLUMNS),
                      k=round_up(p.k, TMA_COLUMNS))


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


def _tile(p: Problem, config: MatmulConfig, mma: str, widths: tuple[int, ...]
          ) -> tuple[int, int]:
    """The CTA tile (block_m, block_n) where `config` leaves it unset. wgmma: 2 x 128 rows by
    128 columns (64 rows a consumer where M fits in 128, 64 columns where N fits in 64),
    halved while its tiles leave SMs idle (`fill_sms`, down to 64 rows a consumer and 64
    columns). tcgen05: `TCGEN05_ROWS` by the widest of `widths` (fewer where N is narrower),
    the columns halved (to 64) while the tiles leave SMs idle."""
    if mma == TCGEN05:
        block_n = config.block_n or min(widths[-1], max(64, 1 << (p.n - 1).bit_length()))
        if config.block_n is None:
            num_sms = _targets.current("gpu").num_sms
            while block_n > 64 and num_tiles(p, TCGEN05_ROWS, block_n) < num_sms:
                block_n //= 2
        return config.block_m or TCGEN05_ROWS, block_n
    block_m = config.block_m or (CONSUMERS * WG_ROWS if p.m <= CONSUMERS * WG_ROWS
                                 else CONSUMERS * 128)
    block_n = config.block_n or (64 if p.n <= 64 else 128)
    if config.block_m is None and config.block_n is None:
        consumer_rows, block_n = fill_sms(
            block_m // CONSUMERS, block_n,
            lambda rows, cols: num_tiles(p, CONSUMERS * rows, cols), min_block=WG_ROWS)
        block_m = CONSUMERS * consumer_rows
    return block_m, block_n


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields for the kernel's problem (`kernel_problem`) on the program's GPU
    (`mma_of`): the CTA tile (`_tile`), with 64 rows a consumer where the epilogue's buffers
    leave no room for two stages (wgmma); a K slice of `SWIZZLE` bytes, as many stages as
    shared memory holds (up to `MAX_STAGES`), split-K where the tiles still leave SMs idle
    (`_splits`). Smaller tiles first: they cost no extra traffic, where split-K writes float32
    partials that XLA sums (the H100 record, `mosaic_gpu_runs`: at 1024^3 bfloat16, 32 tiles
    split 4 ways took 1.12x cuBLAS's time, where Triton's smaller tiles took 0.75x)."""
    widths = tcgen05_columns(p)
    config, p = config or MatmulConfig(), kernel_problem(p)
    mma = mma_of(_targets.current("gpu").compute_capability)
    block_m, block_n = _tile(p, config, mma, widths)
    block_k = config.block_k or SWIZZLE // _itemsize(p.compute_dtype)

    def plan(block_m):
        splits = _splits(p, num_tiles(p, block_m, block_n), pl.cdiv(p.k, block_k),
                         config.split_k)
        return splits, config.num_stages or _stages(p, block_m, block_n, block_k, splits, mma)

    splits, stages = plan(block_m)
    if (stages < 2 and mma == WGMMA and config.block_m is None
            and block_m > CONSUMERS * WG_ROWS):
        block_m = CONSUMERS * WG_ROWS  # a float32 output with z and a residual
        splits, stages = plan(block_m)
    return MatmulConfig(block_m, block_n, block_k, config.group_m, None, stages, splits)


def plan_of(p: Problem, config: MatmulConfig | None) -> Plan:
    """The launch of `kernel_problem(p)`."""
    config = resolve_config(p, config)
    kernel = kernel_problem(p)
    plan = Plan(config.block_m, config.block_n, config.block_k, config.group_m,
                config.num_stages, config.split_k, 1,
                mma_of(_targets.current("gpu").compute_capability))
    num_ctas = min(_targets.current("gpu").num_sms, plan.tiles(kernel) * plan.splits)
    return plan._replace(num_ctas=num_ctas)


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines a GPU with neither wgmma (Hopper) nor tcgen05 (Blackwell), what they cannot
    take (operands other than 16-bit floats and float32, which runs as TF32 on Hopper and as
    split bfloat16 on Blackwell: not at HIGHEST precision) and an epilogue the kernels cannot
    apply; rejects a config that is not a valid tiling of the GPU's kernel or leaves no room
    for two pipeline stages."""
    require_supported(p.epilogue, p.a_dtype, p.b_dtype, p.out_dtype)
    if jnp.float64 in (p.a_dtype, p.b_dtype, p.out_dtype):
        raise NotImplementedError("float64: Mosaic GPU's MMAs take 16-bit floats and float32")
    capability = _targets.current("gpu").compute_capability
    if capability is not None and capability // 10 not in (9, 10):
        raise NotImplementedError(f"Mosaic GPU's matmul multiplies with Hopper's wgmma (sm_90a) "
                                  f"or Blackwell's tcgen05 (sm_100a); this GPU is "
                                  f"sm_{capability}")
    for name, dtype in (("a", p.a_dtype), ("b", p.b_dtype)):
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
            raise NotImplementedError(f"Mosaic GPU's MMAs take 16-bit floats and float32 "
                                      f"(TF32 or split bfloat16); {name} is "
                                      f"{jnp.dtype(dtype).name}")
    if p.highest and jnp.dtype(p.compute_dtype).itemsize > 2:
        raise NotImplementedError("Mosaic GPU multiplies float32 as TF32 (Hopper) or split "
                                  "bfloat16 (Blackwell); precision=HIGHEST runs in xla or "
                                  "triton")
    if config is not None and config.split_k is not None and not is_positive_int(config.split_k):
        raise ValueError(f"config.split_k must be a positive int, got {config.split_k!r}")
    config = resolve_config(p, config)
    if config.block_k * _itemsize(kernel_problem(p).compute_dtype) % 32:
        raise ValueError(f"Mosaic GPU matmul: a K slice of a multiple of 32 bytes, got {config}")
    if mma_of(capability) == TCGEN05:
        # A's (128, block_k) tile and B's (block_k, block_n) one must share their swizzle.
        k_bytes = config.block_k * _itemsize(kernel_problem(p).compute_dtype)
        if (config.block_m != TCGEN05_ROWS or config.block_n not in tcgen05_columns(p)
                or k_bytes % SWIZZLE):
            raise ValueError(
                f"Mosaic GPU matmul tiles on Blackwell: block_m {TCGEN05_ROWS} (tcgen05's "
                f"rows), block_n one of {tcgen05_columns(p)} (its accumulators in tensor "
                f"memory's {TENSOR_MEMORY_COLUMNS} columns) and a K slice of a multiple of "
                f"{SWIZZLE} bytes (the operands' one swizzle), got {config}")
    else:
        consumer_rows = config.block_m // CONSUMERS
        columns = min(EPILOGUE_COLUMNS, config.block_n)
        if (config.block_m % CONSUMERS or consumer_rows % WG_ROWS or config.block_n % 8
                or config.block_n % columns or consumer_rows * config.block_n > MAX_ACCUMULATOR):
            raise ValueError(
                f"Mosaic GPU matmul tiles: block_m a multiple of {CONSUMERS * WG_ROWS}, block_n "
                f"a multiple of 8 up to {EPILOGUE_COLUMNS} or of {EPILOGUE_COLUMNS} (the "
                f"epilogue's slices) and a consumer's (block_m / {CONSUMERS}) x block_n at most "
                f"{MAX_ACCUMULATOR} (its float32 accumulator in registers), got {config}")
    if config.num_stages < 2:
        raise NotImplementedError(
            f"Mosaic GPU matmul: tiles {config.block_m}x{config.block_n}x{config.block_k} "
            f"leave room for {config.num_stages} pipeline stages in shared memory; need 2")
