"""The scatter-add gradient of gather as a Pallas kernel lowered through Mosaic (TPU) (the
package's docstring has both kernels' loop nests).

Backward: deterministic scatter-add, one owner per table block
--------------------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`); the boundaries of the
segments of table-row blocks are scalar-prefetched into SMEM. grid = (batch, cdiv(n,
block_rows), columns // block_columns), all "parallel": step (b, r, c) owns the
(block_rows, block_columns) block of the table gradient, accumulated in a float32 VMEM scratch
zeroed at the start. It walks the sorted positions [start, stop) whose targets land in its
rows through the ring (staging their positions and targets 128 at a time from aligned
offsets): for each, it waits for the cotangent's word-row holding `g[b, position, column
block]`, shifts the row out, adds it into accumulator row `target - first row`, and starts the
copy `depth` positions ahead. Finally the block is cast and written once by the BlockSpec
pipeline. Rows past n in a ragged last block are never targeted and their writes are dropped.
No atomics: one owner per output block and a fixed summation order, so every run gives the
same bits. Column blocks are up to 4096 wide, or the whole row where its width is not a
multiple of 128 (one DMA per row and column block).

Memory traffic: the cotangent read once (twice for 16-bit cotangents: word-rows), the table
gradient written once; one DMA per index and column block, `depth` in flight, the ring filled
and drained once per step. A step owns its rows' whole segments, so a row hit k times still
costs its step k DMAs (the Triton backward bounds this with pieces; not done here).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import LANES
from kernels._pallas import mapped_under_vmap, mosaic_call, pl, pltpu, vmem_limit
from kernels.gather.common import GatherConfig, Problem, ScatterPlan, scatter_bytes
from kernels.gather.mosaic.config import INDEX_BLOCK, resolve_config, ring_depth, scatter_vmem_bytes
from kernels.gather.mosaic.ring import Ring, padded_to_blocks, staged_scratch, staged_value
from kernels.gather.mosaic.words import (BITS, row_of_word, rows_per_word_of, start_row_copy,
                                         word_operands, word_rows)

__all__ = ["scatter_add"]


def _scatter_add_kernel(block_starts_smem, order_hbm, targets_hbm, g_hbm, g_tail_hbm, out_ref,
                        acc_ref, words_vmem, order_smem, targets_smem, sems, staging_sem, *,
                        p: Problem, block_rows: int, block_columns: int):
    batch, row_block = pl.program_id(0), pl.program_id(1)
    columns = (slice(None) if block_columns == p.columns else
               pl.ds(pl.multiple_of(pl.program_id(2) * block_columns, LANES), block_columns))
    first_row = row_block * block_rows
    start, stop = block_starts_smem[row_block], block_starts_smem[row_block + 1]
    per_word = rows_per_word_of(p.dtype)
    g = word_rows(g_hbm.at[batch], p.num_indices, per_word)
    g = None if g is None else g.at[:, columns]
    g_tail = word_rows(g_tail_hbm.at[batch], per_word, per_word).at[:, columns]
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def start_copy(j, buffer, sem):
        start_row_copy(g, g_tail, staged_value(order_smem, j), p.num_indices, per_word, buffer,
                       sem)

    def add(j, buffer):
        local = pl.ds(staged_value(targets_smem, j) - first_row, 1)
        offset = staged_value(order_smem, j) % per_word
        bits = row_of_word(buffer[...], offset, per_word)
        row = lax.bitcast_convert_type(bits.astype(BITS[p.itemsize]), p.dtype)
        acc_ref[local, :] = acc_ref[local, :] + row.astype(jnp.float32)

    ring = Ring(words_vmem, sems, staging_sem, g_tail,
                 ((order_hbm, order_smem), (targets_hbm, targets_smem)), stop, start_copy, add)

    def add_block(block, carry):
        first = block * INDEX_BLOCK
        ring.run(jnp.maximum(start, first), jnp.minimum(stop, first + INDEX_BLOCK))
        return carry

    pl.when(start < stop)(lambda: ring.fill(start))
    # The aligned 128-index blocks that overlap [start, stop).
    lax.fori_loop(start // INDEX_BLOCK, pl.cdiv(stop, jnp.int32(INDEX_BLOCK)), add_block, 0)
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    block_rows, block_columns = config.block_rows, config.block_columns
    num_row_blocks = pl.cdiv(p.n, block_rows)
    depth = ring_depth(block_columns)
    bounds = jnp.minimum(jnp.arange(num_row_blocks + 1, dtype=jnp.int32) * block_rows, p.n)
    block_starts = plan.row_starts[bounds]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(p.batch, num_row_blocks, p.columns // block_columns),
        in_specs=[hbm, hbm, hbm, hbm],
        out_specs=pl.BlockSpec((None, block_rows, block_columns),
                               lambda b, r, c, starts: (b, r, c)),
        scratch_shapes=[pltpu.VMEM((block_rows, block_columns), jnp.float32),
                        pltpu.VMEM((depth, 1, block_columns), jnp.int32),
                        staged_scratch(), staged_scratch(),
                        pltpu.SemaphoreType.DMA((depth,)), pltpu.SemaphoreType.DMA(())],
    )
    kernel = functools.partial(_scatter_add_kernel, p=p, block_rows=block_rows,
                               block_columns=block_columns)
    call = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel"),
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(scatter_vmem_bytes(p, config)),
        flops=p.batch * p.num_indices * p.columns,
        # The cotangent's word-rows, order and targets by the kernel's DMAs; the table
        # gradient by the pipeline.
        unpipelined_bytes=(scatter_bytes(p) - p.batch * p.n * p.columns * p.itemsize
                           + (rows_per_word_of(p.dtype) - 1) * math.prod(g.shape) * p.itemsize),
        name="scatter_add_mosaic",
    )
    return mapped_under_vmap(call)(block_starts, padded_to_blocks(plan.order),
                                    padded_to_blocks(plan.targets),
                                    *word_operands(g, interpret))
