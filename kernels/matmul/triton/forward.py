"""The matmul kernel lowered through Triton (GPU) and its launch (the package's docstring has
its loop nest). The backward is this kernel on transposed operands (`kernels/matmul/__init__.py`).

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
becomes the dot's input precision (DEFAULT: TF32, the float32 tiles rounded to nearest TF32 in
registers first, `kernels._blocks.tensor_core_operand`; HIGHEST: IEEE float32). After the loop the
epilogue (`kernels._epilogue`: bias, activation, residual) is applied to the accumulator tile,
which is cast to the output dtype and stored once, masked to the array (with the pre-activation
beside it where training saves it).

A transposed operand (the backward pass's Aᵀ and Bᵀ) is loaded as a (block_k, block_m) tile from
its stored layout and the transpose happens in the dot, never in HBM, except in float32: TF32
tensor-core dots take K-major tiles only, so an MN-major float32 operand (B stored (K, N), A
stored (K, M)) is copied transposed by XLA first where it is reused enough to repay the copy
(`config.k_major_copies`), and every tile then loads 16 bytes at a time.

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

from kernels import _epilogue
from kernels._blocks import int32_loop, tensor_core_operand
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.matmul.common import (MatmulConfig, Problem, batch_index, dot, flops_and_bytes,
                                   moved_bytes)
from kernels.matmul.triton.config import k_major_copies, k_split, resolve_config

__all__ = ["matmul"]


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


def _load_bias(bias_ref, cols: _Span) -> jax.Array:
    """The (1, block_n) bias tile; columns past N read 0."""
    view = bias_ref.at[pl.ds(cols.start, cols.size)]
    bias = triton_load(view) if cols.valid is None else triton_load(view, mask=cols.valid,
                                                                      other=0)
    return bias[None, :]


def _matmul_kernel(*refs, p: Problem, config: MatmulConfig, precision):
    (a_ref, b_ref), bias_ref, residual_ref, out_ref, z_ref = _epilogue.split_refs(
        refs, p.epilogue, 2)
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
        return acc + dot(tensor_core_operand(a_tile, p.compute_dtype, precision),
                         tensor_core_operand(b_tile, p.compute_dtype, precision), p, precision)

    num_k_blocks = pl.cdiv(p.k, block_k)
    split = pl.program_id(2)  # partial sums of this split's K range, stored at [split, batch]
    first, count = k_split(p, config).range_of(split, num_k_blocks)
    out_index = split * p.num_batches + batch
    acc = int32_loop(count, lambda i, acc: step(first + i, acc),
                     jnp.zeros((block_m, block_n), p.accumulator_dtype))
    bias = None if bias_ref is None else _load_bias(bias_ref, cols)
    residual = None if residual_ref is None else _load_tile(residual_ref, batch, rows, cols)
    y, z = _epilogue.on_accumulator(acc, bias, residual, p.epilogue)
    mask = _tile_mask(rows, cols)
    triton_store(_tile(out_ref, out_index, rows, cols), y, mask=mask)
    if z_ref is not None:
        triton_store(_tile(z_ref, out_index, rows, cols), z, mask=mask)


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` with `p.epilogue`, for a problem that `check` accepted: out_batch +
    (M, N), and the pre-activation beside it where the epilogue saves it."""
    a, b, p = _k_major(a, b, p, precision)
    config = resolve_config(p, config)
    if residual is not None:
        residual = residual.reshape(p.num_batches, p.m, p.n)
    if config.split_k > 1:  # the kernel writes partials; the epilogue runs in XLA's reduction
        return _split_k(a, b, bias, residual, p, config, precision, interpret)
    kernel = functools.partial(_matmul_kernel, p=p, config=config, precision=precision)
    num_tiles = pl.cdiv(p.m, config.block_m) * pl.cdiv(p.n, config.block_n)
    outs = triton_call(
        kernel,
        out_shape=_epilogue.out_shapes((p.num_batches, p.m, p.n), p.out_dtype, p.epilogue),
        grid=(num_tiles, p.num_batches, 1),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=moved_bytes(p, config.block_m, config.block_n, 0),
        name="matmul_triton",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]), *_epilogue.operands(bias, residual))
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, p.m, p.n), outs)


def _k_major(a: jax.Array, b: jax.Array, p: Problem, precision):
    """The operands (and problem) with the MN-major float32 ones that `k_major_copies` picks
    copied transposed by XLA, so TF32 tiles load 16 bytes at a time."""
    copy_a, copy_b = k_major_copies(p, precision)
    if copy_a:
        a, p = jnp.swapaxes(a, -1, -2), p._replace(transpose_a=False)
    if copy_b:
        b, p = jnp.swapaxes(b, -1, -2), p._replace(transpose_b=True)
    return a, b, p


def _split_k(a, b, bias, residual, p: Problem, config: MatmulConfig, precision, interpret):
    """Split-K: `config.split_k` programs per tile write float32 partials; XLA adds them in a
    fixed order (the same sum on every run) and applies the epilogue in the same pass."""
    splits = config.split_k
    num_tiles = pl.cdiv(p.m, config.block_m) * pl.cdiv(p.n, config.block_n)
    partials_problem = p._replace(epilogue=_epilogue.Epilogue())
    partial_bytes = 2 * splits * p.num_batches * p.m * p.n * 4
    kernel = functools.partial(_matmul_kernel, p=partials_problem, config=config,
                               precision=precision)
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits * p.num_batches, p.m, p.n), p.accumulator_dtype),
        grid=(num_tiles, p.num_batches, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=moved_bytes(partials_problem, config.block_m, config.block_n,
                                   partial_bytes),
        name="matmul_split_k_triton",
    )(a.reshape(math.prod(p.a_batch), *a.shape[-2:]),
      b.reshape(math.prod(p.b_batch), *b.shape[-2:]))
    summed = out.reshape(splits, p.num_batches, p.m, p.n).sum(axis=0)
    outs = _epilogue.apply_after_sum(summed, bias, residual, p.epilogue, p.out_dtype)
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, p.m, p.n), outs)
