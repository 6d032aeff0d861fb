"""The Mosaic GPU matmul's launch (`matmul`, `launch`: operands laid out, plan, split-K's sum)
and its Hopper kernel, persistent and warp-specialized (sm_90a; the package's docstring has
the loop nest; Blackwell's kernel is `blackwell.py`).

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
    arrive K-major: `_operands`), and releases the slot;
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
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._blocks import round_to_tf32
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import mosaic_gpu_call, pad_to
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes, moved_bytes
from kernels.matmul.mosaic_gpu import blackwell, tiles
from kernels.matmul.mosaic_gpu.config import (CONSUMERS, PRODUCER_REGISTERS, TCGEN05, WGMMA,
                                              Plan, epilogue_columns, is_split, kernel_problem,
                                              plan_of, split_terms)
from kernels.matmul.mosaic_gpu.tiles import Shifts, Terms

__all__ = ["matmul", "Shifts", "Terms", "launch", "bfloat16_parts", "split_parts"]


def _kernel(*refs, p: Problem, plan: Plan, shifts: Shifts | None):
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


def bfloat16_parts(x: jax.Array) -> list[jax.Array]:
    """`x` as bfloat16 parts that sum to it (`config.split_terms`): itself where it is
    bfloat16, else hi and lo."""
    if x.dtype == jnp.bfloat16:
        return [x]
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    wide = hi.astype(jnp.float32)
    # Where hi is infinite (x is, or rounds past bfloat16's largest), lo is 0, not inf - inf.
    return [hi, jnp.where(jnp.isfinite(wide), x - wide, 0).astype(jnp.bfloat16)]


def split_parts(a: jax.Array, b: jax.Array, p: Problem, kernel: Problem, plan: Plan
                ) -> tuple[jax.Array, jax.Array, Terms]:
    """Blackwell's float32 and mixed products as bfloat16 ones (`config.split_terms`): each
    operand's parts (`bfloat16_parts`) laid side by side along K once, each padded to the
    plan's K slices of every split (one fused XLA pass an operand), and the `Terms` the
    kernel walks them by."""
    terms = Terms(split_terms(p), plan.splits * plan.k_blocks_per_split(kernel))
    k = terms.blocks * plan.block_k
    a_shape = (k, kernel.m) if p.transpose_a else (kernel.m, k)
    b_shape = (kernel.n, k) if p.transpose_b else (k, kernel.n)
    a = jnp.concatenate([pad_to(part, *a_shape) for part in bfloat16_parts(a)],
                        axis=-2 if p.transpose_a else -1)
    b = jnp.concatenate([pad_to(part, *b_shape) for part in bfloat16_parts(b)],
                        axis=-1 if p.transpose_b else -2)
    return a, b, terms


def _operands(a: jax.Array, b: jax.Array, p: Problem, plan: Plan
              ) -> tuple[jax.Array, jax.Array, Problem, Terms | None]:
    """The operands laid out as `kernel_problem(p)` takes them, that problem and its split
    parts' `Terms` (or None): on Hopper cast to float32 and copied K-major where the product
    runs as TF32 (one fused XLA pass), on Blackwell split into bfloat16 parts (`split_parts`);
    padded with zeros where M, K or N is odd (zeros along K add nothing; the caller cuts the
    output back)."""
    kernel = kernel_problem(p)
    if is_split(p):
        a, b, terms = split_parts(a, b, p, kernel, plan)
        return a, b, kernel, terms
    a = jnp.swapaxes(a, -1, -2) if kernel.transpose_a != p.transpose_a else a
    b = jnp.swapaxes(b, -1, -2) if kernel.transpose_b != p.transpose_b else b
    a, b = a.astype(kernel.a_dtype), b.astype(kernel.b_dtype)
    m, k, n = kernel.m, kernel.k, kernel.n
    a = pad_to(a, *((k, m) if kernel.transpose_a else (m, k)))
    b = pad_to(b, *((n, k) if kernel.transpose_b else (k, n)))
    return a, b, kernel, None


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` with `p.epilogue`, for a problem that `check` accepted (or the backward
    of one): out_batch + (M, N), and the pre-activation beside it where the epilogue saves it.
    16-bit products are exact in float32; float32 runs as TF32 on Hopper, as split bfloat16
    on Blackwell (`check` declines HIGHEST)."""
    del precision  # `p.highest`: declined by `check`
    products = len(split_terms(p)) if is_split(p) else 1  # the MMAs the split parts take
    flops, (m, n) = products * flops_and_bytes(p)[0], (p.m, p.n)
    plan = plan_of(p, config)
    a, b, p, terms = _operands(a, b, p, plan)
    a = a.reshape(math.prod(p.a_batch), *a.shape[-2:])
    b = b.reshape(math.prod(p.b_batch), *b.shape[-2:])
    # The epilogue's windows are swizzled in shared memory: TMA's tensor copy stores them, which
    # drops what falls past the rows (`stored_shape` needs no padding here).
    if residual is not None:
        residual = residual.reshape(p.num_batches, m, n)
    outs = launch(a, b, bias, residual, p, plan, flops, interpret, terms=terms)
    outs = jax.tree.map(lambda out: out[:, :m, :n], outs)
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, m, n), outs)


