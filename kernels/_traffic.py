"""What a Mosaic kernel's BlockSpec pipeline moves between HBM and VMEM, worked out from its
grid and index maps (no device): the bytes its cost estimate states (`mosaic_call`), the
bench's design figures show, and the tests walk step by step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kernels._blocks import LANES, sublanes

__all__ = ["copied_bytes", "pipelined_bytes"]


def _block_dims(spec: Any, shape: Sequence[int]) -> list[tuple[int, bool]]:
    """Per array dim: (block size, whether the index map gives an element offset rather than
    a block index). Squeezed dims are blocks of 1; no block shape means the whole array."""
    if spec.block_shape is None:
        return [(d, False) for d in shape]
    dims = []
    for d in spec.block_shape:
        size = getattr(d, "block_size", 1 if d is None else d)
        dims.append((size if isinstance(size, int) else 1, type(d).__name__ == "Element"))
    return dims


def _round_up(values: np.ndarray, multiple: int) -> np.ndarray:
    return -(-values // multiple) * multiple


def copied_bytes(block_indices: np.ndarray, dims: Sequence[tuple[int, bool]],
                 shape: Sequence[int], dtype: Any) -> int:
    """Bytes the pipeline moves for a block visited at `block_indices` (steps, ndim), in grid
    order: a copy at the first step and wherever the index changes, each of the part of the
    block inside the array (edge blocks are copied clipped) in whole memory tiles, as XLA
    lays out a Mosaic call's operands in a TPU's HBM (read from compiled HLO for v5e): the
    last dim rounded up to 128 lanes, the one before it to a tile's rows (`sublanes`) unless
    the array's is 1 ((1, 128) tiles). So a (reduced, 1) column moves 128x its bytes and a
    (1, reduced) row its own, rounded up to 128 lanes. (A kernel's own DMAs can move less, a
    single 32-bit row say: the kernel states those bytes itself.)"""
    dtype = np.dtype(dtype)
    index = np.asarray(block_indices, np.int64).reshape(len(block_indices), len(dims))
    changed = np.ones(len(index), bool)
    changed[1:] = np.any(index[1:] != index[:-1], axis=1)
    index = index[changed]
    extent = np.ones(len(index), np.int64)
    tiles = {len(dims) - 1: LANES}
    if len(dims) > 1 and shape[-2] > 1:
        tiles[len(dims) - 2] = sublanes(dtype)
    for axis, ((size, element), dim) in enumerate(zip(dims, shape)):
        start = index[:, axis] * (1 if element else size)
        clipped = np.clip(dim - start, 0, size)
        extent *= _round_up(clipped, tiles[axis]) if axis in tiles else clipped
    return int(extent.sum()) * dtype.itemsize


def _spec_bytes(spec: Any, aval: Any, grid: tuple[int, ...],
                prefetch: Sequence[Any]) -> int:
    """All the grid's block indices evaluated at once, on concrete values even while a caller
    traces (an index map is cheap scalar arithmetic; a grid has at most a few million steps)."""
    dims = _block_dims(spec, aval.shape)
    steps = math.prod(grid)
    if spec.index_map is None or not steps:
        return copied_bytes(np.zeros((1, len(dims))), dims, aval.shape, aval.dtype)
    axes = [a.astype(np.int32) for a in np.unravel_index(np.arange(steps), grid)]
    try:
        with jax.ensure_compile_time_eval():
            # Called on numpy vectors: the usual index map is Python arithmetic, which numpy
            # evaluates for every step at once (vmap is the general, slower route).
            try:
                blocks = spec.index_map(*axes, *prefetch)
            except Exception:  # noqa: BLE001 - e.g. Python control flow on an index
                blocks = jax.vmap(spec.index_map,
                                  in_axes=(0,) * len(grid) + (None,) * len(prefetch))(
                                      *axes, *prefetch)
            index = np.stack([np.broadcast_to(np.asarray(i), (steps,))
                              for i in jax.tree.leaves(blocks)], axis=1)
    except Exception:  # noqa: BLE001 - an estimate must not fail a call: a copy every step
        return steps * copied_bytes(np.zeros((1, len(dims))), dims, aval.shape, aval.dtype)
    return copied_bytes(index, dims, aval.shape, aval.dtype)


def pipelined_bytes(grid_spec: Any, args: Sequence[Any], outs: Sequence[Any]) -> int:
    """HBM bytes the BlockSpec pipeline of a Mosaic kernel moves: walking the grid in order, a
    block is copied in (or written back) only at the steps where its index changes. Operands
    left in HBM or SMEM (manual DMAs) are not counted: the kernel states those itself; nor are
    absent ones (None operands and outputs, which the kernel gets as None refs)."""
    grid = tuple(grid_spec.grid)
    num_prefetch = getattr(grid_spec, "num_scalar_prefetch", 0)
    prefetch = [np.zeros(a.shape, a.dtype) for a in args[:num_prefetch]]
    out_specs = grid_spec.out_specs
    if not isinstance(out_specs, (list, tuple)):
        out_specs = [out_specs]
    total = 0
    for spec, aval in zip([*grid_spec.in_specs, *out_specs], [*args[num_prefetch:], *outs]):
        space = str(getattr(spec, "memory_space", None)).lower()
        if aval is not None and not any(name in space for name in ("any", "hbm", "smem")):
            total += _spec_bytes(spec, aval, grid, prefetch)
    return total
