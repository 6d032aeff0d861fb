"""Matmul as a persistent, warp-specialized Pallas kernel for Hopper (sm_90a): a TMA producer
warpgroup and wgmma consumers (the package's docstring has the loop nest; `launch.py` calls it
where the plan is `WGMMA`).

Block schedule
--------------
grid = (num_ctas,): at most one CTA per SM (`Plan.num_ctas`), each of three warpgroups. CTA c
walks the work items c, c + num_ctas, ... of (split, batch, output tile), the tiles of a batch
in planar-snake order (bands of `group_m` row tiles, so consecutive CTAs share B's panels in
L2). Per item:
  - the producer warpgroup (`PRODUCER_REGISTERS` registers a thread) copies, by TMA, the
    (block_m, block_k) tile of A and the (block_k, block_n) tile of B of each K step of the
    split's range into a ring of `Plan.stages` shared-memory slots (transposed operands as
    their stored (block_k, block_m) / (block_n, block_k) tiles); TMA zero-fills past M, N
    and K, so tiles that overhang the arrays need no masks (dims that are not whole TMA
    tiles themselves, `config.TMA_ROWS` x `TMA_COLUMNS`, are padded by XLA first);
  - each of the 2 consumer warpgroups multiplies its block_m / 2 rows of A's slot by B's slot
    with wgmma into a float32 accumulator in registers (a transposed 16-bit tile is taken as
    the instruction's transposed operand; TF32 takes K-major tiles only, so float32 operands
    arrive K-major: `launch._operands`), and releases the slot;
  - then it applies the epilogue to the accumulator in column slices of `EPILOGUE_COLUMNS`
    (bias loaded from GMEM, the residual slice by TMA), writes each slice (and z where saved)
    to shared memory and stores it by TMA, which drops what lies past the array's edges.
Split-K (few output tiles, long K): each split's items write float32 partials; XLA adds them
in a fixed order and applies the epilogue in the same pass.

Shifted rows (`tiles.Shifts`, conv2d's implicit GEMM, `kernels.conv2d.mosaic_gpu`): A is not a
matrix of the product's rows but windows of one, read at a row offset per K step (the forward:
tap row kh of K step k) or per output batch (the weight gradient: one tap row per batch). Each
offset is a multiple of TMA's 8-row tile, so a window is whole tiles of the shared-memory
layout, as TMA copies them (an offset within a tile would read zeros past the tile's rows).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels.gemm.mosaic_gpu import tiles
from kernels.gemm.mosaic_gpu.config import (CONSUMERS, PRODUCER_REGISTERS, WGMMA, Plan,
                                           epilogue_columns)
from kernels.gemm.mosaic_gpu.tiles import Shifts
from kernels.matmul.common import Problem

__all__ = ["kernel", "WARPGROUPS"]

WARPGROUPS = CONSUMERS + 1  # the consumers and the TMA producer


def kernel(*refs, p: Problem, plan: Plan, shifts: Shifts | None):
    (a_gmem, b_gmem), bias, residual, out_gmem, z_gmem = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n = plan.block_m, plan.block_n
    consumer_rows = block_m // CONSUMERS
    a_block = (plan.block_k, block_m) if p.transpose_a else (block_m, plan.block_k)
    b_block = (block_n, plan.block_k) if p.transpose_b else (plan.block_k, block_n)
    if shifts is not None and shifts.per_step:
        a_spec = tiles.shifted_spec(a_block, shifts, a_gmem.dtype)
    else:
        a_spec = tiles.operand_spec(a_block, 0 if p.transpose_a else 1, a_gmem.dtype)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(plan.k_blocks_per_split(p),), memory_registers=PRODUCER_REGISTERS,
            in_specs=[a_spec, tiles.operand_spec(b_block, 1 if p.transpose_b else 0,
                                                 b_gmem.dtype)],
            wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=plan.stages,
            compute_context=context)

    width = epilogue_columns(WGMMA, block_n)
    scratch = dict(
        allocations=pipeline(lambda *_, **__: None, lambda *_, **__: None).get_allocations(
            a_gmem.at[0], b_gmem.at[0]),
        **tiles.epilogue_scratch(CONSUMERS, consumer_rows, width, out_gmem, z_gmem, residual))

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(allocations, out_smem, z_smem=None, res_smem=None, barrier=None):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((jnp.int32(plan.tiles(p) * plan.splits),), collective_axes="sm")
        def _item(info):
            item = tiles.item_of(info.index[0], a_gmem, b_gmem, p, plan, shifts)

            def mma(_, a_smem, b_smem, acc_ref):
                own = pl.ds(wg * consumer_rows, consumer_rows)
                a_tile = a_smem.at[:, own].transpose((1, 0)) if p.transpose_a else a_smem.at[own]
                plgpu.wgmma(acc_ref, a_tile, b_smem.transpose((1, 0)) if p.transpose_b
                            else b_smem)
                plgpu.wgmma_wait(0)  # the slot is released when this step's products are done
                return acc_ref

            def context(run_pipeline):
                @functools.partial(pl.run_scoped,
                                   acc_ref=plgpu.ACC((consumer_rows, block_n), jnp.float32))
                def _(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...]
                    ctx = dict(slot=wg, layout=plgpu.Layout.WGMMA, batch=item.batch,
                               out_index=item.out_index,
                               rows=pl.ds(item.m_tile * block_m + wg * consumer_rows,
                                          consumer_rows),
                               n_start=item.n_tile * block_n, bias=bias, residual=residual,
                               out=out_gmem, z=z_gmem, out_smem=out_smem, z_smem=z_smem,
                               res_smem=res_smem, barrier=barrier)
                    for column in range(0, block_n, width):
                        tiles.epilogue_slice(acc[:, column:column + width], column, ctx, p)

            pipeline(mma, context)(item.a, item.b, allocations=allocations)

        plgpu.wait_smem_to_gmem(0)
