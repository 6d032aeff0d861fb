"""Matmul as a Pallas kernel lowered through Triton (GPU).

Block schedule
--------------
grid = (cdiv(M, block_m) * cdiv(N, block_n), num_batches). Program (t, i) owns the output tile
`out[i, rows, cols]` of block_m x block_n, where the flat tile number t is mapped to a
(tile_row, tile_col) in grouped order: group_m consecutive tile rows are walked column by column,
so programs that run at the same time share B's column tiles and A's row tiles in L2 (the
Triton tutorial's "L2 cache optimization").

One program loops over the cdiv(K, block_k) slices of the contraction. Each step loads a
(block_m, block_k) tile of A and a (block_k, block_n) tile of B straight from HBM with masked
loads: rows >= M, columns >= N and k >= K read as 0, so any M, N, K works without padding copies
and the ragged K edge adds nothing to the sum. The tiles are cast to the operands' common dtype
and multiplied into a float32 (float64 for float64) accumulator held in registers; `precision`
becomes the dot's input precision (DEFAULT: TF32, HIGHEST: IEEE float32). After the loop the tile
is cast to the output dtype and stored once, masked to the array.

A transposed operand (the backward pass's Aᵀ and Bᵀ) is loaded as a (block_k, block_m) tile from
its stored layout and the transpose happens in the dot, never in HBM.

Memory traffic: the output is written once; A is read cdiv(N, block_n) times and B
cdiv(M, block_m) times, mostly from L2 thanks to the grouped order.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels._blocks import (check_triton_config, int32_loop, next_power_of_2, require_floating,
                             require_shared_memory, triton_dot_shared_bytes)
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.matmul.common import (MatmulConfig, Problem, batch_index,
                                   cost_estimate, dot)


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields from the shapes: power-of-2 blocks >= 16 (the dot's minimum)."""
    config = config or MatmulConfig()
    wide = jnp.dtype(p.compute_dtype).itemsize >= 8
    small = jnp.dtype(p.compute_dtype).itemsize <= 2
    # float64 tiles take twice the registers; 16-bit tiles can afford a deeper K slice.
    max_mn, max_k = (64, 32) if wide else (128, 64 if small else 32)

    def fit(dim: int, cap: int) -> int:
        return min(cap, max(16, next_power_of_2(dim)))

    block_m = config.block_m or fit(p.m, max_mn)
    block_n = config.block_n or fit(p.n, max_mn)
    block_k = config.block_k or fit(p.k, max_k)
    num_warps = config.num_warps or (8 if block_m * block_n >= 128 * 128 else 4)
    return MatmulConfig(block_m, block_n, block_k, config.group_m, num_warps,
                        config.num_stages or 3)


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines non-float operands and blocks over the GPU's shared memory; rejects a config
    that Triton cannot compile."""
    require_floating(a=p.a_dtype, b=p.b_dtype)
    config = resolve_config(p, config)
    check_triton_config(config, ("block_m", "block_n", "block_k"))
    itemsize = max(jnp.dtype(p.a_dtype).itemsize, jnp.dtype(p.b_dtype).itemsize)
    require_shared_memory(triton_dot_shared_bytes(config.block_m, config.block_n, config.block_k,
                                                  itemsize, config.num_stages))
    if not isinstance(config.group_m, int) or config.group_m < 1:
        raise ValueError(f"config.group_m must be a positive int, got {config.group_m!r}")


def _grouped_tile(tile: jax.Array, num_tile_rows: int, num_tile_cols: int,
                  group_m: int) -> tuple[jax.Array, jax.Array]:
    """(tile_row, tile_col) of flat tile number `tile` in grouped launch order."""
    tiles_per_group = group_m * num_tile_cols
    first_row = (tile // tiles_per_group) * group_m
    rows_in_group = jnp.minimum(num_tile_rows - first_row, group_m)
    tile_row = first_row + (tile % tiles_per_group) % rows_in_group
    tile_col = (tile % tiles_per_group) // rows_in_group
    return tile_row, tile_col


class _Span(NamedTuple):
    """`size` consecutive positions from `start` along one dim. `valid` flags those inside the
    array, or is None when the dim is a multiple of `size`, so no block is ragged and loads
    need no mask (the "EVEN_K" case of the Triton tutorials)."""

    start: jax.Array
    size: int
    valid: jax.Array | None


def _span(start: jax.Array, size: int, limit: int) -> _Span:
    if limit % size == 0:
        return _Span(start, size, None)
    return _Span(start, size, start + jnp.arange(size, dtype=jnp.int32) < limit)


def _tile_mask(rows: _Span, cols: _Span) -> jax.Array | None:
    if rows.valid is None and cols.valid is None:
        return None
    row_mask = True if rows.valid is None else rows.valid[:, None]
    col_mask = True if cols.valid is None else cols.valid[None, :]
    return jnp.broadcast_to(row_mask & col_mask, (rows.size, cols.size))


def _tile(ref, batch: jax.Array, rows: _Span, cols: _Span):
    # One indexer for all dims: Triton lowering does not take chained `.at[...]` views.
    return ref.at[batch, pl.ds(rows.start, rows.size), pl.ds(cols.start, cols.size)]


def _load_tile(ref, batch: jax.Array, rows: _Span, cols: _Span) -> jax.Array:
    """Tile (rows, cols) of matrix `batch` of `ref`; positions outside the array read 0."""
    mask = _tile_mask(rows, cols)
    view = _tile(ref, batch, rows, cols)
    return triton_load(view) if mask is None else triton_load(view, mask=mask, other=0)


def _matmul_kernel(a_ref, b_ref, out_ref, *, p: Problem, config: MatmulConfig, precision):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    tile, batch = pl.program_id(0), pl.program_id(1)
    tile_row, tile_col = _grouped_tile(tile, pl.cdiv(p.m, block_m), pl.cdiv(p.n, block_n),
                                       config.group_m)
    a_batch = batch_index(batch, p.out_batch, p.a_batch)
    b_batch = batch_index(batch, p.out_batch, p.b_batch)
    rows = _span(tile_row * block_m, block_m, p.m)
    cols = _span(tile_col * block_n, block_n, p.n)

    def step(k_block, acc):
        ks = _span(k_block * block_k, block_k, p.k)
        a_tile = _load_tile(a_ref, a_batch, *((ks, rows) if p.transpose_a else (rows, ks)))
        b_tile = _load_tile(b_ref, b_batch, *((cols, ks) if p.transpose_b else (ks, cols)))
        return acc + dot(a_tile.astype(p.compute_dtype), b_tile.astype(p.compute_dtype), p,
                         precision)

    num_k_blocks = pl.cdiv(p.k, block_k)
    acc = int32_loop(num_k_blocks, step,
                        jnp.zeros((block_m, block_n), p.accumulator_dtype))
    triton_store(_tile(out_ref, batch, rows, cols), acc.astype(p.out_dtype),
                 mask=_tile_mask(rows, cols))


def matmul(a: jax.Array, b: jax.Array, p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool) -> jax.Array:
    """`op(a) @ op(b)` for a problem that `check` accepted; returns out_batch + (M, N)."""
    config = resolve_config(p, config)
    num_tiles = pl.cdiv(p.m, config.block_m) * pl.cdiv(p.n, config.block_n)
    kernel = functools.partial(_matmul_kernel, p=p, config=config, precision=precision)
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.num_batches, p.m, p.n), p.out_dtype),
        grid=(num_tiles, p.num_batches),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        cost_estimate=cost_estimate(p),
        name="matmul_triton",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]))
    return out.reshape(*p.out_batch, p.m, p.n)
