"""normalize's backward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a).

Block schedule
--------------
On the forward's rows view, in blocks of `block_rows` rows (`config.plan_of` with
`backward=True`), x (the sum, with a residual), dy and the sum's cotangent dsum move by TMA in
pieces of `PIECE` columns. Grid `(programs,)`, one CTA (one warpgroup) per SM: CTA q walks
blocks q, q + programs, ... With x̂ = (x - mean) * rstd and gs = dy * scale, per block:

    start the next block's copies into the other buffer; wait for this block's   # BlockBuffers
    pass 1:  acc_gs += gs[k];  acc_gsx += gs[k] * x̂[k]                            # registers
    pass 2:  dx[k] = rstd * (gs - sum(acc_gs)/n - x̂ * sum(acc_gsx)/n) (+ dsum[k])  # staged
             dscale_terms[k] += sum over rows(dy[k] * x̂[k]);  doffset_terms[k] += sum(dy[k])
    store the block's dx (one TMA copy per piece)                                  # BlockWriter

A resident plan holds two whole blocks of the inputs, dx's block, scale (staged once) and the
two summed term rows (float32, the row's width each) in shared memory: the next block's copies,
about `config._IN_FLIGHT_BYTES`, are in flight while the CTA computes on this one, and its
passes wait once per block. Each loop step computes `Plan.unroll` pieces. At the end the CTA writes
its terms as one partial row (one TMA copy), and XLA sums the `programs` rows (no float atomics:
the same result on every run), so x and dy are read from GMEM once and dx written once
(`common.backward_flops_and_bytes`), plus one float32 row per SM and term. Rows too long for two
blocks stream their pieces through 2-slot rings, read again in the second pass; where even the
summed terms do not fit, each block writes its own partial row. The cotangents of the saved
mean and 1/std (second order) are read per row when given.

Against the GPU: one CTA an SM (`Plan.ctas_per_sm`), its next block in flight
(`Plan.in_flight_per_sm`: 32 KiB or more at the bench's bfloat16 shapes); it moves its minimum
bytes plus one float32 row per SM and term (`_cost`: within 5% of the minimum there), so its
expected time is those bytes over `Target.streaming_seconds`, with the pass loops' instructions
under that time (the estimate beside `config._STEP_ROWS`). tests/test_normalize_mosaic_gpu.py
holds those bounds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, RowWriter, load, mosaic_gpu_call, per_column,
                                        per_row, smem, store)
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_gpu.config import Plan, plan_of
from kernels.normalize.mosaic_gpu.rows import (fold, from_rows_view, input_buffers, layout_of,
                                               output_buffers, output_matrix, output_writer,
                                               padded_rows, param_piece, params_view,
                                               reread_bytes, rows_view, stage_rows,
                                               walk_blocks)

__all__ = ["backward"]

_PARTIALS = ("dscale", "doffset")
_STATS = ("mean", "rstd", "gmean", "grstd")


def _block_gradient(refs: dict, read: Callable, writer: RowWriter, scale, terms: dict,
                    stats: dict, first, p: Problem, plan: Plan) -> None:
    """dx of rows [first, first + block_rows) (`read(pass, piece)`: their inputs' pieces;
    `stats`: their per-row statistics; `scale`: the (num_pieces, PIECE) row, staged or in
    GMEM, or None), written through `writer`; their dscale/doffset terms summed over the rows
    into the shared-memory rows `terms` (or, where empty, written as the block's partial
    rows)."""
    shape = (plan.block_rows, PIECE)
    layout = layout_of(plan)
    stat = {name: per_row(value, shape) for name, value in stats.items()}

    def inputs(pass_index, piece):
        values = read(pass_index, piece)
        g = values["gy"]
        gs = g if scale is None else g * per_column(param_piece(scale, piece, layout), shape)
        return g, gs, common.normalized(values["x"], stat.get("mean"), stat["rstd"], p), values

    def sums(piece, accumulators):
        _, gs, xhat, _ = inputs(0, piece)
        return accumulators[0] + gs, accumulators[1] + gs * xhat

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)
    acc_gs, acc_gsx = fold(plan, sums, (zeros, zeros))
    group_sums = common.GroupSums(per_row(jnp.sum(acc_gs, axis=1), shape),
                                  per_row(jnp.sum(acc_gsx, axis=1), shape))

    def gradient(piece, carry):
        g, gs, xhat, values = inputs(1, piece)
        dx = common.input_gradient(gs, xhat, stat["rstd"], group_sums, stat.get("gmean"),
                                   stat.get("grstd"), p)
        if "gsum" in values:
            dx = dx + values["gsum"]
        for name, value in (("dscale", g * xhat), ("doffset", g)):
            if name in terms:
                _add_to_row(terms[name], piece, value, layout)
            elif name in refs:  # this block's partial row
                _store_row(refs[name], first // plan.block_rows, piece, value, layout)
        writer.write(first, piece, {"dx": dx})
        return carry

    writer.start()
    fold(plan, gradient, 0)
    writer.flush(first)


def _over_rows(row, piece, value: jax.Array, layout) -> tuple:
    """(ref, summed, its layout): piece `piece` of the (num_pieces, PIECE) row `row`, and the
    block's piece `value` summed over its rows (in each thread's registers: a piece's rows lie
    in one thread), shaped alike; a one-row block's piece as it lies (Mosaic GPU's layouts take
    no such reshape)."""
    if value.shape[0] == 1:
        return row.at[pl.ds(piece, 1)], value, layout
    return row.at[piece], jnp.sum(value, axis=0), layout.reduce(0)


def _add_to_row(row, piece, value: jax.Array, layout) -> None:
    """Adds a block's piece, summed over its rows, to the shared-memory row `row`."""
    target, summed, summed_layout = _over_rows(row, piece, value, layout)
    target[...] = plgpu.load(target, layout=summed_layout, optimized=False) + summed