def launch(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, plan: Plan, flops: int, interpret: bool | str,
           shifts: Shifts | None = None, name: str = "matmul", terms: Terms | None = None
           ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel on operands laid out as `kernel_problem(p)` takes them (`p` is that problem):
    (num_batches, M, N) outputs, the epilogue applied (by XLA after the partials' sum where
    `plan` splits K). `bias` is (N,), or (num_batches, N) where each batch has its own
    (unsplit plans); at most N columns, zero-padded to whole tiles. float32 operands (TF32
    products) are rounded to TF32 here (`round_to_tf32`), in the XLA pass that lays them out
    where there is one: TMA feeds the MMA from shared memory, with no register stage where the
    kernel could round them, and the MMA would truncate them."""
    if interpret and jax.config.jax_enable_x64:
        raise NotImplementedError(
            "Mosaic GPU's interpreter (jax 0.12.0.1) fails MLIR verification on a "
            "warp-specialized pipeline under jax_enable_x64 (JAX's own Hopper matmul too); "
            "the compiled kernel is traced with 32-bit defaults and is unaffected")
    a, b = (round_to_tf32(x) if x.dtype == jnp.float32 else x for x in (a, b))
    shape = (p.num_batches, p.m, p.n)
    bias = None if bias is None else bias.reshape(-1, bias.shape[-1])
    if plan.splits > 1:  # float32 partials; the epilogue runs in XLA's reduction
        partials = p._replace(epilogue=_epilogue.Epilogue())
        out = _launch(a, b, [], partials, plan, jax.ShapeDtypeStruct(
            (plan.splits * p.num_batches, p.m, p.n), jnp.float32), flops, interpret,
            f"{name}_split_k_mosaic_gpu", shifts, terms)
        summed = out.reshape(plan.splits, *shape).sum(axis=0)
        if bias is not None:  # zeros past N, as the caller cuts the output back
            if bias.shape[0] > 1:
                raise AssertionError("a bias per batch is applied by unsplit plans only")
            bias = pad_to(bias[0], p.n)
        if residual is not None:
            residual = pad_to(residual, p.m, p.n)
        return _epilogue.apply_after_sum(summed, bias, residual, p.epilogue, p.out_dtype)
    if bias is not None:  # float32 whole tiles: the epilogue's vector loads stay in bounds
        bias = pad_to(bias.astype(jnp.float32), pl.cdiv(p.n, plan.block_n) * plan.block_n)
    if residual is not None:  # its values are the output dtype's (its dtype is in the
        # result's promotion; a broadcast one was widened for its gradient's sum only)
        residual = pad_to(residual.astype(p.out_dtype), p.m, p.n)
    return _launch(a, b, _epilogue.operands(bias, residual), p, plan,
                   _epilogue.out_shapes(shape, p.out_dtype, p.epilogue), flops, interpret,
                   f"{name}_mosaic_gpu", shifts, terms)


def _launch(a, b, epilogue_operands, p: Problem, plan: Plan, out_shape, flops: int,
            interpret: bool | str, name: str, shifts: Shifts | None, terms: Terms | None):
    shapes = jax.tree.leaves(out_shape)
    partial_bytes = 2 * math.prod(shapes[0].shape) * 4 if plan.splits > 1 else 0
    # Traced with 32-bit defaults: under x64, the warp-specialized pipeline's loops (jax
    # 0.12.0.1) would carry int64 steps beside its int32 indices.
    with jax.enable_x64(False):
        outs = _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret,
                     name, shifts, terms)
    return outs[0] if len(shapes) == 1 else tuple(outs)


def _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret, name,
          shifts, terms):
    if plan.mma == TCGEN05:
        body = functools.partial(blackwell.kernel, terms=terms)
        warpgroups = blackwell.WARPGROUPS
    elif terms is not None:
        raise AssertionError("split parts are Blackwell's (tcgen05 has no TF32 kind)")
    else:
        body, warpgroups = _kernel, CONSUMERS + 1
    # TMA loads each term's parts: the bytes of a product along a K that many times longer.
    loaded = p if terms is None else p._replace(k=len(terms.pairs) * p.k)
    return mosaic_gpu_call(
        functools.partial(body, p=p, plan=plan, shifts=shifts), out_shape=shapes,
        grid=(plan.num_ctas,), grid_names=("sm",), interpret=interpret, name=name,
        flops_and_bytes=(flops, moved_bytes(loaded, plan.block_m, plan.block_n,
                                            partial_bytes)),
        warpgroups=warpgroups)(a, b, *epilogue_operands)
