"""How big the Mosaic normalize kernels' blocks are (the kernels themselves are in
`forward.py` and `backward.py`, on `schedule.py`): the TPU tiling each block dim must respect,
the VMEM a step plans (`vmem_bytes`, priced at the heavier backward step), the default blocks
within the target's `default_blocks_vmem` (`resolve_config`), and the checks that decline a
problem or reject a config (`check`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import LANES, sublanes, tile_limit
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["resolve_config", "check", "vmem_bytes"]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_MAX_BLOCK_REDUCED = 16384
_TARGET_BLOCK = 128 * 1024  # elements: ~0.5 MiB float32 per block, a few MiB with buffering.


def _sublanes(p: Problem) -> int:
    """The sublane tile of the narrowest array the blocks cover (x, or y in `out_dtype`)."""
    return max(sublanes(p.dtype), sublanes(p.y_dtype))


def _tiling(p: Problem) -> dict[str, tuple[int, int]]:
    """Per block field: (the multiple TPU tiling asks for, the array dim it may equal). In the
    columns layout `block_reduced` is x's sublane dim, and also the lane dim of the lane-dense
    scale/offset chunks when there are any."""
    sub = _sublanes(p)
    if p.rows:
        return {"block_groups": (sub, p.groups), "block_reduced": (LANES, p.reduced)}
    reduced_multiple = LANES if p.has_scale or p.has_offset else sub
    return {"block_groups": (LANES, p.groups), "block_reduced": (reduced_multiple, p.reduced)}


def _fit(dim: int, limit: int, multiple: int) -> int:
    """The whole dim if it is <= limit, else the largest multiple of `multiple` <= limit."""
    return dim if dim <= limit else max(multiple, limit // multiple * multiple)


def _step_bytes_per_element(p: Problem) -> int:
    """VMEM one block element costs a backward step (the larger of the two kernels): x, dy and
    dx double-buffered (and dsum, with a residual: the forward's x, residual, y and sum are as
    many), and about six float32 temporaries the compiler keeps in VMEM."""
    item = max(jnp.dtype(p.dtype).itemsize, jnp.dtype(p.y_dtype).itemsize)
    return 2 * (3 + p.has_residual) * item + 6 * 4


def _block_elements(p: Problem, block_groups: int, block_reduced: int) -> int:
    """Elements of a block as VMEM holds it: the lane dim padded to 128, sublanes to a tile."""
    lanes, rows = (block_reduced, block_groups) if p.rows else (block_groups, block_reduced)
    sub = _sublanes(p)
    return (-(-rows // sub) * sub) * (-(-lanes // LANES) * LANES)


def vmem_bytes(p: Problem, config: NormalizeConfig) -> int:
    return _block_elements(p, config.block_groups, config.block_reduced) * \
        _step_bytes_per_element(p)


def resolve_config(p: Problem, config: NormalizeConfig | None) -> NormalizeConfig:
    """Blocks within the target's `default_blocks_vmem` (and _TARGET_BLOCK elements; in the fast
    interpreter, `tile_limit`'s): the whole group when it fits (<= 16384), else chunks; as many
    groups as fit beside it. In the columns layout the lane dim (groups) cannot go below 128,
    so a long reduced axis is chunked instead (the two-phase schedule) rather than overflowing
    VMEM."""
    config = config or NormalizeConfig()
    tiling = _tiling(p)
    budget = min(tile_limit(_TARGET_BLOCK, platform="tpu"),
                 _targets.current("tpu").default_blocks_vmem // _step_bytes_per_element(p))
    block_reduced = config.block_reduced
    if block_reduced is None:
        block_reduced = _fit(p.reduced, tile_limit(_MAX_BLOCK_REDUCED, platform="tpu"),
                             tiling["block_reduced"][0])
    block_groups = config.block_groups
    if block_groups is None and isinstance(block_reduced, int) and block_reduced > 0:
        multiple = tiling["block_groups"][0]
        # A group's share of a block as VMEM holds it: 16 reduced elements of a row still
        # take a 128-lane row (the unpadded count overflowed VMEM 8x for LayerNorm(16)).
        per_group = _block_elements(p, multiple, block_reduced) // multiple
        block_groups = _fit(p.groups, max(1, budget // per_group), multiple)
        padded_groups = -(-block_groups // multiple) * multiple
        if config.block_reduced is None and padded_groups * block_reduced > budget:
            block_reduced = _fit(p.reduced, max(1, budget // padded_groups),
                                 tiling["block_reduced"][0])
    return dataclasses.replace(config, block_groups=block_groups, block_reduced=block_reduced)


def check(p: Problem, config: NormalizeConfig | None) -> None:
    """Declines float64 (no float64 on TPU) and blocks over the target's VMEM budget; rejects
    blocks that break TPU tiling."""
    common.check_dtype(p, _DTYPES)
    if p.size == 0:
        return  # nothing to launch: the wrapper returns the empty result itself
    config = resolve_config(p, config)
    for field, (multiple, dim) in sorted(_tiling(p).items(), reverse=True):
        size = getattr(config, field)
        if (not isinstance(size, int) or isinstance(size, bool) or size < 1
                or (size % multiple and size != dim)):
            raise ValueError(f"config.{field}={size!r} breaks TPU tiling for mosaic: it must be "
                             f"a multiple of {multiple} or equal the array dim {dim}")
    target = _targets.current("tpu")
    needed = vmem_bytes(p, config)
    if needed > target.vmem_budget:
        raise NotImplementedError(
            f"blocks of {config.block_groups}x{config.block_reduced} need about {needed} bytes "
            f"of VMEM a step, over {target.name}'s budget of {target.vmem_budget}")
