"""conv2d's depthwise path on Mosaic GPU (one input channel a group: no product for wgmma):
vector FMAs in registers over TMA-loaded windows of the same tap rows as the GEMM path.

Block schedules
---------------
The input is laid out as `config.TapRows` of the whole convolution (one group of all C
channels), as (rows, KW, C) with C padded to whole channel blocks; output channel o = c·M + j
of channel multiplier M reads input channel c.
Forward (`conv`): grid = (M, channel blocks, row blocks), one warpgroup per CTA (the row
blocks on CUDA's x axis, `_grid`). CTA (j, c, i) owns `BLOCK_ROWS` output-grid rows x
`block_channels` channels of multiplier j: a TMA
pipeline of `STAGES` slots walks the KH·KW taps, each step loading the (rows, channels)
window of tap (kh, kw) (its rows shifted by `shift(kh)`, column block kw) and FMA-ing it with
the tap's weights (a plain load of `block_channels` values) into a float32 accumulator in
registers. The epilogue (bias, activation; z where saved) runs on the accumulator, which is
stored through shared memory by TMA to a (M, rows, C) output that XLA interleaves.
Weight gradient (`weight_grad`): grid = (M, channel blocks, pixel splits x taps). CTA
(j, c, s·T + t) walks the pixel blocks of split s, loading the window of tap t and the
output gradient's block by TMA, and accumulates their products; it then sums the rows
(float32 partials (splits, T, M, C) that XLA adds). Each tap re-reads dY (from L2 where the
split's range fits): the kernel moves about 2·KH·KW times the arrays' bytes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue, _targets
from kernels._blocks import next_power_of_2
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (UNTILED, load, mosaic_gpu_call, per_column, row_layout,
                                        smem, store)
from kernels.conv2d.common import Problem, flops_and_bytes
from kernels.conv2d.mosaic_gpu.tap_rows import TapRows, tap_rows, tap_rows_matrix

__all__ = ["conv", "summed_conv", "weight_grad", "Plan", "plan_of", "BLOCK_ROWS", "STAGES"]

# Output-grid rows a CTA: 64 float32 accumulators a thread for 128 channels (the 4 warps
# split the rows, a warp's lanes the channels: `row_layout`).
BLOCK_ROWS = 64
MAX_BLOCK_CHANNELS = 128
STAGES = 2  # TMA slots in flight: a step's window lands while the previous one is multiplied
MIN_CHANNELS = 32  # a warp's 32 lanes take one channel each at least


class Plan(NamedTuple):
    block_channels: int
    channel_blocks: int
    row_blocks: int
    splits: int  # the weight gradient's pixel splits

    @property
    def channels(self) -> int:
        return self.block_channels * self.channel_blocks


def plan_of(p: Problem) -> Plan:
    """Channel blocks of a power of 2 in [`MIN_CHANNELS`, `MAX_BLOCK_CHANNELS`]; the weight
    gradient's pixels split until its CTAs make two waves (`Target.min_programs`)."""
    block_channels = min(MAX_BLOCK_CHANNELS, max(MIN_CHANNELS, next_power_of_2(p.c)))
    channel_blocks = pl.cdiv(p.c, block_channels)
    row_blocks = pl.cdiv(tap_rows(p).phase_rows, BLOCK_ROWS)
    ctas = p.kh * p.kw * channel_blocks * p.og
    splits = max(1, min(row_blocks, pl.cdiv(_targets.current("gpu").min_programs, ctas)))
    return Plan(block_channels, channel_blocks, row_blocks, splits)


def _layout_problem(p: Problem) -> Problem:
    """The tap rows of all C channels as one group (the GEMM path's layout of one group)."""
    return p._replace(geometry=p.geometry._replace(groups=1))


def _windows(x: jax.Array, p: Problem, plan: Plan, num_rows: int) -> jax.Array:
    """(rows, KW, C padded): the tap rows with each tap column's channels apart."""
    whole = _layout_problem(p)
    a = tap_rows_matrix(x, whole, tap_rows(whole), x.dtype)[0]
    a = a[:, :p.kw * p.c].reshape(a.shape[0], p.kw, p.c)
    return jnp.pad(a, ((0, max(0, num_rows - a.shape[0])), (0, 0), (0, plan.channels - p.c)))


