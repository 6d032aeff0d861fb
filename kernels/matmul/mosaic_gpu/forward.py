"""Matmul as a persistent, warp-specialized Pallas kernel lowered through Mosaic GPU (Hopper
sm_90a; the package's docstring has the loop nest).

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

Shifted rows (`Shifts`, conv2d's implicit GEMM, `kernels.conv2d.mosaic_gpu`): A is not a
matrix of the product's rows but windows of one, read at a row offset per K step (the forward:
tap row kh of K step k) or per output batch (the weight gradient: one tap row per batch). Each
offset is a multiple of TMA's 8-row tile, so a window is whole tiles of the shared-memory
layout, as TMA copies them (an offset within a tile would read zeros past the tile's rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import mosaic_gpu_call, pad_to
from kernels.matmul.common import (MatmulConfig, Problem, batch_index, flops_and_bytes,
                                   moved_bytes)
from kernels.matmul.mosaic_gpu.config import (CONSUMERS, EPILOGUE_COLUMNS, PRODUCER_REGISTERS,
                                              Plan, kernel_problem, plan_of)

__all__ = ["matmul", "Shifts", "launch"]


class Shifts(NamedTuple):
    """A's rows read at offsets (a multiple of `config.TMA_ROWS` each, a Python or traced
    int32 from `shift`): per K step (`per_step`, the forward of conv2d: K step k reads the rows
    of its output tile shifted by `shift(k // steps_per_shift)`, its columns block
    k % steps_per_shift of the view) or per output batch (the weight gradient: batch b's A is
    the matrix starting `shift(b)` rows down). `max_shift`: the largest, which the caller's
    array holds past the last tile.

    Rows past M (the forward) or K (the weight gradient) are then the matrix's next rows, not
    TMA's zeros: the caller cuts the output rows past M off, and its B is zero past K (so an
    Inf or NaN in those rows of A would make NaN there). Per-step shifts take one K split and
    A as stored (M, K)."""

    shift: Callable[[jax.Array], jax.Array]
    max_shift: int
    per_step: bool
    steps_per_shift: int = 1


def _transforms(shape: tuple[int, int], dtype) -> tuple:
    """TMA's tiling and swizzle of a shared-memory tile, by the bytes of its minor dim."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _operand_spec(block: tuple[int, int], k_axis: int, dtype) -> plgpu.BlockSpec:
    """The pipeline's tile of an operand view: K step k is block k along `k_axis`."""
    index = (lambda k: (k, 0)) if k_axis == 0 else (lambda k: (0, k))
    return plgpu.BlockSpec(block, index, transforms=_transforms(block, dtype))


