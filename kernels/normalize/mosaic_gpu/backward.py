"""normalize's backward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a): the
rows layout, each row whole in registers, dscale and doffset as deterministic partial rows.

Block schedule
--------------
The view is taken as `rows` rows of `reduced` elements, in `num_blocks` blocks of
`block_rows` rows (`config.block_groups`, `config.resolve_config`; the last one ragged). Grid
`(num_programs + ragged,)` of CTAs (one warpgroup each, the rows in the forward's register
layout, `_pallas.mosaic_gpu.row_layout`):

    CTA q < num_programs, for block b in q, q + num_programs, ... (the whole blocks):
        x[b], dy[b] (and the sum's cotangent dsum[b])  -> registers (float32)
        x̂ = (x - mean) * rstd;  gs = dy * scale
        dx[b] = rstd * (gs - mean(gs) - x̂ * mean(gs * x̂)) (+ dsum[b])  # common.input_gradient
        acc_dscale += dy * x̂;  acc_doffset += dy                       # elementwise, in registers
    dscale_partial[q·block_rows : (q+1)·block_rows], doffset_partial[...] = the accumulators
    CTA num_programs (a ragged grid only): the last block's rows, traced for them, into
    the last `rows % block_rows` partial rows.

`num_programs` = the whole blocks, at most `Target.min_programs` (two waves of the target's
SMs), so the partial rows (float32, `num_programs · block_rows` of `reduced`) stay a small
fraction of the traffic; XLA sums them (no float atomics: the same result on every run). The
accumulators are written as they lie in registers: summing a block's rows first would cross
warps, which Mosaic GPU's layout inference declines for this layout. x and dy are read once and dx written
once: the three passes of the backward's floor, where XLA's fusions take more
(`bench`'s design figures). The second-order terms (cotangents of the saved mean and 1/std)
are read per row when given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _targets
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import load, mosaic_gpu_call, per_column, per_row, row_layout
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_gpu.config import resolve_config

__all__ = ["backward", "num_programs"]


def num_programs(p: Problem, block_rows: int) -> int:
    """CTAs that walk the whole blocks: one per block, up to two waves of the target's SMs."""
    whole_blocks = p.outer * p.groups // block_rows
    return max(1, min(whole_blocks, _targets.current("gpu").min_programs))


def _layout(block_rows: int, p: Problem):
    """One register layout for every block of the CTA, its vectors 16 bytes of float32, the
    widest dtype it moves (the partial rows; a 16-bit x moves in 8-byte vectors)."""
    return row_layout(block_rows, p.reduced, jnp.dtype(jnp.float32).itemsize)


def _block_gradient(refs: dict, first, count: int, p: Problem):
    """dx of rows [first, first + count), written; returns their (dy·x̂, dy) in registers."""
    rows, shape = pl.ds(first, count), (count, p.reduced)
    layout = _layout(count, p)
    x = load(refs["x"].at[rows], layout).astype(jnp.float32)
    g = load(refs["gy"].at[rows], layout).astype(jnp.float32)
    stat = {name: per_row(load(refs[name].at[rows]), shape)
            for name in ("mean", "rstd", "gmean", "grstd") if name in refs}
    xhat = common.normalized(x, stat.get("mean"), stat["rstd"], p)
    gs = g * per_column(load(refs["scale"]), shape) if "scale" in refs else g
    sums = common.GroupSums(per_row(jnp.sum(gs, axis=1), shape),
                            per_row(jnp.sum(gs * xhat, axis=1), shape))
    dx = common.input_gradient(gs, xhat, stat["rstd"], sums, stat.get("gmean"),
                               stat.get("grstd"), p)
    if "gsum" in refs:
        dx = dx + load(refs["gsum"].at[rows], layout).astype(jnp.float32)
    refs["dx"][rows] = dx.astype(refs["dx"].dtype)
    return g * xhat, g


def _store_partials(refs: dict, first, count: int, dscale, doffset) -> None:
    """Partial rows [first, first + count) of dscale and doffset: a CTA's accumulators, as they
    lie in its registers (a sum over their rows would cross warps, which Mosaic GPU's layout
    inference declines for this layout)."""
    for name, value in (("dscale", dscale), ("doffset", doffset)):
        if name in refs:
            refs[name][pl.ds(first, count)] = value
def backward(x, scale, mean, rstd, gy, gmean, grstd, gsum, p: Problem, *,
             config: NormalizeConfig | None, interpret: bool | str):
    """(dx, dscale or None, doffset or None); dscale/doffset in `p.param_shape`. `x` is the
    normalized array (the forward's sum, with a residual); `gsum`, the sum's cotangent or
    None, is added to dx."""
    num_rows, row = p.outer * p.groups, p.reduced
    block_rows = min(resolve_config(p, config, backward=True).block_groups, num_rows)
    whole_blocks, tail = divmod(num_rows, block_rows)
    programs = num_programs(p, block_rows)

    inputs = {"x": x.reshape(num_rows, row), "gy": gy.reshape(num_rows, row)}
    if scale is not None:
        inputs["scale"] = scale.reshape(row).astype(jnp.float32)
    per_row_inputs = {"mean": mean if p.subtract_mean else None, "rstd": rstd,
                      "gmean": gmean if p.subtract_mean else None, "grstd": grstd}
    inputs.update((name, value.reshape(num_rows)) for name, value in per_row_inputs.items()
                  if value is not None)
    if gsum is not None:
        inputs["gsum"] = gsum.reshape(num_rows, row)
    partial = jax.ShapeDtypeStruct((programs * block_rows + tail, row), jnp.float32)
    outputs = {"dx": jax.ShapeDtypeStruct((num_rows, row), p.dtype)}
    if p.has_scale:
        outputs["dscale"] = partial
    if p.has_offset:
        outputs["doffset"] = partial

    def body(*refs):
        named = dict(zip([*inputs, *outputs], refs))
        program = jax.lax.axis_index("programs")

        @pl.when(program < programs)
        def _():
            def step(i, accumulators):
                block = program + i * programs
                dscale, doffset = _block_gradient(named, block * block_rows, block_rows, p)
                return accumulators[0] + dscale, accumulators[1] + doffset

            zeros = plgpu.layout_cast(jnp.zeros((block_rows, row), jnp.float32),
                                      _layout(block_rows, p))
            steps = (whole_blocks - program + programs - 1) // programs
            dscale, doffset = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
            _store_partials(named, program * block_rows, block_rows, dscale, doffset)

        if tail:
            @pl.when(program == programs)
            def _():
                _store_partials(named, programs * block_rows, tail,
                                *_block_gradient(named, whole_blocks * block_rows, tail, p))

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(programs + bool(tail),),
        grid_names=("programs",), interpret=interpret,
        name="normalize_backward_mosaic_gpu")(*inputs.values())))
    return (results["dx"].reshape(p.view_shape),
            *(jnp.sum(results[name], axis=0).reshape(p.param_shape) if name in results else None
              for name in ("dscale", "doffset")))
