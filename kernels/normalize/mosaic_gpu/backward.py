"""normalize's backward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a).

Block schedule
--------------
On the forward's rows view and blocks (`forward.py`; `config.plan_of` with `backward=True`),
x (the sum, with a residual), dy and the sum's cotangent dsum move by TMA in pieces of `PIECE`
columns. Grid `(programs,)`; CTA q takes blocks q, q + programs, ... (`Plan.accumulate`), or
one block each. Per block, with x̂ = (x - mean) * rstd and gs = dy * scale:

    pass 1:  acc_gs += gs[k];  acc_gsx += gs[k] * x̂[k]                  # registers
    pass 2:  dx[k] = rstd * (gs - sum(acc_gs)/n - x̂ * sum(acc_gsx)/n) (+ dsum[k])
             dscale_terms[k] += dy[k] * x̂[k];  doffset_terms[k] += dy[k]

dx is written once through a 2-slot ring of pieces. The dscale/doffset terms are summed over
the CTA's blocks in shared memory (float32, (block_rows, width) each), then over the block's
rows (in registers: a piece's rows lie in one thread), and written at the end as the CTA's
partial row; where they do not fit (very long rows) each CTA writes its block's partial row. `programs` is then at most `Target.min_programs` (two waves of
the target's SMs), so the partial rows (`programs · block_rows` of the row's width, float32)
stay a small fraction of the traffic; XLA sums them (no float atomics: the same result on every
run). Resident blocks read x and dy from GMEM once: with dx written once, the backward's three
passes over the data (`common.backward_flops_and_bytes`). Streamed blocks read them twice.
The cotangents of the saved mean and 1/std (second order) are read per row when given.
"""

from __future__ import annotations

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
                                               padded_rows, params_view, rows_view)

__all__ = ["backward"]

_PARTIALS = ("dscale", "doffset")


