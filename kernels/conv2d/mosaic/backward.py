"""conv2d's weight gradient as Pallas kernels lowered through Mosaic (TPU) (the package's
docstring has both kernels' loop nests and the VMEM budget; the input gradient is the forward
kernel, `forward.py`).

Block schedules
---------------
Weight gradient, GEMM path: grid = (G, (O/G) / block_n, N, cdiv(OH, block_rows)), the last two
  "arbitrary" (they are the reduction over pixels). Each step takes the same input tile as the
  forward and the (block_rows, OW, block_n) output-gradient block and adds, per tap,
  window(tap)ᵀ @ dY into a (KH, KW, C_in/G, block_n) float32 VMEM accumulator; the last step
  writes dW. Window positions of the padded output grid (past OH or OW) are zeroed first, so an
  Inf or NaN in input rows the convolution never reads does not leak in as 0·Inf.
Weight gradient, depthwise path: the same grid over channel blocks; per tap the elementwise
  product window·dY is reduced over the tile's pixels into a (KH·KW, block_c) accumulator.
The input gradient is the forward kernel on the output gradient, one launch per sub-pixel
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import mosaic_call, mosaic_precision, pl, pltpu, vmem_limit
from kernels.conv2d.common import Problem, flops_and_bytes
from kernels.conv2d.mosaic.config import Layout, resolve_config, vmem_bytes
from kernels.conv2d.mosaic.windows import dot, input_spec, staged_x, tap_list, window_at

__all__ = ["weight_grad"]


def _outside_output(shape: tuple[int, ...], p: Problem, layout: Layout) -> jax.Array | None:
    """Mask of window positions that belong to padded output pixels (row >= OH, col >= OW)."""
    if layout.out_rows == p.oh and layout.out_cols == p.ow:
        return None
    row = pl.program_id(3) * layout.block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    return (row >= p.oh) | (col >= p.ow)


def _masked_window(x_ref, p, layout, kh, kw, lead):
    window = window_at(x_ref, p, layout, kh, kw, lead)
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
    for kh, kw in tap_list(p):
        window = _masked_window(x_ref, p, layout, kh, kw, (0, 0)).reshape(pixels, p.cg)
        acc_ref[kh, kw] += dot(window, dy, p, precision, transpose_a=True)

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
    for tap, (kh, kw) in enumerate(tap_list(p)):
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
    xs = staged_x(x, p, layout)
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
            input_spec(p, layout, block_n, lambda o, j, n, r: (n, 0, r, j)),
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
            input_spec(p, layout, p.cg, lambda g, j, n, r: (n, g, r, 0)),
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
