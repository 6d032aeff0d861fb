"""normalize's forward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a).

Block schedule
--------------
The kernel works on the rows view: `rows` rows of `reduced` elements (the columns layout is
transposed to it first, `rows_view`), in blocks of `block_rows` rows (`config.plan_of`) that
move by TMA in pieces of `PIECE` columns: a piece is a (block_rows, PIECE) tile in shared
memory and, in registers, 2 values a thread per row (the 4 warps along the piece). Grid
`(programs,)`, one CTA (one warpgroup) per SM: CTA q walks blocks q, q + programs, ... With x
the sum x + residual where there is one, per block:

    start the next block's copies into the other buffer; wait for this block's   # BlockBuffers
    pass 1:  acc += x[k]                                              # RMS: acc += x[k]²
             m = sum(acc) / n                                         # RMS: rstd from acc
    pass 2:  d = where(column < n, x[k] - m, 0);  acc_d += d;  acc += d²
             mean = m + sum(acc_d) / n;  rstd = rsqrt(sum(acc) / n - (mean - m)² + epsilon)
    pass 3:  y[k] = (x[k] - mean) * rstd * scale[k] + offset[k]       # staged, with the sum
    store the block's y (and sum) (one TMA copy per piece)            # BlockWriter

(RMS norm makes passes 1 and 3.) Each pass carries (block_rows, PIECE) float32 accumulators in
registers and reduces them across the warps once. Pass 2 corrects pass 1's mean, whose sums of
large values round (a mean of 1e4 with a unit spread), by the mean deviation from it, whose
terms are small (the shifted two-pass algorithm): y is then closer to float64 than XLA's.
A resident plan (`Plan.resident`) holds two whole blocks of the inputs (x and the residual
each, one barrier a block) in shared memory: the next block's copies, about
`config._IN_FLIGHT_BYTES` (less where `_MAX_BLOCK_ROWS` caps a block of short rows), are in
flight while the CTA computes on this one, and its passes wait once per block. Its outputs
are staged whole and scale/offset staged once per CTA where they fit (`Plan.staged`), else
the outputs leave through 2-slot rings of pieces and scale/offset are read from GMEM per
block. Rows too long for two blocks are streamed: one block per CTA, two CTAs an SM, its
pieces read again in each pass (x read 2-3 times, mostly from L2). mean and 1/std are
written per row (float32); the launch's cost estimate states the bytes (`_cost`). TMA
zero-fills the columns past the row and the rows past the array, and drops their stores, so
no shape needs a padding copy unless a row is not a multiple of 16 bytes (`Plan.aligned`:
then x is padded in the wrapper, one more copy).

Against the GPU: a resident plan runs one CTA an SM (`Plan.ctas_per_sm`), its next block in
flight (`Plan.in_flight_per_sm`); a resident, staged plan moves the op's minimum bytes
(`common.minimum_bytes`), so its expected time is those bytes over `Target.streaming_seconds`.
tests/test_normalize_mosaic_gpu.py holds the bench's bfloat16 shapes to 32 KiB or more in
flight an SM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, RowWriter, mosaic_gpu_call, per_column, per_row,
                                        smem, store)
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_gpu.config import Plan, plan_of
from kernels.normalize.mosaic_gpu.rows import (fold, from_rows_view, input_buffers, layout_of,
                                               output_buffers, output_matrix, output_writer,
                                               param_piece, params_view, reread_bytes,
                                               rows_view, stage_rows, walk_blocks)

__all__ = ["forward"]


def _normalize_block(read: Callable, writer: RowWriter, params: dict, stats: dict, first,
                     p: Problem, plan: Plan) -> None:
    """Rows [first, first + block_rows): `read(pass, piece)` gives their inputs' pieces;
    `params`: scale/offset as (num_pieces, PIECE) rows; `stats`: the GMEM mean/rstd."""
    shape = (plan.block_rows, PIECE)
    layout = layout_of(plan)
    passes = 2 + p.subtract_mean
    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)

    def summed(pass_index, piece):
        values = read(pass_index, piece)
        return values["x"] + values["residual"] if "residual" in values else values["x"]

    def total(acc):
        return jnp.sum(acc, axis=1)

    def first_pass(piece, acc):
        x = summed(0, piece)
        return acc + (x if p.subtract_mean else x * x)

    first_mean = total(fold(plan, first_pass, zeros)) / plan.reduced  # RMS: the mean square
    variance = first_mean
    rows = pl.ds(first, plan.block_rows)
    if p.subtract_mean:
        guess = per_row(first_mean, shape)

        def deviations(piece, accumulators):
            deviation = summed(1, piece) - guess
            if plan.width != plan.reduced:  # the zeros past the row are -mean off it
                column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
                deviation = jnp.where(column + piece * PIECE < plan.reduced, deviation, 0.0)
            return accumulators[0] + deviation, accumulators[1] + deviation * deviation

        # The first pass's mean, rounded in sums of large values, is corrected by the mean
        # deviation from it, summed from small ones (the shifted two-pass algorithm).
        acc_deviation, acc = fold(plan, deviations, (zeros, zeros))
        correction = total(acc_deviation) / plan.reduced
        row_mean = first_mean + correction
        store(stats["mean"].at[rows], row_mean)
        mean = per_row(row_mean, shape)
        # Rounding can take a constant row's variance below 0 (NaN with epsilon = 0).
        variance = jnp.maximum(total(acc) / plan.reduced - correction * correction, 0.0)
    rstd = jax.lax.rsqrt(variance + p.epsilon)
    store(stats["rstd"].at[rows], rstd)
    rstd = per_row(rstd, shape)

    def normalize(piece, carry):
        x = summed(passes - 1, piece)
        y = (x - mean if p.subtract_mean else x) * rstd
        for name, op in (("scale", jnp.multiply), ("offset", jnp.add)):
            if name in params:
                y = op(y, per_column(param_piece(params[name], piece, layout), shape))
        writer.write(first, piece, {"y": y, "sum": x} if p.has_residual else {"y": y})
        return carry

    writer.start()
    fold(plan, normalize, 0)
    writer.flush(first)


def forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
            offset: jax.Array | None, p: Problem, *, config: NormalizeConfig | None,
            interpret: bool | str):
    """(y, x + residual or None, mean, rstd) for the view-shaped `x` (and `residual`) of a
    problem that `check` accepted."""
    plan = plan_of(p, config)
    inputs = {"x": rows_view(x, p, plan)}
    if residual is not None:
        inputs["residual"] = rows_view(residual, p, plan)
    params = params_view(scale, offset, plan)
    matrix = output_matrix(plan)
    outputs = {"y": jax.ShapeDtypeStruct(matrix, p.y_dtype)}
    if residual is not None:
        outputs["sum"] = jax.ShapeDtypeStruct(matrix, p.dtype)
    written = list(outputs)
    per_block_row = jax.ShapeDtypeStruct((plan.num_blocks * plan.block_rows,), jnp.float32)
    if p.subtract_mean:
        outputs["mean"] = per_block_row
    outputs["rstd"] = per_block_row
    staged, input_barriers = input_buffers(plan, inputs)
    buffers = output_buffers(plan, {n: outputs[n].dtype for n in written}, plan.staged)
    if plan.staged:
        buffers.update((name, smem((plan.num_pieces, PIECE), jnp.float32)) for name in params)
    scratch = [*staged.values(), *buffers.values(), input_barriers]
    stage_params = plan.staged and params
    if stage_params:
        scratch.append(plgpu.Barrier(num_arrivals=len(params)))

    def body(*refs):
        names = [*inputs, *params, *outputs]
        named = dict(zip(names, refs))
        scratch_refs = dict(zip([*staged, *buffers], refs[len(names):]))
        barriers = refs[len(names) + len(staged) + len(buffers)]
        param_refs, ready = {n: named[n] for n in params}, None
        if stage_params:  # once a CTA, every block reads them from shared memory
            param_refs, ready = stage_rows(param_refs, scratch_refs, refs[-1])
        writer = output_writer(plan, {n: named[n] for n in written},
                               {n: scratch_refs[n] for n in written}, plan.staged)
        stats = {n: named[n] for n in ("mean", "rstd") if n in named}

        def compute(first, read, carry):
            _normalize_block(read, writer, param_refs, stats, first, p, plan)

        walk_blocks(plan, {n: named[n] for n in inputs}, {n: scratch_refs[n] for n in inputs},
                    barriers, 2 + p.subtract_mean, compute, ready=ready)
        RowWriter.finish()

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(plan.programs,), grid_names=("programs",),
        interpret=interpret, name="normalize_forward_mosaic_gpu", scratch=scratch,
        auto_barriers=False,
        flops_and_bytes=_cost(p, plan), transcendentals=plan.rows)(
            *inputs.values(), *params.values())))
    stats = functools.partial(_stats, p=p, plan=plan)
    mean = results.get("mean")
    summed = results.get("sum")
    return (from_rows_view(results["y"], p, plan),
            None if summed is None else from_rows_view(summed, p, plan),
            stats(mean) if mean is not None else jnp.zeros(p.stats_shape, jnp.float32),
            stats(results["rstd"]))


def _cost(p: Problem, plan: Plan) -> tuple[int, int]:
    """`common.forward_flops_and_bytes`, with a streamed block's inputs read again in each pass
    after the first, and scale/offset read again for each block where they are not staged."""
    flops, nbytes = common.forward_flops_and_bytes(p)
    if not plan.staged:
        nbytes += (plan.num_blocks - 1) * plan.width * 4 * (p.has_scale + p.has_offset)
    nbytes += reread_bytes(p, plan, 2 + p.subtract_mean,
                           jnp.dtype(p.dtype).itemsize * (1 + p.has_residual))
    return flops, nbytes


def _stats(a: jax.Array, p: Problem, plan: Plan) -> jax.Array:
    return a[:plan.rows].reshape(p.stats_shape)
