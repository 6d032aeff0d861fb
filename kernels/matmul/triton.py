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

Configs by shape
----------------
Tiles start at 128x128 (64x64 for float64) with a K slice of 64 for 16-bit operands, 32 for
32-bit, shrunk to the dims of a smaller product. A product with fewer tiles than the GPU has SMs
(132 on an H100) would leave SMs idle, so:
- mid-size products (1024³: 64 tiles of 128x128) halve the longer tile side down to 64 until
  every SM has a tile (`kernels._blocks.fill_sms`; 256 tiles of 64x64);
- skinny products (decode: M <= 64; a weight gradient's small M x N over a long K) that still
  have too few tiles split K: grid axis 2 runs `split_k` programs per tile, each summing its own
  range of at least 4 K slices into a float32 partial tile ((split_k * batches, M, N) in HBM),
  and XLA adds the partials in a fixed order and casts them. Splits aim at two waves
  (`kernels._blocks.split_reduction`) but are capped so the partials' traffic stays within half
  the operands' (`kernels._blocks.max_splits`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels._blocks import (MIN_PIPELINED_STEPS, Split, check_triton_config, fill_sms, int32_loop,
                             is_positive_int, is_power_of_2, max_splits, require_floating,
                             require_shared_memory, split_reduction, triton_block,
                             triton_dot_shared_bytes)
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.matmul.common import MatmulConfig, Problem, batch_index, dot, flops_and_bytes


def _largest_blocks(p: Problem) -> tuple[int, int]:
    """(output tile side, K slice) caps: float64 tiles take twice the registers; 16-bit tiles
    afford a deeper K slice."""
    itemsize = jnp.dtype(p.compute_dtype).itemsize
    if itemsize >= 8:
        return 64, 32
    return 128, 64 if itemsize <= 2 else 32


def _num_tiles(p: Problem, block_m: int, block_n: int) -> int:
    return pl.cdiv(p.m, block_m) * pl.cdiv(p.n, block_n) * p.num_batches


def _split_k(p: Problem, block_m: int, block_n: int, block_k: int, asked: int | None) -> int:
    """Programs per output tile: `asked`, less any split that would get no K block, or, when
    None, from the shape ("Configs by shape")."""
    num_k_blocks = pl.cdiv(p.k, block_k)
    if asked is not None:
        return pl.cdiv(num_k_blocks, pl.cdiv(num_k_blocks, asked))
    partial_bytes = p.num_batches * p.m * p.n * 4
    return split_reduction(_num_tiles(p, block_m, block_n), num_k_blocks,
                           min_steps=MIN_PIPELINED_STEPS,
                           max_splits=max_splits(flops_and_bytes(p)[1], partial_bytes)).splits


def resolve_config(p: Problem, config: MatmulConfig | None) -> MatmulConfig:
    """Fills unset fields from the shape class (module docstring, "Configs by shape")."""
    config = config or MatmulConfig()
    max_block, max_k = _largest_blocks(p)
    block_m, block_n = fill_sms(triton_block(p.m, max_block), triton_block(p.n, max_block),
                                lambda rows, cols: _num_tiles(p, rows, cols))
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


def _split(p: Problem, config: MatmulConfig) -> Split:
    num_k_blocks = pl.cdiv(p.k, config.block_k)
    return Split(config.split_k, pl.cdiv(num_k_blocks, config.split_k))


def check(p: Problem, config: MatmulConfig | None) -> None:
    """Declines non-float operands and blocks over the GPU's shared memory; rejects a config
    that Triton cannot compile."""
    require_floating(a=p.a_dtype, b=p.b_dtype)
    config = resolve_config(p, config)
    check_triton_config(config, ("block_m", "block_n", "block_k"))
    itemsize = max(jnp.dtype(p.a_dtype).itemsize, jnp.dtype(p.b_dtype).itemsize)
    require_shared_memory(triton_dot_shared_bytes(config.block_m, config.block_n, config.block_k,
                                                  itemsize, config.num_stages))
    for field in ("group_m", "split_k"):
        if not is_positive_int(getattr(config, field)):
            raise ValueError(f"config.{field} must be a positive int, got "
                             f"{getattr(config, field)!r}")


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
    split = pl.program_id(2)  # partial sums of this split's K range, stored at [split, batch]
    first, count = _split(p, config).range_of(split, num_k_blocks)
    out_index = split * p.num_batches + batch
    acc = int32_loop(count, lambda i, acc: step(first + i, acc),
                     jnp.zeros((block_m, block_n), p.accumulator_dtype))
    triton_store(_tile(out_ref, out_index, rows, cols), acc.astype(out_ref.dtype),
                 mask=_tile_mask(rows, cols))


def _moved_bytes(p: Problem, config: MatmulConfig, partial_bytes: int) -> int:
    """Each tile program of each output batch streams its (block_m, K) panel of A and (K,
    block_n) panel of B (the grouped order serves most re-reads from L2) and writes its
    output tile, or, split, `partial_bytes` of float32 partials that XLA reads back."""
    panels = (p.m * p.k * jnp.dtype(p.a_dtype).itemsize * pl.cdiv(p.n, config.block_n)
              + p.k * p.n * jnp.dtype(p.b_dtype).itemsize * pl.cdiv(p.m, config.block_m))
    written = partial_bytes or p.num_batches * p.m * p.n * jnp.dtype(p.out_dtype).itemsize
    return p.num_batches * panels + written


def matmul(a: jax.Array, b: jax.Array, p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array:
    """`op(a) @ op(b)` for a problem that `check` accepted; returns out_batch + (M, N)."""
    config = resolve_config(p, config)
    num_tiles = pl.cdiv(p.m, config.block_m) * pl.cdiv(p.n, config.block_n)
    splits = config.split_k
    out_dtype = p.out_dtype if splits == 1 else p.accumulator_dtype
    partial_bytes = 0 if splits == 1 else 2 * splits * p.num_batches * p.m * p.n * 4
    kernel = functools.partial(_matmul_kernel, p=p, config=config, precision=precision)
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits * p.num_batches, p.m, p.n), out_dtype),
        grid=(num_tiles, p.num_batches, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=_moved_bytes(p, config, partial_bytes),
        name="matmul_triton" if splits == 1 else "matmul_split_k_triton",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]))
    if splits > 1:  # XLA's reduction: a fixed order, the same sum on every run
        out = out.reshape(splits, p.num_batches, p.m, p.n).sum(axis=0).astype(p.out_dtype)
    return out.reshape(*p.out_batch, p.m, p.n)
