"""The GEMM engine's persistent, warp-specialized kernel for Hopper (sm_90a): a TMA producer
warpgroup and wgmma consumers (the package's docstring has the loop nest; `launch.py` calls it
where the plan is `WGMMA`).

Block schedule
--------------
grid = (num_ctas,): at most one CTA per SM (`Plan.num_ctas`), each of three warpgroups. CTA c
walks the work items c, c + num_ctas, ... of (split, batch, output tile), the tiles of a batch
in planar-snake order (bands of `group_m` row tiles, so consecutive CTAs share B's panels in
L2). Per item:
  - the producer warpgroup (its registers and the consumers': `config.registers`) copies, by
    TMA, the (block_m, block_k) tile of A and the (block_k, block_n) tile of B of each K step
    of the split's range into a ring of `Plan.stages` shared-memory slots: the CTA's K step
    s, counted over all its items, fills slot s % stages once both consumers have released
    K step s - stages (`consumed`), every copy arriving on the slot's `loaded` barrier
    (`tiles.loads_per_step`: a tile of a matrix is one copy, of images a box a piece:
    `tiles.load_step`). Transposed operands arrive as their stored (block_k, block_m) /
    (block_n, block_k) tiles; TMA zero-fills past M, N and K, so tiles that overhang the
    arrays need no masks (dims that are not whole TMA tiles themselves, `config.TMA_ROWS` x
    `TMA_COLUMNS`, are padded by XLA first);
  - each of the 2 consumer warpgroups waits for the slot, multiplies its block_m / 2 rows of
    A's slot by B's slot with wgmma into a float32 accumulator in registers (a transposed
    16-bit tile is taken as the instruction's transposed operand; TF32 takes K-major tiles
    only, so float32 operands arrive K-major: `launch._operands`), and releases the slot;
  - then it applies the epilogue to the accumulator in column slices of `EPILOGUE_COLUMNS`
    (bias loaded from GMEM, the residual slice by TMA), writes each slice (and z where saved)
    to shared memory and stores it by TMA, which drops what lies past the array's edges
    (into NHWC images a box a piece, for `tiles.Pixels`).
Split-K (few output tiles, long K): each split's items write float32 partials; XLA adds them
in a fixed order and applies the epilogue in the same pass.

Images (conv2d's implicit GEMM, `kernels.conv2d.mosaic_gpu`): A's rows may be the output
pixels of NHWC images read in place, a box of the input a piece of an output row per K step
(`tiles.Pixels`), or K the output pixels of the weight gradient, dY and x both boxed
(`tiles.PixelSums`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels.gemm.mosaic_gpu import tiles
from kernels.gemm.mosaic_gpu.config import (CONSUMERS, WG_ROWS, WGMMA, Plan, epilogue_columns,
                                           registers)
from kernels.gemm.mosaic_gpu.tiles import Pixels, PixelSums
from kernels.matmul.common import Problem

__all__ = ["kernel", "WARPGROUPS"]

WARPGROUPS = CONSUMERS + 1  # the consumers and the TMA producer
PRODUCER = CONSUMERS  # the producer's warpgroup index


def kernel(*refs, p: Problem, plan: Plan, pixels: Pixels | PixelSums | None):
    (a_gmem, b_gmem), bias, residual, out_gmem, z_gmem = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n, block_k, stages = plan.block_m, plan.block_n, plan.block_k, plan.stages
    consumer_rows = block_m // CONSUMERS
    steps = tiles.k_slices(p, plan, pixels)
    a_block = (block_k, block_m) if p.transpose_a else (block_m, block_k)
    b_block = (block_n, block_k) if p.transpose_b else (block_k, block_n)
    boxed = tiles.boxed_operands(pixels)
    width = tiles.epilogue_width(epilogue_columns(WGMMA, block_n), block_n, pixels, out_gmem,
                                 z_gmem)
    scratch = dict(
        a_smem=tiles.slots(stages, a_block, a_gmem.dtype, boxed[0]),
        b_smem=tiles.slots(stages, b_block, b_gmem.dtype, boxed[1]),
        loaded=plgpu.Barrier(num_arrivals=tiles.loads_per_step(pixels, plan),
                             num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        **tiles.epilogue_scratch(CONSUMERS, consumer_rows, width, out_gmem, z_gmem, residual,
                                 pixels))
    items = (jnp.int32(plan.tiles(p) * plan.splits),)
    producer_registers, consumer_registers = registers(pixels is not None)

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(a_smem, b_smem, loaded, consumed, out_smem, z_smem=None, res_smem=None,
               barrier=None):
        wg = lax.axis_index("wg")
        (a_boxes, a_tiled), (b_boxes, b_tiled) = (
            tiles.slot_views(ring, box) for ring, box in zip((a_smem, b_smem), boxed))
        out_views, z_views = (tiles.output_views(smem, pixels) for smem in (out_smem, z_smem))

        @pl.when(wg == PRODUCER)
        def _():
            plgpu.set_max_registers(producer_registers, action="decrease")

            @plgpu.nd_loop(items, collective_axes="sm")
            def _item(info):
                item = tiles.item_of(info.index[0], a_gmem, b_gmem, p, plan, pixels=pixels)

                def produce(k, carry):
                    step = info.local_index * steps + k
                    slot = lax.rem(step, stages)

                    @pl.when(step >= stages)  # both consumers are done with the slot
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    slice_k = item.k_first + k
                    tiles.load_step(item, slice_k, slice_k, a_boxes.at[slot], b_boxes.at[slot],
                                    loaded.at[slot], p, plan, pixels)
                    return carry

                lax.fori_loop(0, steps, produce, None)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(consumer_registers, action="increase")

            @plgpu.nd_loop(items, collective_axes="sm")
            def _item(info):
                item = tiles.item_of(info.index[0], a_gmem, b_gmem, p, plan, pixels=pixels)
                own = pl.ds(wg * consumer_rows, consumer_rows)

                def multiply(k, acc_ref):
                    slot = lax.rem(info.local_index * steps + k, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    a_tile, b_tile = a_tiled.at[slot], b_tiled.at[slot]
                    a_tile = a_tile.at[:, own].transpose((1, 0)) if p.transpose_a else (
                        a_tile.at[own])
                    plgpu.wgmma(acc_ref, a_tile, b_tile.transpose((1, 0)) if p.transpose_b
                                else b_tile)
                    plgpu.wgmma_wait(0)  # this step's products are done: release the slot
                    plgpu.barrier_arrive(consumed.at[slot])
                    return acc_ref

                @functools.partial(pl.run_scoped,
                                   acc_ref=plgpu.ACC((consumer_rows, block_n), jnp.float32))
                def _(acc_ref):
                    lax.fori_loop(0, steps, multiply, acc_ref)
                    acc = acc_ref[...]
                    rows = pl.ds(item.m_tile * block_m + wg * consumer_rows, consumer_rows)
                    first_half = (item.m_tile * block_m + wg * consumer_rows) // WG_ROWS
                    ctx = dict(slot=wg, layout=plgpu.Layout.WGMMA, batch=item.batch, rows=rows,
                               n_start=item.n_tile * block_n, bias=bias, residual=residual,
                               out=out_gmem, z=z_gmem, out_smem=out_views, z_smem=z_views,
                               res_smem=res_smem, barrier=barrier,
                               store=tiles.store_of(item, rows, first_half,
                                                    consumer_rows // WG_ROWS, pixels))
                    for column in range(0, block_n, width):
                        tiles.epilogue_slice(acc[:, column:column + width], column, ctx, p)

            plgpu.wait_smem_to_gmem(0)
