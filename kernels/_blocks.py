"""Block-size arithmetic, config checks and loop and dtype helpers that every op's kernels share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _targets

LANES = 128  # the last dim of a TPU memory tile
MIN_TRITON_DOT = 16  # Triton's dot needs every tile dim >= 16
# A split reduction of fewer steps than this leaves a GPU's software pipeline (num_stages deep)
# mostly filling and draining.
MIN_PIPELINED_STEPS = 4
# Elements of one program's tile in the fast interpreter, where a tile is an XLA array on the
# CPU (16 MiB of float32: milliseconds of work), not registers: the one budget every kernel's
# interpreted sizing takes (`tile_limit`), but for an op's named override beside its own
# measurement (normalize's Triton tiles: `normalize.triton.config._INTERPRETED_TILE`).
INTERPRETED_TILE = 1 << 22
# A float32 operand of a Triton dot that is not K-major (its contraction dim not the contiguous
# one) is copied transposed by XLA first where each element meets at least this many output
# rows or columns. TF32 tensor-core instructions take K-major operands only, so Triton loads
# an MN-major float32 tile 4 bytes at a time (sm_90 PTX of the 4096^2 float32 forward: B's
# tiles 48 4-byte loads beside A's 12 16-byte ones). The copy reads and writes each element once
# (8 bytes) where the product does 2 flops per element per output row it meets: at an H100's
# TF32 balance (495 TFLOP/s over 3.35 TB/s, 148 flops a byte) it costs 4 x 148 / reuse
# product-times at peak, against about 3 product-times the MN-major loads lose (the H100
# record: the float32 kernel at 4.35-5.00x cuBLAS's time, bfloat16's at 1.17-1.26x): even near
# a reuse of 197. A design figure; not measured on a device.
K_MAJOR_MIN_REUSE = 256


def tensor_float32(dtype: Any, precision: Any) -> bool:
    """Whether the GPU kernels multiply `dtype` operands at `precision` on the tensor cores as
    TF32: float32 at DEFAULT or HIGH (either operand's); HIGHEST keeps its IEEE float32 dot.
    `None` is what `jax.default_matmul_precision` sets, as `lax.dot_general` resolves it."""
    if jnp.dtype(dtype) != jnp.float32:
        return False
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return True
    pair = tuple(precision) if isinstance(precision, (tuple, list)) else (precision, precision)
    try:
        return any(lax.Precision(p) != lax.Precision.HIGHEST for p in pair)
    except (TypeError, ValueError):  # a dot algorithm preset: as it says
        return False


# A TF32 tensor-core instruction reads a float32 operand's sign, exponent and top 10 mantissa
# bits and drops the other 13 (truncation): the PTX of Triton's and Mosaic GPU's float32 products
# (jax 0.12.0.1, sm_80 mma.sync and sm_90 wgmma from shared memory) has no cvt.rna, so nothing
# rounds first unless the kernel does. Truncation biases every product toward zero: rounding to
# nearest (`round_to_tf32`) makes about a third of its error (the figures beside
# tests/test_matmul.py's `TF32_ROUNDED_ERROR`), the gap the H100 record showed between the
# Mosaic GPU kernel's float32 error and cuBLAS's (2.5x).
TF32_DROPPED_BITS = 13


def round_to_tf32(x: Any) -> Any:
    """float32 `x` rounded to the nearest TF32 value (ties away from zero, as PTX's
    cvt.rna.tf32.f32), still float32, so a TF32 instruction multiplies it as rounded rather
    than truncating it (`TF32_DROPPED_BITS`); products of two such values are exact in float32,
    so an interpreter's float32 dot of them is the tensor core's. Inf and NaN pass unchanged;
    finite values past TF32's largest round to Inf."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    exponent = jnp.uint32(0x7F800000)
    half, kept = 1 << (TF32_DROPPED_BITS - 1), (0xFFFFFFFF << TF32_DROPPED_BITS) & 0xFFFFFFFF
    rounded = (bits + jnp.uint32(half)) & jnp.uint32(kept)
    return lax.bitcast_convert_type(jnp.where(bits & exponent == exponent, bits, rounded),
                                    jnp.float32)


def tensor_core_operand(tile: Any, dtype: Any, precision: Any) -> Any:
    """A Triton dot's operand tile cast to `dtype`, and rounded to TF32 (`round_to_tf32`) where
    the dot multiplies it as TF32 (`tensor_float32`): in registers, before the dot, which on
    the tensor cores would truncate it."""
    tile = tile.astype(dtype)
    return round_to_tf32(tile) if tensor_float32(dtype, precision) else tile


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a whole number of `multiple`s."""
    return -(-n // multiple) * multiple


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_block(dim: int, cap: int) -> int:
    """A Triton block over `dim`: the power of 2 covering it, at least 16 (the dot's minimum),
    at most `cap`."""
    return min(cap, max(MIN_TRITON_DOT, next_power_of_2(dim)))


def tile_limit(device_limit: int, interpreted_limit: int = INTERPRETED_TILE,
               platform: str = "gpu") -> int:
    """The most elements one program's tile may hold where the call runs: `device_limit`
    (what registers or VMEM hold) on a device and in the "strict" interpreter, which run the
    device's schedule; `interpreted_limit` in the fast interpreter, whose cost is per program
    (`_targets.INTERPRETER`)."""
    return _targets.device_or_interpreter(platform, device_limit, interpreted_limit)


def core_ranges(num_blocks: int) -> tuple[int, int]:
    """(ranges, blocks per range): `num_blocks` grid blocks cut into ranges of consecutive
    blocks, one per TensorCore of the TPU target (a megacore v4 has 2; one range for a single
    block), for kernels that carry state from block to block (a DMA ring, an accumulator) and
    so walk a range in order on one core. The last range may be short: a kernel repeats its
    last block there and must make the repeat do nothing."""
    cores = _targets.current("tpu").num_cores or 1
    per_range = -(-num_blocks // cores)
    return -(-num_blocks // per_range), per_range


def range_block(index_range: Any, step: Any, blocks_per_range: int, num_blocks: int) -> Any:
    """The block that step `step` of range `index_range` (`core_ranges`) works on: a short
    last range's extra steps repeat its last block."""
    return jnp.minimum(index_range * blocks_per_range + step, num_blocks - 1)


def is_positive_int(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def is_power_of_2(n: object) -> bool:
    return is_positive_int(n) and n & (n - 1) == 0


def sublanes(dtype: Any) -> int:
    """Rows of one TPU memory tile: 8 for 32-bit dtypes, 16 for 16-bit, 32 for 8-bit."""
    return 8 * 4 // min(4, jnp.dtype(dtype).itemsize)


def check_triton_config(config: Any, block_fields: Iterable[str],
                        min_block: int = MIN_TRITON_DOT) -> None:
    """Raises ValueError naming the field when a Triton config cannot compile: block sizes
    must be powers of 2 (every Triton array is) and at least `min_block`; `num_warps` a power
    of 2 <= 32; `num_stages` a positive int."""
    for field in block_fields:
        value = getattr(config, field)
        if not is_power_of_2(value) or value < min_block:
            raise ValueError(f"config.{field} must be a power of 2 >= {min_block} for triton, "
                             f"got {value!r}")
    if not is_power_of_2(config.num_warps) or config.num_warps > 32:
        raise ValueError(f"config.num_warps must be a power of 2 <= 32, got {config.num_warps!r}")
    if not is_positive_int(config.num_stages):
        raise ValueError(f"config.num_stages must be a positive int, got {config.num_stages!r}")


def triton_dot_shared_bytes(block_m: int, block_n: int, block_k: int, itemsize: int,
                            num_stages: int) -> int:
    """Shared memory a Triton dot loop needs: `num_stages` pipelined (block_m, block_k) and
    (block_k, block_n) operand tiles (what Triton 3.x allocates on sm_90; sm_80 one stage
    fewer, checked against the compiler's figures by `kernels.compile`)."""
    return num_stages * (block_m * block_k + block_k * block_n) * itemsize


def require_shared_memory(needed: int) -> None:
    """Declines (NotImplementedError, so a default sequence falls through to `xla`) blocks
    whose shared memory exceeds the per-block limit of the GPU the call runs on: Triton itself
    would only fail when the driver loads the kernel."""
    target = _targets.current("gpu")
    if needed > target.shared_memory:
        raise NotImplementedError(
            f"the blocks need {needed} bytes of shared memory, over {target.name}'s per-block "
            f"limit of {target.shared_memory}")


def require_floating(**dtypes: Any) -> None:
    """Declines (NotImplementedError, so a sequence falls through to `xla`) unless every named
    operand has a floating-point dtype: the kernels multiply floats only."""
    for name, dtype in dtypes.items():
        if not jnp.issubdtype(dtype, jnp.floating):
            raise NotImplementedError(f"{name} has dtype {jnp.dtype(dtype).name}; the kernel "
                                      "takes floating-point operands only")


def require_int32_offsets(**sizes: int) -> None:
    """Declines arrays of 2**31 elements or more: Triton kernels address them with int32
    offsets (Pallas widens pointers only past 2**32 bytes, so a 1-byte array of 2**31 to 2**32
    elements would wrap)."""
    for name, size in sizes.items():
        if size >= 2**31:
            raise NotImplementedError(f"{name} has {size} elements; the kernel's int32 offsets "
                                      "cover fewer than 2**31")


def fill_sms(block_rows: int, block_cols: int, programs: Callable[[int, int], int],
             min_block: int = 64) -> tuple[int, int]:
    """Output tile (block_rows, block_cols) of a GPU kernel, its longer side halved (down to
    `min_block`: one warpgroup's MMA rows on sm_90) while `programs(rows, cols)` leaves some
    of the target's SMs without a program. Smaller tiles before split reductions: they cost
    no extra traffic."""
    num_sms = _targets.current("gpu").num_sms
    while programs(block_rows, block_cols) < num_sms and max(block_rows, block_cols) > min_block:
        if block_rows >= block_cols:
            block_rows //= 2
        else:
            block_cols //= 2
    return block_rows, block_cols


class Split(NamedTuple):
    """A reduction of `num_steps` sequential steps cut into `splits` ranges of `per_split`
    steps (the last may be shorter), each run by its own program."""

    splits: int
    per_split: int

    def range_of(self, split: Any, num_steps: int) -> tuple[Any, Any]:
        """(first step, number of steps) of split `split` (a program id); static when there
        is one split, so an unsplit loop keeps its static trip count."""
        if self.splits == 1:
            return 0, num_steps
        first = split * self.per_split
        return first, jnp.minimum(self.per_split, num_steps - first)


def max_splits(operand_bytes: int, partial_bytes: int) -> int:
    """Splits whose float32 partials (`partial_bytes` each, written and read back to be
    summed) cost at most half the operands' own traffic: a split must not turn a compute-bound
    kernel into a memory-bound one."""
    return operand_bytes // max(1, 2 * 2 * partial_bytes)


def split_reduction(programs: int, num_steps: int, *, min_steps: int = 1,
                    max_splits: int | None = None) -> Split:
    """How to split a reduction that `programs` GPU programs each run whole, `num_steps` steps
    long: not at all when the programs already give every SM of the target one, else into
    enough splits of at least `min_steps` steps for two waves (`Target.min_programs`), at most
    `max_splits` (a caller's bound on the partial results' extra traffic). Split-K of a matmul,
    the pixel splits of conv2d's weight gradient and normalize's split statistics all use it."""
    target = _targets.current("gpu")
    if programs >= target.num_sms or num_steps <= min_steps:
        return Split(1, num_steps)
    wanted = -(-target.min_programs // programs)
    per_split = max(min_steps, num_steps // wanted)
    if max_splits is not None:
        per_split = max(per_split, -(-num_steps // max(1, max_splits)))
    return Split(-(-num_steps // per_split), per_split)


def nonempty_splits(num_steps: int, wanted: int) -> int:
    """`wanted` splits of `num_steps` steps (each cdiv(num_steps, wanted) of them), less any that
    would get none: what an asked split-K runs."""
    return -(-num_steps // -(-num_steps // max(1, wanted)))


def int32_loop(num: Any, body: Callable[[Any, Any], Any], init: Any) -> Any:
    """`lax.fori_loop` over range(num) with int32 bounds: under x64, Python-int bounds make the
    loop index 64-bit, which Mosaic's verifier rejects and which costs registers on a GPU."""
    return lax.fori_loop(jnp.int32(0), jnp.int32(num), body, init)
