"""Block-size arithmetic, config checks and loop and dtype helpers that every op's kernels share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp
from jax import lax

from kernels import _targets

LANES = 128  # the last dim of a TPU memory tile
MIN_TRITON_DOT = 16  # Triton's dot needs every tile dim >= 16


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_power_of_2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


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
    if (not isinstance(config.num_stages, int) or isinstance(config.num_stages, bool)
            or config.num_stages < 1):
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


def int32_loop(num: Any, body: Callable[[Any, Any], Any], init: Any) -> Any:
    """`lax.fori_loop` over range(num) with int32 bounds: under x64, Python-int bounds make the
    loop index 64-bit, which Mosaic's verifier rejects and which costs registers on a GPU."""
    return lax.fori_loop(jnp.int32(0), jnp.int32(num), body, init)
