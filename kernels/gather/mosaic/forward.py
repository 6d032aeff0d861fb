"""Gather as Pallas kernels lowered through Mosaic (TPU): the forward (the package's docstring
has both kernels' loop nests and what the TPU's memory layout allows).

Forward, 32-bit tables: row DMAs, HBM to HBM
---------------------------------------------
The table, the output and a small `fill` block stay in HBM (`memory_space=pl.ANY`).
grid = (cdiv(batch, block_batch), cdiv(m, 128)), both "parallel". Step (i, j) stages its 128
indices, then for each of its (at most 128) positions counts a negative index from the end,
applies the mode with scalar arithmetic and starts one DMA of the (block_batch, 1, columns) slab
`x[batch block, row, :]` (for an out-of-range index under "fill": of the `fill` block) to
`out[batch block, position, :]`; then waits for all of them: up to 128 DMAs in flight. The last
batch block is shifted back to end at the array's edge (it recopies identical values), so
every DMA has one static shape. Rows are in [0, n) before any DMA starts, so no read leaves the
table. Traffic: each gathered row read once, each output element written once.

Forward, 16-bit and 8-bit tables: word-row DMAs into VMEM
---------------------------------------------------------
grid = (ranges, batch, blocks_per_range): the cdiv(m, 128) index blocks in ranges of
consecutive blocks, at most one per TensorCore (`core_ranges`: 2 on a megacore v4, else 1; a
short last range's extra steps repeat its last block and do nothing), the first two axes
"parallel", the last "arbitrary", so one core runs a range's steps in order and its ring runs
across them. A range's first step fills the ring: stages its index block (and starts staging
the next), starts the word-row DMAs of its first `depth` positions. Step (r, b, k) then, for
each of its 128 positions, waits for the (1, columns) int32 word-row holding its row in its
ring slot, shifts the row out of each word (`row_of_word`; bits move, so it is exact) or takes
the fill value, writes it into its row of a (128, columns) int32 VMEM scratch, and starts the
copy `depth` positions ahead into the slot just read. For the last `depth` positions of a step
that copy's index lies in the next index block, whose staging the previous step (or the fill)
started and this step waits for before its first such copy. The rows of a last, partial
word-row (n odd for 16-bit tables) come from a copy of them zero-padded to a whole word-row,
made by the wrapper, so no DMA leaves the table (the backward does the same for the cotangent).
The scratch is narrowed into the (128, columns) output block, which the BlockSpec pipeline
writes back (rows past m dropped). Traffic: 2x (8-bit: 4x) each gathered row's bytes read, each
output element written once. On a CPU the word view is made by XLA in the wrapper
(`interpreted_word_rows`, the same words); which half of a word holds the even row on a TPU is
JAX's `Ref.bitcast` convention (row 0 in the low bits), which no device here has confirmed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels._blocks import core_ranges, range_block
from kernels._pallas import mapped_under_vmap, mosaic_call, pl, pltpu, vmem_limit
from kernels.gather.common import GatherConfig, Problem, gather_bytes, row_of_index
from kernels.gather.mosaic.config import (INDEX_BLOCK, gather_vmem_bytes, resolve_config,
                                          ring_depth)
from kernels.gather.mosaic.ring import Ring, padded_to_blocks, stage, staged_scratch, staged_value
from kernels.gather.mosaic.words import (BITS, row_of_word, rows_per_word_of, start_row_copy,
                                         word_operands, word_rows)

__all__ = ["gather"]


def _valid_positions(block: jax.Array, p: Problem) -> jax.Array:
    return jnp.minimum(INDEX_BLOCK, p.num_indices - block * INDEX_BLOCK)


def _slab_gather_kernel(indices_hbm, x_hbm, fill_hbm, out_hbm, indices_smem, sem, *,
                        p: Problem, block_batch: int):
    first_batch = jnp.minimum(pl.program_id(0) * block_batch, p.batch - block_batch)
    block = pl.program_id(1)
    stage(indices_hbm, block, indices_smem)
    batches = pl.ds(first_batch, block_batch)
    count = _valid_positions(block, p)

    def destination(j):
        return out_hbm.at[batches, pl.ds(block * INDEX_BLOCK + j, 1), :]

    def start(j, carry):
        row, in_range = row_of_index(indices_smem[j], p.n, p.mode)
        copy_row = pltpu.make_async_copy(x_hbm.at[batches, pl.ds(row, 1), :], destination(j),
                                         sem)
        if p.mode != "fill":
            copy_row.start()
            return carry

        @pl.when(in_range)
        def _():
            copy_row.start()

        @pl.when(jnp.logical_not(in_range))
        def _():
            pltpu.make_async_copy(fill_hbm, destination(j), sem).start()

        return carry

    def wait(j, carry):
        # Every copy has the same shape, so any same-shaped descriptor waits for one of them.
        pltpu.make_async_copy(fill_hbm, destination(j), sem).wait()
        return carry

    lax.fori_loop(jnp.int32(0), count, start, 0)
    lax.fori_loop(jnp.int32(0), count, wait, 0)


def _word_gather_kernel(indices_hbm, x_hbm, tail_hbm, out_ref, indices_smem, words_vmem,
                        rows_vmem, sems, staging_sem, *, p: Problem, blocks_per_range: int):
    index_range, batch, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo = (index_range * blocks_per_range + step) * INDEX_BLOCK
    end = jnp.minimum(p.num_indices, (index_range + 1) * blocks_per_range * INDEX_BLOCK)
    fill = int(np.asarray(p.fill_value).view(BITS[p.itemsize]))
    per_word = rows_per_word_of(p.dtype)
    words = word_rows(x_hbm.at[batch], p.n, per_word)
    tail = word_rows(tail_hbm.at[batch], per_word, per_word)

    def row_of(j):
        return row_of_index(staged_value(indices_smem, j), p.n, p.mode)

    def start_copy(j, buffer, sem):
        start_row_copy(words, tail, row_of(j)[0], p.n, per_word, buffer, sem)

    def gather_one(j, buffer):
        row, in_range = row_of(j)
        value = row_of_word(buffer[...], row % per_word, per_word)
        if p.mode == "fill":
            value = jnp.where(in_range, value, fill)
        rows_vmem[pl.ds(j - lo, 1), :] = value

    ring = Ring(words_vmem, sems, staging_sem, tail, ((indices_hbm, indices_smem),), end,
                 start_copy, gather_one)
    pl.when(step == 0)(lambda: ring.fill(lo))

    @pl.when(lo < end)  # else a short last range's extra step: its block stays as written
    def _():
        ring.run(lo, jnp.minimum(lo + INDEX_BLOCK, end))
        out_ref[...] = rows_vmem[...].astype(out_ref.dtype)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    config = resolve_config(p, config)
    bits = x.dtype if x.dtype == BITS[p.itemsize] else BITS[p.itemsize]
    num_blocks = pl.cdiv(p.num_indices, INDEX_BLOCK)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = jax.ShapeDtypeStruct((p.batch, p.num_indices, p.columns), bits)
    if p.itemsize == 4:
        block_batch = min(config.block_batch, p.batch)
        fill = jnp.full((block_batch, 1, p.columns), p.fill_value, x.dtype)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(pl.cdiv(p.batch, block_batch), num_blocks),
            in_specs=[hbm, hbm, hbm], out_specs=hbm,
            scratch_shapes=[pltpu.SMEM((INDEX_BLOCK,), jnp.int32),
                            pltpu.SemaphoreType.DMA(())])
        semantics = ("parallel", "parallel")
        kernel = functools.partial(_slab_gather_kernel, p=p, block_batch=block_batch)
        operands = tuple(lax.bitcast_convert_type(a, bits) for a in (x, fill))
        dma_bytes = gather_bytes(p)  # the kernel copies rows into the output itself
    else:
        num_ranges, blocks_per_range = core_ranges(num_blocks)
        depth = ring_depth(p.columns)

        def out_index(r, b, k):
            return b, range_block(r, k, blocks_per_range, num_blocks), 0

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(num_ranges, p.batch, blocks_per_range),
            in_specs=[hbm, hbm, hbm],
            out_specs=pl.BlockSpec((None, INDEX_BLOCK, p.columns), out_index),
            scratch_shapes=[staged_scratch(), pltpu.VMEM((depth, 1, p.columns), jnp.int32),
                            pltpu.VMEM((INDEX_BLOCK, p.columns), jnp.int32),
                            pltpu.SemaphoreType.DMA((depth,)), pltpu.SemaphoreType.DMA(())])
        semantics = ("parallel", "parallel", "arbitrary")  # a range's steps share its ring
        kernel = functools.partial(_word_gather_kernel, p=p, blocks_per_range=blocks_per_range)
        operands = word_operands(x, interpret)
        # The word-rows (rows_per_word times the gathered rows' bytes) and the indices.
        dma_bytes = (rows_per_word_of(p.dtype) * math.prod(out_shape.shape) * p.itemsize
                     + 4 * p.num_indices)
    call = mosaic_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        dimension_semantics=semantics,
        interpret=interpret,
        unpipelined_bytes=dma_bytes,
        vmem_limit_bytes=vmem_limit(gather_vmem_bytes(p)),
        name="gather_mosaic",
    )
    out = mapped_under_vmap(call)(padded_to_blocks(indices), *operands)
    return lax.bitcast_convert_type(out, x.dtype)
