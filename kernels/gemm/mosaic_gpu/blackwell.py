"""The GEMM engine's persistent, warp-specialized kernel for Blackwell (sm_100a): tcgen05
MMAs into tensor memory, the epilogue on a warpgroup of its own (the package's docstring has
the loop nest; `launch.launch` calls it where the plan is `TCGEN05`).

Block schedule
--------------
grid = (num_ctas,): at most one CTA per SM (`Plan.num_ctas`), each of two warpgroups. CTA c
walks the work items c, c + num_ctas, ... of (split, batch, output tile) as Hopper's kernel
does (`tiles.item_of`); item i is the CTA's i-th. Per item:
  - warp 0 of warpgroup 0 (the producer) copies, by TMA, the (block_m, block_k) tile of A and
    the (block_k, block_n) tile of B of each K step into a ring of `Plan.stages` shared-memory
    slots: the CTA's K step s, counted over all its items, fills slot s % stages once the MMA
    of K step s - stages has read it (`consumed`), and its copies arrive on `loaded`
    (`tiles.load_step`: two for matrices, a box a piece for images). A K step is a term of a
    K slice (`tiles.Terms`): one term, the slice itself, or for float32 and mixed products the
    split parts' terms (`config.split_terms`: hi · hi, hi · lo, lo · hi), each slice's terms
    in a row, each reading its parts' tiles where the
    operand lays them out (each part once: `launch.split_parts`);
  - warp 1 of warpgroup 0 (the MMA issuer) waits for each slot (`loaded`) and issues one
    tcgen05 MMA of A's slot by B's slot into the item's accumulator, `block_n` float32 columns
    of tensor memory of 128 lanes (rows); the tensor core arrives on `consumed` when the MMA
    has read the slot. Split parts have two sums per item, the first term's and the
    corrections' (`_summed`; hence at most 128 columns: `config.tcgen05_columns`).
    Accumulators alternate between two halves (`ACCUMULATORS`), so item i's MMAs run while
    the epilogue drains item i - 1's; before item i it waits for the epilogue to have read
    item i - 2's (`stored`), and after its last MMA commits to `ready`;
  - warpgroup 1 (the epilogue) waits for `ready`, loads the accumulator from tensor memory in
    column slices of `TCGEN05_EPILOGUE_COLUMNS` (one row a thread; both sums' slices, added
    where the first is finite, for split parts), applies bias, activation and
    residual (`tiles.epilogue_slice`) and stores each slice by TMA, then, once its loads from
    tensor memory are done (`wait_load_tmem`), frees the half (arrives on `stored`).
`consumed`, `ready` and `stored` order the tensor core (`orders_tensor_core`): the MMAs' reads
and writes are asynchronous, and these barriers are what the other roles wait for.
There are no wgmma register accumulators, so no warpgroup needs `setmaxnreg`: the epilogue holds
one 128 x `TCGEN05_EPILOGUE_COLUMNS` slice (32 float32 registers a thread).
Ragged tiles are zero-filled by TMA on load and dropped on store, as in Hopper's kernel; the
operands may be NHWC images read in place (`tiles.Pixels`: conv2d's forward, the output
stored as NHWC; `tiles.PixelSums`: its weight gradient).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels.matmul.common import Problem
from kernels.gemm.mosaic_gpu import tiles
from kernels.gemm.mosaic_gpu.config import (ACCUMULATORS, TCGEN05, WG_ROWS, Plan,
                                           epilogue_columns)
from kernels.gemm.mosaic_gpu.tiles import ONE_TERM, Pixels, PixelSums, Terms

__all__ = ["kernel", "WARPGROUPS"]

WARPGROUPS = 2  # the producer and MMA warps' warpgroup, and the epilogue's
_MMA_WG, _EPILOGUE_WG = 0, 1
_PRODUCER_WARP, _MMA_WARP = 0, 1


def _summed(values: list):
    """The accumulator of a tile's slice: the first term's sum, plus the corrections' where
    it is finite. Where it is not (an Inf or NaN part, or a product past float32's range),
    the corrections multiplied the same Inf or NaN part by a part that may be 0 or of the
    other sign, whose NaN is not the float32 product's: the first term's Inf or NaN is."""
    if len(values) == 1:
        return values[0]
    first, corrections = values
    return jnp.where(jnp.abs(first) < jnp.inf, first + corrections, first)


def _smem_tile(rows: int, block_k: int, transposed: bool, stages: int, dtype, boxed: bool):
    shape = (block_k, rows) if transposed else (rows, block_k)
    return tiles.slots(stages, shape, dtype, boxed)


def kernel(*refs, p: Problem, plan: Plan, terms: Terms | None,
           pixels: Pixels | PixelSums | None):
    (a_gmem, b_gmem), bias, residual, out_gmem, z_gmem = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n, block_k, stages = plan.block_m, plan.block_n, plan.block_k, plan.stages
    walked = terms or Terms(ONE_TERM, 1)  # split parts' terms, or the one product
    per_split = tiles.k_slices(p, plan, pixels)  # of the product; a step a term of one
    steps = per_split * len(walked.pairs)
    sums = 1 if terms is None else 2  # the first term's, and the corrections'
    boxed = tiles.boxed_operands(pixels)
    width = tiles.epilogue_width(epilogue_columns(TCGEN05, block_n), block_n, pixels, out_gmem,
                                 z_gmem)
    scratch = dict(
        a_smem=_smem_tile(block_m, block_k, p.transpose_a, stages, a_gmem.dtype, boxed[0]),
        b_smem=_smem_tile(block_n, block_k, not p.transpose_b, stages, b_gmem.dtype, boxed[1]),
        acc_tmem=plgpu.TMEM((block_m, ACCUMULATORS * sums * block_n), jnp.float32),
        loaded=plgpu.Barrier(num_arrivals=tiles.loads_per_step(pixels, plan),
                             num_barriers=stages),
        consumed=plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
        ready=plgpu.Barrier(num_barriers=ACCUMULATORS, orders_tensor_core=True),
        stored=plgpu.Barrier(num_barriers=ACCUMULATORS, orders_tensor_core=True),
        **tiles.epilogue_scratch(1, block_m, width, out_gmem, z_gmem, residual,
                                 pixels))

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(a_smem, b_smem, acc_tmem, loaded, consumed, ready, stored, out_smem,
               z_smem=None, res_smem=None, barrier=None):
        wg = lax.axis_index("wg")
        (a_boxes, a_tiled), (b_boxes, b_tiled) = (
            tiles.slot_views(ring, box) for ring, box in zip((a_smem, b_smem), boxed))
        out_views, z_views = (tiles.output_views(smem, pixels) for smem in (out_smem, z_smem))

        @plgpu.nd_loop((jnp.int32(plan.tiles(p) * plan.splits),), collective_axes="sm")
        def _item(info):
            item = tiles.item_of(info.index[0], a_gmem, b_gmem, p, plan, terms, pixels)
            local = info.local_index
            half = lax.rem(local, ACCUMULATORS)
            accs = [acc_tmem.at[:, pl.ds((half * sums + i) * block_n, block_n)]
                    for i in range(sums)]

            def produce(k, _):  # K slice k of the item: a step a term
                slice_k = item.k_first + k
                for t, (i, j) in enumerate(walked.pairs):
                    step = local * steps + k * len(walked.pairs) + t
                    slot = lax.rem(step, stages)

                    @pl.when(step >= stages)
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    tiles.load_step(item, walked.a_block(slice_k, i), walked.b_block(slice_k, j),
                                    a_boxes.at[slot], b_boxes.at[slot], loaded.at[slot], p, plan,
                                    pixels)

            def multiply(k, _):
                for t in range(len(walked.pairs)):
                    slot = lax.rem(local * steps + k * len(walked.pairs) + t, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    a_tile, b_tile = a_tiled.at[slot], b_tiled.at[slot]
                    a_tile = a_tile.transpose((1, 0)) if p.transpose_a else a_tile
                    b_tile = b_tile.transpose((1, 0)) if p.transpose_b else b_tile
                    # The first term into its own sum; the corrections into the other.
                    plgpu.tcgen05_mma(accs[min(t, 1)], a_tile, b_tile, consumed.at[slot],
                                      accumulate=(k > 0) | (t > 1))

            @pl.when(wg == _MMA_WG)
            def _():
                @plgpu.warp_map
                def _(warp):
                    @pl.when(warp == _PRODUCER_WARP)
                    def _():
                        lax.fori_loop(0, per_split, produce, None)

                    @pl.when(warp == _MMA_WARP)
                    def _():
                        @pl.when(local >= ACCUMULATORS)  # the epilogue has read this half
                        def _():
                            plgpu.barrier_wait(stored.at[half])

                        lax.fori_loop(0, per_split, multiply, None)
                        plgpu.tcgen05_commit_arrive(ready.at[half])

            @pl.when(wg == _EPILOGUE_WG)
            def _():
                plgpu.barrier_wait(ready.at[half])
                rows = pl.ds(item.m_tile * block_m, block_m)
                ctx = dict(slot=0, layout=plgpu.Layout.TCGEN05, batch=item.batch, rows=rows,
                           n_start=item.n_tile * block_n, bias=bias, residual=residual,
                           out=out_gmem, z=z_gmem, out_smem=out_views, z_smem=z_views,
                           res_smem=res_smem, barrier=barrier,
                           store=tiles.store_of(item, rows, item.m_tile * (block_m // WG_ROWS),
                                                block_m // WG_ROWS, pixels))
                for column in range(0, block_n, width):
                    values = [plgpu.async_load_tmem(acc.at[:, pl.ds(column, width)])
                              for acc in accs]
                    tiles.epilogue_slice(_summed(values), column, ctx, p)
                plgpu.wait_load_tmem()  # every slice has left tensor memory
                plgpu.barrier_arrive(stored.at[half])

        @pl.when(wg == _EPILOGUE_WG)
        def _():
            plgpu.wait_smem_to_gmem(0)