def _shifted_spec(block: tuple[int, int], shifts: Shifts, dtype) -> plgpu.BlockSpec:
    """K step k's tile of A's rows shifted as `shifts` says: rows at an element offset."""
    def index(k):
        return shifts.shift(k // shifts.steps_per_shift), k % shifts.steps_per_shift

    return plgpu.BlockSpec((pl.Element(block[0]), block[1]), index,
                           transforms=_transforms(block, dtype))


def _epilogue_slice(acc, column: int, ctx: dict, p: Problem) -> None:
    """Bias, activation and residual on columns [column, column + width) of a consumer's
    accumulator, written through shared memory by TMA (and z beside it where saved)."""
    width = ctx["out_smem"].shape[-1]
    wg, rows = ctx["wg"], ctx["rows"]
    cols = pl.ds(ctx["n_start"] + column, width)
    values = acc[:, column:column + width]
    bias = residual = None
    if ctx["bias"] is not None:  # padded to whole tiles by the wrapper
        bias_row = ctx["batch"] if ctx["bias"].shape[0] > 1 else 0  # per batch, or shared
        vector = plgpu.load(ctx["bias"].at[bias_row, cols],
                            layout=plgpu.Layout.WGMMA.reduce(0))
        bias = lax.broadcast_in_dim(vector.astype(jnp.float32), values.shape, [1])
    if ctx["residual"] is not None:
        plgpu.commit_smem()  # every thread has read the previous slice: the slot may refill
        plgpu.copy_gmem_to_smem(ctx["residual"].at[ctx["batch"], rows, cols],
                                ctx["res_smem"].at[wg], ctx["barrier"].at[wg])
        plgpu.barrier_wait(ctx["barrier"].at[wg])
        residual = plgpu.load(ctx["res_smem"].at[wg], layout=plgpu.Layout.WGMMA)
    y, z = _epilogue.on_accumulator(values, bias, residual, p.epilogue)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slice's stores have read
    outputs = [(ctx["out_smem"], ctx["out"], y)]
    if ctx["z"] is not None:
        outputs.append((ctx["z_smem"], ctx["z"], z))
    for smem, _, value in outputs:
        smem[wg] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for smem, gmem, _ in outputs:
        plgpu.copy_smem_to_gmem(smem.at[wg], gmem.at[ctx["out_index"], rows, cols])


def _kernel(*refs, p: Problem, plan: Plan, shifts: Shifts | None):
    (a_gmem, b_gmem), bias, residual, out_gmem, z_gmem = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n, block_k = plan.block_m, plan.block_n, plan.block_k
    consumer_rows = block_m // CONSUMERS
    m_tiles, n_tiles = pl.cdiv(p.m, block_m), pl.cdiv(p.n, block_n)
    per_split = plan.k_blocks_per_split(p)
    a_block = (block_k, block_m) if p.transpose_a else (block_m, block_k)
    b_block = (block_n, block_k) if p.transpose_b else (block_k, block_n)

    if shifts is not None and shifts.per_step:
        if plan.splits != 1 or p.transpose_a:
            raise AssertionError("per-step shifts take one K split of A as stored (M, K)")
        a_spec = _shifted_spec(a_block, shifts, a_gmem.dtype)
    else:
        a_spec = _operand_spec(a_block, 0 if p.transpose_a else 1, a_gmem.dtype)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(per_split,), memory_registers=PRODUCER_REGISTERS,
            in_specs=[a_spec, _operand_spec(b_block, 1 if p.transpose_b else 0, b_gmem.dtype)],
            wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=plan.stages,
            compute_context=context)

    width = min(EPILOGUE_COLUMNS, block_n)
    slot = (CONSUMERS, consumer_rows, width)
    scratch = dict(
        allocations=pipeline(lambda *_, **__: None, lambda *_, **__: None).get_allocations(
            a_gmem.at[0], b_gmem.at[0]),
        out_smem=plgpu.SMEM(slot, out_gmem.dtype, transforms=_transforms(slot, out_gmem.dtype)))
    if z_gmem is not None:
        scratch["z_smem"] = plgpu.SMEM(slot, z_gmem.dtype,
                                       transforms=_transforms(slot, z_gmem.dtype))
    if residual is not None:
        scratch["res_smem"] = plgpu.SMEM(slot, residual.dtype,
                                         transforms=_transforms(slot, residual.dtype))
        scratch["barrier"] = plgpu.Barrier(num_barriers=CONSUMERS)

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(allocations, out_smem, z_smem=None, res_smem=None, barrier=None):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((jnp.int32(plan.tiles(p) * plan.splits),), collective_axes="sm")
        def _item(info):
            (index,) = info.index
            out_index, tile = index // (m_tiles * n_tiles), index % (m_tiles * n_tiles)
            split, batch = out_index // p.num_batches, out_index % p.num_batches
            m_tile, n_tile = plgpu.planar_snake(tile, (m_tiles, n_tiles), 0,
                                                min(plan.group, m_tiles))
            rows, cols = pl.ds(m_tile * block_m, block_m), pl.ds(n_tile * block_n, block_n)
            ks = pl.ds(split * per_split * block_k, per_split * block_k)
            a = a_gmem.at[batch_index(batch, p.out_batch, p.a_batch)]
            b = b_gmem.at[batch_index(batch, p.out_batch, p.b_batch)]
            if shifts is not None and shifts.per_step:  # the tile's rows and the shifts'
                a = a.at[pl.ds(m_tile * block_m, block_m + shifts.max_shift)]
            else:
                if shifts is not None:  # this batch's matrix
                    a = a.at[pl.ds(shifts.shift(batch),
                                   a.shape[0] - shifts.max_shift)]
                a = a.at[ks, rows] if p.transpose_a else a.at[rows, ks]
            b = b.at[cols, ks] if p.transpose_b else b.at[ks, cols]

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
                    ctx = dict(wg=wg, batch=batch, out_index=out_index,
                               rows=pl.ds(m_tile * block_m + wg * consumer_rows, consumer_rows),
                               n_start=n_tile * block_n, bias=bias, residual=residual,
                               out=out_gmem, z=z_gmem, out_smem=out_smem, z_smem=z_smem,
                               res_smem=res_smem, barrier=barrier)
                    for column in range(0, block_n, width):
                        _epilogue_slice(acc, column, ctx, p)

            pipeline(mma, context)(a, b, allocations=allocations)

        plgpu.wait_smem_to_gmem(0)


