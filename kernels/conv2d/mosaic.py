"""conv2d as Pallas kernels lowered through Mosaic (TPU): shifted windows over a VMEM tile.

Each kernel's loop nest, per grid step (blocks and the staged geometry: `mosaic_config.py`);
x_tile is the step's input rows plus the halo, window(tap) a static slice of it:

    conv, step (n, g, j, r):                  # GEMM path; depthwise: window * w[tap] on the VPU
        out[n, r, :, j] = sum(window(tap) @ w[g, tap, :, j] for tap in taps)   # float32 acc
    weight_grad, step (g, j, n, r):           # (n, r): the reduction over pixels, "arbitrary"
        acc[tap] += window(tap)ᵀ @ dy[n, r, :, j] for tap in taps          # VMEM accumulator
        at the last (n, r):  dw[g, :, :, :, j] = acc

Staging (in the wrapper, one XLA copy of the input)
---------------------------------------------------
This first version pads in the wrapper: `lax.pad` applies the padding (negative: a crop) and
enough extra zero rows and columns that every block is whole, and the stride is removed by
splitting the padded image into stride_h·stride_w phases: phase (a, b) holds the padded pixels
(i·stride_h + a, j·stride_w + b). Tap (kh, kw) of output pixel (oh, ow) is then pixel
(oh + kh·dh // sh, ow + kw·dw // sw) of phase (kh·dh % sh, kw·dw % sw) (dh, dw: the kernel
dilation): an unstrided window, so each tap is a static, contiguous slice of a VMEM tile.
Groups become a separate array axis (GEMM path) so a block never straddles them. The output is
computed on a grid of whole blocks (OH rounded up to block_rows, OW to a multiple of the
sublane tile so a (rows, OW, C) window reshapes to a (rows·OW, C) matrix without relayout) and
cropped afterwards.

Block schedules
---------------
Forward, GEMM path (C_in/G > 1): grid = (N, G, (O/G) / block_n, cdiv(OH, block_rows)), all
  "parallel". Step (n, g, j, r) gets in VMEM the input tile of its block_rows output rows plus the
  kernel's halo (all phases, the padded width, the group's C_in/G channels; an element-indexed
  BlockSpec, so neighbouring tiles overlap by the halo), the group's (KH, KW, C_in/G, block_n)
  weights (fetched once per (g, j): the row axis is innermost), and computes
  out = Σ_taps window(tap) @ w[tap] on the MXU, a (block_rows·OW, C_in/G) x (C_in/G, block_n)
  matmul per tap accumulated in float32, then writes its (block_rows, OW, block_n) block once.
  Traffic: the output is written once; the input read (O/G)/block_n times plus the halo rows.
Forward, depthwise path (C_in/G == 1): channels sit in the lanes; grid = (N, O/C, C / block_c,
  cdiv(OH, block_rows)); each tap is a VPU multiply-add of the (block_rows, OW, block_c) window by
  the tap's weight row, so the MXU never multiplies zeros.
Weight gradient, GEMM path: grid = (G, (O/G) / block_n, N, cdiv(OH, block_rows)), the last two
  "arbitrary" (they are the reduction over pixels). Each step takes the same input tile as the
  forward and the (block_rows, OW, block_n) output-gradient block and adds, per tap,
  window(tap)ᵀ @ dY into a (KH, KW, C_in/G, block_n) float32 VMEM accumulator; the last step
  writes dW. Window positions of the padded output grid (past OH or OW) are zeroed first, so an
  Inf or NaN in input rows the convolution never reads does not leak in as 0·Inf.
Weight gradient, depthwise path: the same grid over channel blocks; per tap the elementwise
  product window·dY is reduced over the tile's pixels into a (KH·KW, block_c) accumulator.
The input gradient is the forward kernel on the output gradient, one launch per sub-pixel
phase when the forward is strided (see `kernels.conv2d`): no zero-dilated dY is ever stored.

The whole input tile of a step must fit VMEM with double buffering, within the target's budget
(`Target.vmem_budget`, the policy every Mosaic kernel shares: physical VMEM less an eighth, so
14 MiB on a v4 and 112 MiB on a v5e; `_pallas.vmem_limit` raises the compiler's scoped limit
to what the step needs); a problem whose tile would not (very wide images with many channels)
is declined. (libtpu clamps a limit above the physical VMEM rather than refusing it, so the
former fixed 48 MiB cap let a v4 step that needed 22 MiB through to a compile error. The
estimate, `vmem_bytes`, counts float32 accumulators beside the blocks and is conservative:
a v4 step it puts at 23.6 MiB plans 13.2 MiB of blocks and compiles, but is declined.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import mosaic_call, mosaic_precision, pl, pltpu, vmem_limit
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.mosaic_config import Layout, check, resolve_config, vmem_bytes

__all__ = ["conv", "weight_grad", "staged_input", "check", "resolve_config"]


def _pad(x: jax.Array, pads: list[tuple[int, int]]) -> jax.Array:
    """`lax.pad` whose negative padding (a crop) is applied after the positive part, so no
    intermediate shape is negative."""
    grown = lax.pad(x, jnp.zeros((), x.dtype), [(max(lo, 0), max(hi, 0), 0) for lo, hi in pads])
    starts = [max(-lo, 0) for lo, _ in pads]
    limits = [size - max(-hi, 0) for size, (_, hi) in zip(grown.shape, pads)]
    return lax.slice(grown, starts, limits)


def _stage_input(x: jax.Array, p: Problem, layout: Layout) -> jax.Array:
    """(N, H, W, C) -> (N, sh·sw, rows, cols, G, C/G): padded and split into phases."""
    (sh, sw), padding = p.geometry.stride, p.geometry.padding
    pads = [(0, 0), (padding[0][0], layout.rows * sh - p.h - padding[0][0]),
            (padding[1][0], layout.cols * sw - p.w - padding[1][0]), (0, 0)]
    phased = _pad(x, pads).reshape(p.n, layout.rows, sh, layout.cols, sw, p.groups, p.cg)
    return phased.transpose(0, 2, 4, 1, 3, 5, 6).reshape(
        p.n, layout.phases, layout.rows, layout.cols, p.groups, p.cg)


def _window(x_ref, p: Problem, layout: Layout, kh: int, kw: int, lead: tuple) -> jax.Array:
    """The (block_rows, out_cols, channels) input window that tap (kh, kw) multiplies."""
    (sh, sw), (dh, dw) = p.geometry.stride, p.geometry.rhs_dilation
    phase = (kh * dh % sh) * sw + kw * dw % sw
    return x_ref[(*lead, phase, pl.ds(kh * dh // sh, layout.block_rows),
                  pl.ds(kw * dw // sw, layout.out_cols), slice(None))]


def _taps(p: Problem):
    return [(kh, kw) for kh in range(p.kh) for kw in range(p.kw)]


def _dot(a, b, p: Problem, precision, transpose_a: bool = False):
    dims = (((0,) if transpose_a else (1,), (0,)), ((), ()))
    return lax.dot_general(a.astype(p.compute_dtype), b.astype(p.compute_dtype), dims,
                           precision=precision, preferred_element_type=jnp.float32)


def _conv_kernel(x_ref, w_ref, out_ref, *, p: Problem, layout: Layout, precision):
    pixels = layout.block_rows * layout.out_cols
    acc = None
    for kh, kw in _taps(p):
        window = _window(x_ref, p, layout, kh, kw, (0, 0)).reshape(pixels, p.cg)
        product = _dot(window, w_ref[kh, kw], p, precision)
        acc = product if acc is None else acc + product
    out_ref[...] = acc.reshape(out_ref.shape).astype(out_ref.dtype)


def _depthwise_kernel(x_ref, w_ref, out_ref, *, p: Problem, layout: Layout):
    acc = None
    for tap, (kh, kw) in enumerate(_taps(p)):
        window = _window(x_ref, p, layout, kh, kw, (0,)).astype(jnp.float32)
        product = window * w_ref[pl.ds(tap, 1), :].astype(jnp.float32)[None]
        acc = product if acc is None else acc + product
    out_ref[...] = acc.astype(out_ref.dtype)


def _input_spec(p: Problem, layout: Layout, channels: int, index):
    """Element-indexed input tile: block_rows output rows plus the halo, so tiles overlap.

    `index(grid indices) -> (n, g, row_block, channel_block)`."""
    rows, cols = layout.tile_rows, layout.cols

    def index_map(*grid):
        n, group, row_block, channel_block = index(*grid)
        if p.depthwise:
            # A literal 0 when one block holds every channel: Mosaic must prove a lane offset
            # is a multiple of 128, and cannot from `channel_block * channels` when C < 128.
            first_channel = 0 if channels == p.c else channel_block * channels
            return (n, 0, row_block * layout.block_rows, 0, first_channel)
        return (n, group, 0, row_block * layout.block_rows, 0, 0)

    if p.depthwise:
        block = (1, layout.phases, rows, cols, channels)
    else:
        block = (1, 1, layout.phases, rows, cols, channels)
    return pl.BlockSpec(tuple(pl.Element(b) for b in block), index_map)


def _staged_x(x: jax.Array, p: Problem, layout: Layout) -> jax.Array:
    staged = _stage_input(x, p, layout)
    if p.depthwise:  # channels (one per group) in the lanes
        return staged.reshape(*staged.shape[:4], p.c)
    return staged.transpose(0, 4, 1, 2, 3, 5)  # (N, G, phases, rows, cols, C/G)


def staged_input(x: jax.Array, p: Problem, config: Conv2dConfig | None = None) -> jax.Array:
    """The wrapper's one XLA copy of the input (padded, dilated, phase-split) that `conv`
    feeds the kernel; the bench times it alone to show what padding in the wrapper costs."""
    return _staged_x(x, p, Layout(p, resolve_config(p, config).block_rows))


def conv(x: jax.Array, w: jax.Array, p: Problem, *, config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array:
    """The convolution of a problem that `check` accepted: (N, OH, OW, O) in p.out_dtype."""
    config = resolve_config(p, config)
    layout = Layout(p, config.block_rows)
    block_n = config.block_n
    xs = _staged_x(x, p, layout)
    if p.depthwise:
        multiplier = p.og  # output channel c·multiplier + o reads input channel c
        ws = w.reshape(p.kh * p.kw, p.c, multiplier).transpose(2, 0, 1)  # (mult, taps, C)
        grid = (p.n, multiplier, p.c // block_n, layout.num_row_blocks)
        in_specs = [
            _input_spec(p, layout, block_n, lambda n, o, j, r: (n, 0, r, j)),
            pl.BlockSpec((None, p.kh * p.kw, block_n), lambda n, o, j, r: (o, 0, j)),
        ]
        out_shape = (p.n, multiplier, layout.out_rows, layout.out_cols, p.c)
        out_spec = pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                                lambda n, o, j, r: (n, o, r, 0, j))
        kernel = functools.partial(_depthwise_kernel, p=p, layout=layout)
    else:
        ws = w.reshape(p.kh, p.kw, p.cg, p.groups, p.og).transpose(3, 0, 1, 2, 4)
        grid = (p.n, p.groups, p.og // block_n, layout.num_row_blocks)
        in_specs = [
            _input_spec(p, layout, p.cg, lambda n, g, j, r: (n, g, r, 0)),
            pl.BlockSpec((None, p.kh, p.kw, p.cg, block_n), lambda n, g, j, r: (g, 0, 0, 0, j)),
        ]
        out_shape = (p.n, p.groups, layout.out_rows, layout.out_cols, p.og)
        out_spec = pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                                lambda n, g, j, r: (n, g, r, 0, j))
        kernel = functools.partial(_conv_kernel, p=p, layout=layout,
                                   precision=mosaic_precision(precision))
    out = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, p.out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid,
                                               in_specs=in_specs, out_specs=out_spec),
        dimension_semantics=("parallel",) * 4,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, layout, block_n)),
        name="conv2d_depthwise_mosaic" if p.depthwise else "conv2d_mosaic",
    )(xs, ws)
    out = out[:, :, :p.oh, :p.ow]
    # (N, groups or multiplier, OH, OW, channels) -> (N, OH, OW, O) in HWIO channel order.
    if p.depthwise:
        return out.transpose(0, 2, 3, 4, 1).reshape(p.n, p.oh, p.ow, p.o)
    return out.transpose(0, 2, 3, 1, 4).reshape(p.n, p.oh, p.ow, p.o)


def _outside_output(shape: tuple[int, ...], p: Problem, layout: Layout) -> jax.Array | None:
    """Mask of window positions that belong to padded output pixels (row >= OH, col >= OW)."""
    if layout.out_rows == p.oh and layout.out_cols == p.ow:
        return None
    row = pl.program_id(3) * layout.block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    return (row >= p.oh) | (col >= p.ow)


def _masked_window(x_ref, p, layout, kh, kw, lead):
    window = _window(x_ref, p, layout, kh, kw, lead)
    outside = _outside_output(window.shape, p, layout)
    return window if outside is None else jnp.where(outside, jnp.zeros_like(window), window)


def _reduction_bounds():
    first = (pl.program_id(2) == 0) & (pl.program_id(3) == 0)
    last = ((pl.program_id(2) == pl.num_programs(2) - 1)
            & (pl.program_id(3) == pl.num_programs(3) - 1))
    return first, last


def _weight_grad_kernel(x_ref, dy_ref, dw_ref, acc_ref, *, p: Problem, layout: Layout,
                        precision):
    first, last = _reduction_bounds()

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    pixels = layout.block_rows * layout.out_cols
    dy = dy_ref[...].reshape(pixels, dy_ref.shape[-1])
    for kh, kw in _taps(p):
        window = _masked_window(x_ref, p, layout, kh, kw, (0, 0)).reshape(pixels, p.cg)
        acc_ref[kh, kw] += _dot(window, dy, p, precision, transpose_a=True)

    @pl.when(last)
    def _():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _depthwise_weight_grad_kernel(x_ref, dy_ref, dw_ref, acc_ref, *, p: Problem,
                                  layout: Layout):
    first, last = _reduction_bounds()

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dy = dy_ref[...].astype(jnp.float32)
    for tap, (kh, kw) in enumerate(_taps(p)):
        window = _masked_window(x_ref, p, layout, kh, kw, (0,)).astype(jnp.float32)
        acc_ref[pl.ds(tap, 1), :] += jnp.sum(window * dy, axis=(0, 1))[None, :]

    @pl.when(last)
    def _():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def weight_grad(x: jax.Array, dy: jax.Array, p: Problem, *, precision, interpret: bool | str,
                dtype: jnp.dtype) -> jax.Array:
    """dW (KH, KW, C/G, O) in `dtype` of problem `p` from its input and output gradient."""
    config = resolve_config(p, None)
    layout = Layout(p, config.block_rows)
    block_n = config.block_n
    xs = _staged_x(x, p, layout)
    pad = ((0, 0), (0, layout.out_rows - p.oh), (0, layout.out_cols - p.ow), (0, 0))
    dy = jnp.pad(dy, pad)
    taps = p.kh * p.kw
    semantics = ("parallel", "parallel", "arbitrary", "arbitrary")
    if p.depthwise:
        multiplier = p.og
        dys = dy.reshape(p.n, layout.out_rows, layout.out_cols, p.c, multiplier)
        dys = dys.transpose(0, 4, 1, 2, 3)  # (N, mult, rows, cols, C)
        grid = (multiplier, p.c // block_n, p.n, layout.num_row_blocks)
        in_specs = [
            _input_spec(p, layout, block_n, lambda o, j, n, r: (n, 0, r, j)),
            pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                         lambda o, j, n, r: (n, o, r, 0, j)),
        ]
        out_shape, scratch = (multiplier, taps, p.c), (taps, block_n)
        out_spec = pl.BlockSpec((None, taps, block_n), lambda o, j, n, r: (o, 0, j))
        kernel = functools.partial(_depthwise_weight_grad_kernel, p=p, layout=layout)
    else:
        dys = dy.reshape(p.n, layout.out_rows, layout.out_cols, p.groups, p.og)
        dys = dys.transpose(0, 3, 1, 2, 4)  # (N, G, rows, cols, O/G)
        grid = (p.groups, p.og // block_n, p.n, layout.num_row_blocks)
        in_specs = [
            _input_spec(p, layout, p.cg, lambda g, j, n, r: (n, g, r, 0)),
            pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                         lambda g, j, n, r: (n, g, r, 0, j)),
        ]
        out_shape = (p.groups, p.kh, p.kw, p.cg, p.og)
        scratch = (p.kh, p.kw, p.cg, block_n)
        out_spec = pl.BlockSpec((None, p.kh, p.kw, p.cg, block_n),
                                lambda g, j, n, r: (g, 0, 0, 0, j))
        kernel = functools.partial(_weight_grad_kernel, p=p, layout=layout,
                                   precision=mosaic_precision(precision))
    dw = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid,
                                               in_specs=in_specs, out_specs=out_spec,
                                               scratch_shapes=[pltpu.VMEM(scratch, jnp.float32)]),
        dimension_semantics=semantics,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, layout, block_n)),
        name="conv2d_depthwise_weight_grad_mosaic" if p.depthwise
        else "conv2d_weight_grad_mosaic",
    )(xs, dys)
    if p.depthwise:  # (mult, taps, C) -> (KH, KW, 1, C·mult)
        return dw.transpose(1, 2, 0).reshape(p.kh, p.kw, 1, p.o)
    return dw.transpose(1, 2, 3, 0, 4).reshape(p.kh, p.kw, p.cg, p.o)
