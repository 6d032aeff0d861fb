"""How big the Mosaic matmul kernel's blocks are (the kernel itself is in
`forward.py` beside it): the config (`resolve_config`), each array's block in its stored
layout (`block_shapes`), the VMEM a step plans (`vmem_bytes`) and the checks that decline a
problem or reject a config (`check`)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import LANES, require_floating, sublanes
from kernels._epilogue import require_supported
from kernels.matmul.common import MatmulConfig, Problem

__all__ = ["resolve_config", "check", "block_shapes", "vmem_bytes"]

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


def block_shapes(p: Problem, config: MatmulConfig) -> list[tuple[int, int]]:
    """(A block, B block, output block) in the arrays' stored layouts."""
    return [tuple(getattr(config, field) for field, _ in dims) for _, dims in _layouts(p)]


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines float64, non-float operands and blocks over the TPU's VMEM; rejects blocks
    that break TPU tiling."""
    require_floating(a=p.a_dtype, b=p.b_dtype)
    require_supported(p.epilogue, p.a_dtype, p.b_dtype, p.out_dtype)
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
    """VMEM of one step: A, B and output blocks (with the epilogue's residual and saved
    pre-activation) double-buffered, the float32 accumulator, and the float32 product of the
    step's dot before it is added."""
    a_block, b_block, out_block = block_shapes(p, config)
    blocks = (math.prod(a_block) * jnp.dtype(p.a_dtype).itemsize
              + math.prod(b_block) * jnp.dtype(p.b_dtype).itemsize
              + math.prod(out_block) * p.epilogue.bytes_per_output(p.out_dtype))
    return 2 * blocks + 2 * 4 * math.prod(out_block)
