"""The scatter-add gradient of gather as a Pallas kernel lowered through Mosaic GPU (sm_90a,
sm_100a) (the package's docstring has both kernels' loop nests).

Block schedule (deterministic scatter-add)
------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`): `order` lists the index
positions by target row, `row_starts` delimits each table row's segment, so the positions of
a block of table rows are one contiguous range [row_starts[r0], row_starts[r0 + tile_rows]).
Grid `(batch · blocks · num_pieces,)`: one CTA (one warpgroup) per batch slice b, block of
`tile_rows` table rows and piece of `PIECE` columns. It walks its range through a ring of
`slots` one-row slots in shared memory, a barrier each, `slots` cotangent rows in flight:

    start loading positions s0 .. s0 + slots - 1:  TMA g[b, order[s], piece] -> slot
    for each table row r of the block:
        acc = 0                                                 # (1, PIECE) float32
        for s in r's segment:
            wait for s's slot;  acc += slot                     # registers
            start loading position s + slots into the slot
        tile[r - r0] = acc                                      # shared memory
    TMA: tile -> dx[b, r0 : r0 + tile_rows, piece]

Every table row is written once, zeros included, by the CTA that owns it; dropped indices sort
past the last row and are never read. No atomics: each output element has one writer and a
fixed summation order (the stable sort's), so every run gives the same bits.

Memory traffic: each cotangent row read once (its position belongs to one table row), the
table gradient written once, the sorted order and segment starts read once per piece:
`common.scatter_bytes` and those re-reads (`_cost`). Rows that are not a multiple of 16 bytes
(TMA's stride rule) are padded: a copy of the cotangent before the launch and of the gradient
after it, by XLA. A row hit many times is summed by one CTA per piece, one position after another:
its time grows with its hits (the Triton backward splits such rows into pieces; this one does
not yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, mosaic_gpu_call, piece_columns, row_layout,
                                        smem, store)
from kernels.gather.common import GatherConfig, Problem, ScatterPlan, scatter_bytes
from kernels.gather.mosaic_gpu.config import Plan, plan_of
from kernels.gather.mosaic_gpu.forward import padded_rows

__all__ = ["scatter_add"]


def _scatter_block(order_ref, starts_ref, g_ref, dx_ref, ring, tile, barriers, p: Problem,
                   plan: Plan) -> None:
    """The body of one CTA."""
    program = jax.lax.axis_index("blocks")
    piece = program % plan.num_pieces
    block = program // plan.num_pieces
    batch, first_row = block // plan.blocks, block % plan.blocks * plan.tile_rows
    start = starts_ref[first_row]
    stop = starts_ref[jnp.minimum(first_row + plan.tile_rows, p.n)]
    layout = row_layout(1, PIECE, jnp.dtype(jnp.float32).itemsize)

    def load(position):
        slot = (position - start) % plan.slots
        plgpu.copy_gmem_to_smem(g_ref.at[batch, pl.ds(order_ref[position], 1),
                                         piece_columns(piece)],
                                ring.at[pl.ds(slot, 1)], barriers.at[slot])

    def prefetch(position, carry):
        @pl.when(position < stop)
        def _():
            load(position)
        return carry

    jax.lax.fori_loop(start, start + plan.slots, prefetch, 0)

    def add(position, acc):
        slot = (position - start) % plan.slots
        plgpu.barrier_wait(barriers.at[slot])
        row = plgpu.load(ring.at[pl.ds(slot, 1)], layout=layout, optimized=False)
        plgpu.commit_smem()  # every thread has read the slot: it may be refilled
        prefetch(position + plan.slots, 0)
        return acc + row.astype(jnp.float32)

    def sum_row(i, carry):
        row = jnp.minimum(first_row + i, p.n)  # rows past the table: an empty segment
        segment_start = starts_ref[row]
        segment_stop = starts_ref[jnp.minimum(row + 1, p.n)]
        zeros = plgpu.layout_cast(jnp.zeros((1, PIECE), jnp.float32), layout)
        acc = jax.lax.fori_loop(segment_start, segment_stop, add, zeros)
        store(tile.at[pl.ds(i, 1)], acc.astype(tile.dtype))
        return carry

    jax.lax.fori_loop(0, plan.tile_rows, sum_row, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, dx_ref.at[batch, pl.ds(first_row, plan.tile_rows),
                                            piece_columns(piece)])
    plgpu.wait_smem_to_gmem(0)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    blocks = plan_of(p, config, backward=True)
    body = functools.partial(_scatter_block, p=p, plan=blocks)
    dx = mosaic_gpu_call(
        body, out_shape=[jax.ShapeDtypeStruct((p.batch, p.n, blocks.aligned), g.dtype)],
        grid=(blocks.programs,), grid_names=("blocks",), interpret=interpret,
        name="scatter_add_mosaic_gpu",
        scratch=[smem((blocks.slots, PIECE), g.dtype), smem((blocks.tile_rows, PIECE), g.dtype),
                 plgpu.Barrier(num_arrivals=1, num_barriers=blocks.slots)],
        flops_and_bytes=_cost(p, blocks))(plan.order, plan.row_starts, padded_rows(g, blocks))[0]
    return dx[..., :p.columns] if blocks.aligned != p.columns else dx


def _cost(p: Problem, plan: Plan) -> tuple[int, int]:
    """One add per cotangent element; `scatter_bytes` at the padded rows, with the order and
    the segment starts read once per piece."""
    padded = p._replace(columns=plan.aligned)
    reread = (plan.num_pieces - 1) * p.batch * (4 * p.num_indices + 4 * (p.n + 1))
    return p.batch * p.num_indices * plan.aligned, scatter_bytes(padded) + reread