def _store_row(partial, row, piece, value, layout) -> None:
    """Piece `piece` of the (rows, num_pieces, PIECE) partial row `row`: the block's terms
    summed over its rows."""
    target, summed, _ = _over_rows(partial.at[row], piece, value, layout)
    store(target, summed)


def _cost(p: Problem, plan: Plan, partial_rows: int, stat_cotangents: bool,
          sum_cotangent: bool) -> tuple[int, int]:
    """`common.backward_flops_and_bytes` for the partial rows written (of the pieces' width),
    with a streamed block's inputs read again in the second pass."""
    flops, nbytes = common.backward_flops_and_bytes(p, partial_rows * plan.width // plan.reduced,
                                                    stat_cotangents, sum_cotangent)
    # x and dsum in x's dtype, dy in y's
    nbytes += reread_bytes(p, plan, 2, jnp.dtype(p.dtype).itemsize * (1 + sum_cotangent)
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
            outputs[name] = jax.ShapeDtypeStruct((partial_rows, plan.num_pieces, PIECE),
                                                 jnp.float32)
    staged, input_barriers = input_buffers(plan, staged_inputs)
    buffers = output_buffers(plan, {"dx": p.dtype}, plan.resident)
    buffers.update((name, smem((plan.num_pieces, PIECE), jnp.float32))
                   for name in ("scale", *_PARTIALS) if name in inputs | outputs
                   and plan.accumulate)  # else scale is read from GMEM
    scratch = [*staged.values(), *buffers.values(), input_barriers]
    if "scale" in buffers:
        scratch.append(plgpu.Barrier(num_arrivals=1))

    def body(*refs):
        names = [*inputs, *outputs]
        named = dict(zip(names, refs))
        scratch_refs = dict(zip([*staged, *buffers], refs[len(names):]))
        barriers = refs[len(names) + len(staged) + len(buffers)]
        scale, ready = named.get("scale"), None
        if "scale" in buffers:  # staged once, every block reads it from shared memory
            staged_scale, ready = stage_rows({"scale": scale}, scratch_refs, refs[-1])
            scale = staged_scale["scale"]
        terms = {n: scratch_refs[n] for n in _PARTIALS if n in scratch_refs}
        for accumulator in terms.values():
            _clear_row(accumulator, plan)
        writer = output_writer(plan, {"dx": named["dx"]}, {"dx": scratch_refs["dx"]},
                               plan.resident)

        def stats_of(block):
            rows_of_block = pl.ds(block * plan.block_rows, plan.block_rows)
            return {n: load(named[n].at[rows_of_block]) for n in _STATS if n in named}

        def compute(first, read, stats):
            _block_gradient(named, read, writer, scale, terms, stats, first, p, plan)

        walk_blocks(plan, {n: named[n] for n in staged}, {n: scratch_refs[n] for n in staged},
                    barriers, 2, compute, prefetch=stats_of, ready=ready)
        if terms:  # the CTA's summed terms, as its partial row (one copy each, as scale)
            plgpu.commit_smem()
            program = jax.lax.axis_index("programs")
            for name, accumulator in terms.items():
                plgpu.copy_smem_to_gmem(accumulator, named[name].at[program])
        RowWriter.finish()

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(plan.programs,), grid_names=("programs",),
        interpret=interpret, name="normalize_backward_mosaic_gpu", scratch=scratch,
        auto_barriers=False,
        flops_and_bytes=_cost(p, plan, partial_rows, gmean is not None, gsum is not None))(
            *inputs.values())))
    return (from_rows_view(results["dx"], p, plan),
            *(jnp.sum(results[name].reshape(partial_rows, plan.width)[:, :plan.reduced],
                      axis=0).reshape(p.param_shape)
              if name in results else None for name in _PARTIALS))


def _clear_row(ref, plan: Plan) -> None:
    """Zeros a shared-memory (num_pieces, PIECE) float32 row."""
    layout = layout_of(plan).reduce(0)
    zeros = plgpu.layout_cast(jnp.zeros((PIECE,), jnp.float32), layout)

    def clear(piece, carry):
        ref.at[piece][...] = zeros
        return carry

    jax.lax.fori_loop(0, plan.num_pieces, clear, 0)