def _operands(a: jax.Array, b: jax.Array, p: Problem) -> tuple[jax.Array, jax.Array, Problem]:
    """The operands laid out as `kernel_problem(p)` takes them, and that problem: cast to
    float32 and copied K-major where the product runs as TF32 (one fused XLA pass), padded
    with zeros where M, K or N is odd (zeros along K add nothing; the caller cuts the output
    back)."""
    kernel = kernel_problem(p)
    a = jnp.swapaxes(a, -1, -2) if kernel.transpose_a != p.transpose_a else a
    b = jnp.swapaxes(b, -1, -2) if kernel.transpose_b != p.transpose_b else b
    a, b = a.astype(kernel.a_dtype), b.astype(kernel.b_dtype)
    m, k, n = kernel.m, kernel.k, kernel.n
    a = pad_to(a, *((k, m) if kernel.transpose_a else (m, k)))
    b = pad_to(b, *((n, k) if kernel.transpose_b else (k, n)))
    return a, b, kernel


def matmul(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, *, config: MatmulConfig | None, precision,
           interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` with `p.epilogue`, for a problem that `check` accepted (or the backward
    of one): out_batch + (M, N), and the pre-activation beside it where the epilogue saves it.
    16-bit products are exact in float32; float32 runs as TF32 (`check` declines HIGHEST)."""
    del precision  # `p.highest`: declined by `check`
    flops, (m, n) = flops_and_bytes(p)[0], (p.m, p.n)
    a, b, p = _operands(a, b, p)
    plan = plan_of(p, config)
    a = a.reshape(math.prod(p.a_batch), *a.shape[-2:])
    b = b.reshape(math.prod(p.b_batch), *b.shape[-2:])
    # The epilogue's windows are swizzled in shared memory: TMA's tensor copy stores them, which
    # drops what falls past the rows (`stored_shape` needs no padding here).
    if residual is not None:
        residual = residual.reshape(p.num_batches, m, n)
    outs = launch(a, b, bias, residual, p, plan, flops, interpret)
    outs = jax.tree.map(lambda out: out[:, :m, :n], outs)
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, m, n), outs)


def launch(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, plan: Plan, flops: int, interpret: bool | str,
           shifts: Shifts | None = None, name: str = "matmul"
           ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel on operands laid out as `kernel_problem(p)` takes them (`p` is that problem):
    (num_batches, M, N) outputs, the epilogue applied (by XLA after the partials' sum where
    `plan` splits K). `bias` is (N,), or (num_batches, N) where each batch has its own
    (unsplit plans); at most N columns, zero-padded to whole tiles."""
    if interpret and jax.config.jax_enable_x64:
        raise NotImplementedError(
            "Mosaic GPU's interpreter (jax 0.12.0.1) fails MLIR verification on a "
            "warp-specialized pipeline under jax_enable_x64 (JAX's own Hopper matmul too); "
            "the compiled kernel is traced with 32-bit defaults and is unaffected")
    shape = (p.num_batches, p.m, p.n)
    bias = None if bias is None else bias.reshape(-1, bias.shape[-1])
    if plan.splits > 1:  # float32 partials; the epilogue runs in XLA's reduction
        partials = p._replace(epilogue=_epilogue.Epilogue())
        out = _launch(a, b, [], partials, plan, jax.ShapeDtypeStruct(
            (plan.splits * p.num_batches, p.m, p.n), jnp.float32), flops, interpret,
            f"{name}_split_k_mosaic_gpu", shifts)
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
                   f"{name}_mosaic_gpu", shifts)


def _launch(a, b, epilogue_operands, p: Problem, plan: Plan, out_shape, flops: int,
            interpret: bool | str, name: str, shifts: Shifts | None):
    shapes = jax.tree.leaves(out_shape)
    partial_bytes = 2 * math.prod(shapes[0].shape) * 4 if plan.splits > 1 else 0
    # Traced with 32-bit defaults: under x64, the warp-specialized pipeline's loops (jax
    # 0.12.0.1) would carry int64 steps beside its int32 indices.
    with jax.enable_x64(False):
        outs = _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret,
                     name, shifts)
    return outs[0] if len(shapes) == 1 else tuple(outs)


def _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret, name,
          shifts):
    return mosaic_gpu_call(
        functools.partial(_kernel, p=p, plan=plan, shifts=shifts), out_shape=shapes,
        grid=(plan.num_ctas,), grid_names=("sm",), interpret=interpret, name=name,
        flops_and_bytes=(flops, moved_bytes(p, plan.block_m, plan.block_n, partial_bytes)),
        warpgroups=CONSUMERS + 1)(a, b, *epilogue_operands)
