"""normalize's forward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a).

Block schedule
--------------
The kernel works on the rows view: `rows` rows of `reduced` elements (the columns layout is
transposed to it first, `rows_view`). Grid `(num_blocks,)`, one CTA (one warpgroup) per block
of `block_rows` rows (`config.plan_of`). The block moves by TMA in pieces of `PIECE` columns
(`_pallas.mosaic_gpu.StagedRows`): a piece is a (block_rows, PIECE) tile in shared memory and,
in registers, 2 values a thread per row (the 4 warps along the piece). One CTA makes passes
over its pieces k:

    pass 1:  acc += x[k] (+ residual[k]; the sum written, rounded)     # RMS: acc += x[k]²
             m = sum(acc) / n                                          # RMS: rstd from acc
    pass 2:  d = where(column < n, x[k] - m, 0);  acc_d += d;  acc += d²
             mean = m + sum(acc_d) / n;  rstd = rsqrt(sum(acc) / n - (mean - m)² + epsilon)
    pass 3:  y[k] = (x[k] - mean) * rstd * scale[k] + offset[k]       # TMA store, per piece

(RMS norm makes passes 1 and 3.) Each pass carries (block_rows, PIECE) float32 accumulators in
registers and reduces them across the warps once. Pass 2 corrects pass 1's mean, whose sums of
large values round (a mean of 1e4 with a unit spread), by the mean deviation from it, whose
terms are small (the shifted two-pass algorithm): y is then closer to float64 than XLA's.
Resident blocks (`Plan.resident`, those within the plan's shared memory budget) are read from
GMEM once, the first pass computing on the first pieces while the others land; longer rows
stream their pieces again in each pass (x read 2-3 times, mostly from L2). y (and the sum) are
written once through a 2-slot ring of pieces; mean and 1/std per row (float32); the launch's
cost estimate states those bytes (`_cost`). TMA zero-fills the columns past the row and the
rows past the array, and drops their stores, so no shape needs a padding copy unless a row is
not a multiple of 16 bytes (`Plan.aligned`: then x is padded in the wrapper, one more copy).

Against the GPU: a CTA plans at most half an SM's shared memory, so two to four run on an SM
(`Plan.ctas_per_sm`), each with its whole block's copies in flight as it starts
(`Plan.in_flight_per_sm`); a resident plan moves the op's minimum bytes
(`common.minimum_bytes`), so its expected time is those bytes over `Target.streaming_seconds`.
tests/test_normalize_mosaic_gpu.py holds the bench's bfloat16 shapes to 32 KiB or more in
flight an SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, RowWriter, StagedRows, load, mosaic_gpu_call,
                                        per_column, per_row, piece_columns, smem, store)
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_gpu.config import Plan, plan_of
from kernels.normalize.mosaic_gpu.rows import (fold, from_rows_view, layout_of, output_matrix,
                                               params_view, rows_view)

__all__ = ["forward"]


def _normalize_block(refs: dict, io: StagedRows, sums: RowWriter | None, ys: RowWriter,
                     first, p: Problem, plan: Plan) -> None:
    """Rows [first, first + block_rows): the body of one CTA."""
    shape = (plan.block_rows, PIECE)
    layout = layout_of(plan)
    passes = 2 + p.subtract_mean
    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)
    io.start(first)

    def read(pass_index, piece):
        values = io.read(first, piece, pass_index * plan.num_pieces + piece,
                         passes * plan.num_pieces, layout)
        return values["x"] + values["residual"] if "residual" in values else values["x"]

    def total(acc):
        return jnp.sum(acc, axis=1)

    def first_pass(piece, acc):
        x = read(0, piece)
        if sums is not None:
            sums.write(first, piece, {"sum": x})
        return acc + (x if p.subtract_mean else x * x)

    first_mean = total(fold(plan, first_pass, zeros)) / plan.reduced  # RMS: the mean square
    variance = first_mean
    if p.subtract_mean:
        guess = per_row(first_mean, shape)

        def deviations(piece, accumulators):
            deviation = read(1, piece) - guess
            if plan.width != plan.reduced:  # the zeros past the row are -mean off it
                column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
                deviation = jnp.where(column + piece * PIECE < plan.reduced, deviation, 0.0)
            return accumulators[0] + deviation, accumulators[1] + deviation * deviation

        # The first pass's mean, rounded in sums of large values, is corrected by the mean
        # deviation from it, summed from small ones (the shifted two-pass algorithm).
        acc_deviation, acc = fold(plan, deviations, (zeros, zeros))
        correction = total(acc_deviation) / plan.reduced
        row_mean = first_mean + correction
        store(refs["mean"].at[pl.ds(first, plan.block_rows)], row_mean)
        mean = per_row(row_mean, shape)
        # Rounding can take a constant row's variance below 0 (NaN with epsilon = 0).
        variance = jnp.maximum(total(acc) / plan.reduced - correction * correction, 0.0)
    rstd = jax.lax.rsqrt(variance + p.epsilon)
    store(refs["rstd"].at[pl.ds(first, plan.block_rows)], rstd)
    rstd = per_row(rstd, shape)

    def normalize(piece, carry):
        x = read(passes - 1, piece)
        y = (x - mean if p.subtract_mean else x) * rstd
        for name, op in (("scale", jnp.multiply), ("offset", jnp.add)):
            if name in refs:
                y = op(y, per_column(load(refs[name].at[piece_columns(piece)]), shape))
        ys.write(first, piece, {"y": y})
        return carry

    fold(plan, normalize, 0)
    RowWriter.finish()


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
    per_block_row = jax.ShapeDtypeStruct((plan.num_blocks * plan.block_rows,), jnp.float32)
    if p.subtract_mean:
        outputs["mean"] = per_block_row
    outputs["rstd"] = per_block_row
    slots = plan.num_pieces if plan.resident else 2  # the block's pieces, or a 2-piece ring
    staged = {name: smem((slots, plan.block_rows, PIECE), a.dtype)
              for name, a in inputs.items()}
    rings = {name: smem((2, plan.block_rows, PIECE), outputs[name].dtype)
             for name in ("y", "sum") if name in outputs}
    scratch = [*staged.values(), *rings.values(),
               plgpu.Barrier(num_arrivals=len(inputs), num_barriers=slots)]

    def body(*refs):
        names = [*inputs, *params, *outputs]
        named = dict(zip(names, refs))
        buffers = dict(zip([*staged, *rings], refs[len(names):]))
        io = StagedRows({n: named[n] for n in inputs}, {n: buffers[n] for n in staged},
                        refs[-1], plan.block_rows, plan.num_pieces, plan.resident)
        sums = (RowWriter({"sum": named["sum"]}, {"sum": buffers["sum"]}, plan.block_rows)
                if "sum" in outputs else None)
        ys = RowWriter({"y": named["y"]}, {"y": buffers["y"]}, plan.block_rows)
        first = jax.lax.axis_index("blocks") * plan.block_rows
        _normalize_block(named, io, sums, ys, first, p, plan)

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(plan.num_blocks,), grid_names=("blocks",),
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
    after the first."""
    flops, nbytes = common.forward_flops_and_bytes(p)
    if not plan.resident:
        passes = 2 + p.subtract_mean
        nbytes += (passes - 1) * p.size * jnp.dtype(p.dtype).itemsize * (1 + p.has_residual)
    return flops, nbytes


def _stats(a: jax.Array, p: Problem, plan: Plan) -> jax.Array:
    return a[:plan.rows].reshape(p.stats_shape)