def _tap_spec(layout: TapRows, p: Problem, plan: Plan) -> plgpu.BlockSpec:
    """Step `tap`'s (BLOCK_ROWS, block_channels) window: its rows shifted by its tap row, its
    tap column's channels."""
    def index(tap):
        return layout.shift(tap // p.kw), tap % p.kw, 0

    return plgpu.BlockSpec((pl.Element(BLOCK_ROWS), None, plan.block_channels), index,
                           transforms=UNTILED)


def _forward_kernel(*refs, p: Problem, plan: Plan, layout: TapRows):
    (x_gmem, w_gmem), bias, _, out_gmem, z_gmem = _epilogue.split_refs(refs, p.epilogue, 2)
    first = lax.axis_index("rows") * BLOCK_ROWS
    channels = pl.ds(lax.axis_index("channels") * plan.block_channels, plan.block_channels)
    multiplier = lax.axis_index("multiplier")
    shape = (BLOCK_ROWS, plan.block_channels)
    registers = row_layout(*shape, 4, warps_along_row=1)

    def step(indices, x_smem, acc):
        (tap,) = indices
        x = plgpu.load(x_smem, layout=registers, optimized=False).astype(jnp.float32)
        plgpu.commit_smem()  # every thread has read the slot: the pipeline may refill it
        w = load(w_gmem.at[tap, multiplier, channels]).astype(jnp.float32)
        return acc + x * per_column(w, shape)

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), registers)
    acc = plgpu.emit_pipeline(
        step, grid=(p.kh * p.kw,), in_specs=[_tap_spec(layout, p, plan)],
        max_concurrent_steps=STAGES, init_carry=zeros,
    )(x_gmem.at[pl.ds(first, BLOCK_ROWS + layout.max_shift), :, channels])
    bias_values = None
    if bias is not None:
        bias_values = per_column(load(bias.at[multiplier, channels]), shape)
    y, z = _epilogue.on_accumulator(acc, bias_values, None, p.epilogue)
    rows = pl.ds(first, BLOCK_ROWS)
    _store_by_tma([(gmem.at[multiplier, rows, channels], value)
                   for gmem, value in ((out_gmem, y), (z_gmem, z)) if gmem is not None])


def _store_by_tma(targets: list) -> None:
    """(GMEM window, value) pairs stored through shared memory by TMA (whole windows: the
    outputs are allocated in whole blocks, so no window is ragged: `stored_shape`)."""
    def body(*buffers):
        for buffer, (_, value) in zip(buffers, targets):
            store(buffer, value.astype(buffer.dtype))
        plgpu.commit_smem()
        for buffer, (window, _) in zip(buffers, targets):
            plgpu.copy_smem_to_gmem(buffer, window)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(body, *[smem(value.shape, window.dtype) for window, value in targets])


def _by_multiplier(a: jax.Array, p: Problem, plan: Plan) -> jax.Array:
    """(..., C·M) -> (..., M, C padded): output channel c·M + j at [j, c]."""
    a = a.reshape(*a.shape[:-1], p.c, p.og)
    a = jnp.swapaxes(a, -1, -2)
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, plan.channels - p.c)])


def _grid(p: Problem, plan: Plan, rows: int) -> dict:
    """(multiplier, channel blocks, `rows`). Mosaic GPU puts a grid's axes on CUDA's z, y and
    x in that order, and z and y take at most 65,535 CTAs: the long axis, the rows (6,384 at
    32x112x112 and 3x3; a batch of 512 would be past the cap), goes last, on x."""
    return dict(grid=(p.og, plan.channel_blocks, rows),
                grid_names=("multiplier", "channels", "rows"))


def conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
         interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The depthwise convolution `p` with `p.epilogue`: (N, OH, OW, O), and z where saved."""
    plan, layout = plan_of(p), tap_rows(_layout_problem(p))
    rows, x_bytes = plan.row_blocks * BLOCK_ROWS, x.nbytes
    windows = _windows(x, p, plan, rows + layout.max_shift)  # each tap reads its column's
    w = _by_multiplier(w.reshape(p.kh * p.kw, p.o), p, plan)
    operands = [] if bias is None else [_by_multiplier(bias.astype(jnp.float32), p, plan)]
    shapes = jax.tree.leaves(_epilogue.out_shapes((p.og, rows, plan.channels), p.out_dtype,
                                                  p.epilogue))
    flops, nbytes = flops_and_bytes(p)
    outs = mosaic_gpu_call(
        functools.partial(_forward_kernel, p=p, plan=plan, layout=layout), out_shape=shapes,
        **_grid(p, plan, plan.row_blocks), interpret=interpret,
        name="conv2d_depthwise_mosaic_gpu",
        flops_and_bytes=(flops, nbytes - x_bytes + p.kh * windows.nbytes))(windows, w, *operands)

    def to_nhwc(out):
        out = out[:, :layout.phase_rows, :p.c].reshape(p.og, p.n, layout.rows, layout.cols, p.c)
        out = out[:, :, :p.oh, :p.ow].transpose(1, 2, 3, 4, 0)
        return out.reshape(p.n, p.oh, p.ow, p.o)

    return jax.tree.map(to_nhwc, outs[0] if len(outs) == 1 else tuple(outs))


def summed_conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
                interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The grouped convolution `p` of one output channel a group (`config.summed_depthwise`)
    as the depthwise convolution of each input channel (float32), each group's channels summed
    by XLA, then the epilogue, rounded once."""
    channels = p._replace(o=p.c, geometry=p.geometry._replace(groups=p.c),
                          out_dtype=jnp.dtype(jnp.float32), epilogue=_epilogue.Epilogue())
    w = w.transpose(0, 1, 3, 2).reshape(p.kh, p.kw, 1, p.c)  # channel g·C/G + i: w[..., i, g]
    out = conv(x, w, None, channels, interpret=interpret)
    summed = out.reshape(p.n, p.oh, p.ow, p.groups, p.cg).sum(axis=-1)
    return _epilogue.apply_after_sum(summed, bias, None, p.epilogue, p.out_dtype)