def _block_gradient(refs: dict, io: StagedRows, writer: RowWriter, terms: dict, first,
                    p: Problem, plan: Plan) -> None:
    """dx of rows [first, first + block_rows), written; their dscale/doffset terms added to
    the shared-memory accumulators `terms` (or, where empty, written as partial rows)."""
    shape = (plan.block_rows, PIECE)
    layout = layout_of(plan)
    io.start(first)
    stat = {name: per_row(load(refs[name].at[pl.ds(first, plan.block_rows)]), shape)
            for name in ("mean", "rstd", "gmean", "grstd") if name in refs}

    def read(pass_index, piece):
        values = io.read(first, piece, pass_index * plan.num_pieces + piece,
                         2 * plan.num_pieces, layout)
        g = values["gy"]
        gs = g * per_column(load(refs["scale"].at[piece_columns(piece)]), shape) \
            if "scale" in refs else g
        return g, gs, common.normalized(values["x"], stat.get("mean"), stat["rstd"], p), values

    def sums(piece, accumulators):
        _, gs, xhat, _ = read(0, piece)
        return accumulators[0] + gs, accumulators[1] + gs * xhat

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)
    acc_gs, acc_gsx = fold(plan, sums, (zeros, zeros))
    group_sums = common.GroupSums(per_row(jnp.sum(acc_gs, axis=1), shape),
                                  per_row(jnp.sum(acc_gsx, axis=1), shape))

    def gradient(piece, carry):
        g, gs, xhat, values = read(1, piece)
        dx = common.input_gradient(gs, xhat, stat["rstd"], group_sums, stat.get("gmean"),
                                   stat.get("grstd"), p)
        if "gsum" in values:
            dx = dx + values["gsum"]
        for name, value in (("dscale", g * xhat), ("doffset", g)):
            if name in terms:
                accumulator = terms[name].at[piece]
                accumulator[...] = plgpu.load(accumulator, layout=layout) + value
            elif name in refs:  # this block's partial row
                _store_row(refs[name], first // plan.block_rows, piece, value)
        writer.write(first, piece, {"dx": dx})
        return carry

    fold(plan, gradient, 0)


def _store_row(partial, row, piece, value) -> None:
    """Piece `piece` of partial row `row`: the block's terms summed over its rows (in each
    thread's registers: the rows of a piece lie in one thread)."""
    if value.shape[0] == 1:  # stored as it lies (Mosaic GPU's layouts take no such reshape)
        store(partial.at[pl.ds(row, 1), piece_columns(piece)], value)
    else:
        store(partial.at[row, piece_columns(piece)], jnp.sum(value, axis=0))


def _store_terms(refs: dict, terms: dict, program, plan: Plan) -> None:
    """The CTA's summed terms, as its partial row."""
    layout = layout_of(plan)

    def row_piece(piece, carry):
        for name, accumulator in terms.items():
            _store_row(refs[name], program, piece,
                       plgpu.load(accumulator.at[piece], layout=layout))
        return carry

    fold(plan, row_piece, 0)


def _cost(p: Problem, plan: Plan, partial_rows: int, stat_cotangents: bool,
          sum_cotangent: bool) -> tuple[int, int]:
    """`common.backward_flops_and_bytes` for the partial rows written (of the pieces' width),
    with a streamed block's inputs read again in the second pass."""
    flops, nbytes = common.backward_flops_and_bytes(p, partial_rows * plan.width // plan.reduced,
                                                    stat_cotangents, sum_cotangent)
    if not plan.resident:  # x and dsum in x's dtype, dy in y's
        nbytes += p.size * (jnp.dtype(p.dtype).itemsize * (1 + sum_cotangent)
                            + p.y_dtype.itemsize)
    return flops, nbytes


def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool | str):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`. `x` is the
    normalized array (the forward's sum, with a residual); `gsum`, the sum's cotangent or
    None, is added to dx."""
    plan = plan_of(p, config, backward=True, has_gsum=gsum is not None)
    staged_inputs = {name: rows_view(a, p, plan) for name, a in
                     (("x", x), ("gy", gy), ("gsum", gsum)) if a is not None}
    inputs = dict(staged_inputs)
    inputs.update(params_view(scale, None, plan))
    per_row_inputs = {"mean": mean if p.subtract_mean else None, "rstd": rstd,
                      "gmean": gmean if p.subtract_mean else None, "grstd": grstd}
    inputs.update((name, padded_rows(v, plan)) for name, v in per_row_inputs.items()
                  if v is not None)
    partial_rows = plan.programs if plan.accumulate else plan.num_blocks
    outputs = {"dx": jax.ShapeDtypeStruct(output_matrix(plan), p.dtype)}
    for name, present in zip(_PARTIALS, (p.has_scale, p.has_offset)):
        if present:
            outputs[name] = jax.ShapeDtypeStruct((partial_rows, plan.width), jnp.float32)
    staged = {name: smem((plan.slots, plan.block_rows, PIECE), a.dtype)
              for name, a in staged_inputs.items()}
    written = ["dx"]
    rings = {name: smem((2, plan.block_rows, PIECE), outputs[name].dtype)
             for name in written}
    terms = {name: smem((plan.num_pieces, plan.block_rows, PIECE), jnp.float32)
             for name in _PARTIALS if name in outputs and plan.accumulate}
    scratch = [*staged.values(), *rings.values(), *terms.values(),
               plgpu.Barrier(num_arrivals=len(staged), num_barriers=plan.slots)]

    def body(*refs):
        names = [*inputs, *outputs]
        named = dict(zip(names, refs))
        buffers = dict(zip([*staged, *rings, *terms], refs[len(names):]))
        io = StagedRows({n: named[n] for n in staged}, {n: buffers[n] for n in staged}, refs[-1],
                        plan.block_rows, plan.num_pieces, plan.resident)
        writer = RowWriter({n: named[n] for n in written}, {n: buffers[n] for n in rings},
                           plan.block_rows)
        accumulators = {n: buffers[n] for n in terms}
        program = jax.lax.axis_index("programs")
        if not plan.accumulate:
            _block_gradient(named, io, writer, {}, program * plan.block_rows, p, plan)
            RowWriter.finish()
            return
        zeros = plgpu.layout_cast(jnp.zeros((plan.block_rows, PIECE), jnp.float32),
                                  layout_of(plan))

        def clear(piece, carry):
            for accumulator in accumulators.values():
                accumulator.at[piece][...] = zeros
            return carry

        def walk(i, carry):
            block = program + i * plan.programs
            RowWriter.start()
            _block_gradient(named, io, writer, accumulators, block * plan.block_rows, p, plan)
            return carry

        fold(plan, clear, 0)
        jax.lax.fori_loop(0, (plan.num_blocks - program + plan.programs - 1) // plan.programs,
                          walk, 0)
        _store_terms(named, accumulators, program, plan)
        RowWriter.finish()

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(plan.programs,), grid_names=("programs",),
        interpret=interpret, name="normalize_backward_mosaic_gpu", scratch=scratch,
        flops_and_bytes=_cost(p, plan, partial_rows, gmean is not None, gsum is not None))(
            *inputs.values())))
    return (from_rows_view(results["dx"], p, plan),
            *(jnp.sum(results[name][:, :plan.reduced], axis=0).reshape(p.param_shape)
              if name in results else None for name in _PARTIALS))