def _weight_grad_kernel(x_gmem, dy_gmem, dw_gmem, *, p: Problem, plan: Plan,
                        layout: TapRows):
    taps = p.kh * p.kw
    split, tap = lax.axis_index("rows") // taps, lax.axis_index("rows") % taps
    channels = pl.ds(lax.axis_index("channels") * plan.block_channels, plan.block_channels)
    multiplier = lax.axis_index("multiplier")
    shape = (BLOCK_ROWS, plan.block_channels)
    registers = row_layout(*shape, 4, warps_along_row=1)
    per_split = pl.cdiv(plan.row_blocks, plan.splits)  # every split whole: zero rows past
    first = split * per_split * BLOCK_ROWS

    def step(_, x_smem, dy_smem, acc):
        x = plgpu.load(x_smem, layout=registers, optimized=False).astype(jnp.float32)
        dy = plgpu.load(dy_smem, layout=registers, optimized=False).astype(jnp.float32)
        plgpu.commit_smem()  # every thread has read the slots: the pipeline may refill them
        return acc + x * dy

    spec = plgpu.BlockSpec(shape, lambda i: (i, 0), transforms=UNTILED)
    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), registers)
    acc = plgpu.emit_pipeline(
        step, grid=(per_split,), in_specs=[spec, spec], max_concurrent_steps=STAGES,
        init_carry=zeros,
    )(x_gmem.at[pl.ds(first + layout.shift(tap // p.kw), per_split * BLOCK_ROWS), tap % p.kw,
                channels],
      dy_gmem.at[multiplier, pl.ds(first, per_split * BLOCK_ROWS), channels])
    _store_by_tma([(dw_gmem.at[split, tap, multiplier, channels], jnp.sum(acc, axis=0))])


def weight_grad(x: jax.Array, dy: jax.Array, p: Problem, *, interpret: bool | str,
                dtype) -> jax.Array:
    """dW (KH, KW, 1, O) in `dtype` of the depthwise convolution `p` for output gradient dy."""
    plan, layout = plan_of(p), tap_rows(_layout_problem(p))
    taps, per_split = p.kh * p.kw, pl.cdiv(plan.row_blocks, plan.splits)
    rows = plan.splits * per_split * BLOCK_ROWS
    x = _windows(x, p, plan, rows + layout.max_shift)
    dy = jnp.pad(dy, ((0, 0), (0, layout.rows - p.oh), (0, layout.cols - p.ow), (0, 0)))
    dy = _by_multiplier(dy.reshape(layout.phase_rows, p.o), p, plan)
    dy = jnp.pad(jnp.swapaxes(dy, 0, 1), ((0, 0), (0, rows - layout.phase_rows), (0, 0)))
    flops, nbytes = flops_and_bytes(p)
    partials = mosaic_gpu_call(
        functools.partial(_weight_grad_kernel, p=p, plan=plan, layout=layout),
        out_shape=[jax.ShapeDtypeStruct((plan.splits, taps, p.og, plan.channels),
                                        jnp.float32)],
        **_grid(p, plan, plan.splits * taps), interpret=interpret,
        name="conv2d_depthwise_weight_grad_mosaic_gpu",
        flops_and_bytes=(flops, taps * (x.nbytes // p.kw + dy.nbytes)))(x, dy)[0]
    dw = partials.sum(axis=0)[:, :, :p.c]  # (T, M, C)
    return jnp.swapaxes(dw, 1, 2).reshape(p.kh, p.kw, 1, p.o).astype(dtype)
