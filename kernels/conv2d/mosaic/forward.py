"""conv2d's forward (and, run on the output gradient, its input gradient) as Pallas kernels
lowered through Mosaic (TPU) (the package's docstring has both kernels' loop nests and the VMEM
budget; `windows.py` the staging).

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
phase when the forward is strided (see `kernels.conv2d`): no zero-dilated dY is ever stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import _epilogue
from kernels._pallas import mosaic_call, mosaic_precision, pl, pltpu, vmem_limit
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.mosaic.config import Layout, resolve_config, vmem_bytes
from kernels.conv2d.mosaic.windows import dot, input_spec, staged_x, tap_list, window_at

__all__ = ["conv"]


def _store_outputs(acc, bias_ref, out_ref, z_ref, p: Problem):
    """The epilogue on the accumulator block, then its one store (and z's, saved)."""
    bias = None if bias_ref is None else bias_ref[...]
    y, z = _epilogue.on_accumulator(acc, bias, None, p.epilogue)
    out_ref[...] = y.reshape(out_ref.shape).astype(out_ref.dtype)
    if z_ref is not None:
        z_ref[...] = z.reshape(z_ref.shape).astype(z_ref.dtype)


def _conv_kernel(*refs, p: Problem, layout: Layout, precision):
    (x_ref, w_ref), bias_ref, _, out_ref, z_ref = _epilogue.split_refs(refs, p.epilogue, 2)
    pixels = layout.block_rows * layout.out_cols
    acc = None
    for kh, kw in tap_list(p):
        window = window_at(x_ref, p, layout, kh, kw, (0, 0)).reshape(pixels, p.cg)
        product = dot(window, w_ref[kh, kw], p, precision)
        acc = product if acc is None else acc + product
    _store_outputs(acc, bias_ref, out_ref, z_ref, p)


def _depthwise_kernel(*refs, p: Problem, layout: Layout):
    (x_ref, w_ref), bias_ref, _, out_ref, z_ref = _epilogue.split_refs(refs, p.epilogue, 2)
    acc = None
    for tap, (kh, kw) in enumerate(tap_list(p)):
        window = window_at(x_ref, p, layout, kh, kw, (0,)).astype(jnp.float32)
        product = window * w_ref[pl.ds(tap, 1), :].astype(jnp.float32)[None]
        acc = product if acc is None else acc + product
    _store_outputs(acc, bias_ref, out_ref, z_ref, p)


def conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
         config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The convolution of a problem that `check` accepted, with `p.epilogue`: (N, OH, OW, O)
    in p.out_dtype, and the pre-activation beside it where the epilogue saves it."""
    config = resolve_config(p, config)
    layout = Layout(p, config.block_rows)
    block_n = config.block_n
    xs = staged_x(x, p, layout)
    if p.depthwise:
        multiplier = p.og  # output channel c·multiplier + o reads input channel c
        ws = w.reshape(p.kh * p.kw, p.c, multiplier).transpose(2, 0, 1)  # (mult, taps, C)
        grid = (p.n, multiplier, p.c // block_n, layout.num_row_blocks)
        # Output channel c·multiplier + o: the bias as (multiplier, 1, C), a lane row per step.
        biases = None if bias is None else bias.reshape(p.c, multiplier).T[:, None, :]
        bias_spec = pl.BlockSpec((None, 1, block_n), lambda n, o, j, r: (o, 0, j))
        in_specs = [
            input_spec(p, layout, block_n, lambda n, o, j, r: (n, 0, r, j)),
            pl.BlockSpec((None, p.kh * p.kw, block_n), lambda n, o, j, r: (o, 0, j)),
        ]
        out_shape = (p.n, multiplier, layout.out_rows, layout.out_cols, p.c)
        out_spec = pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                                lambda n, o, j, r: (n, o, r, 0, j))
        kernel = functools.partial(_depthwise_kernel, p=p, layout=layout)
    else:
        ws = w.reshape(p.kh, p.kw, p.cg, p.groups, p.og).transpose(3, 0, 1, 2, 4)
        grid = (p.n, p.groups, p.og // block_n, layout.num_row_blocks)
        biases = None if bias is None else bias.reshape(p.groups, 1, p.og)
        bias_spec = pl.BlockSpec((None, 1, block_n), lambda n, g, j, r: (g, 0, j))
        in_specs = [
            input_spec(p, layout, p.cg, lambda n, g, j, r: (n, g, r, 0)),
            pl.BlockSpec((None, p.kh, p.kw, p.cg, block_n), lambda n, g, j, r: (g, 0, 0, 0, j)),
        ]
        out_shape = (p.n, p.groups, layout.out_rows, layout.out_cols, p.og)
        out_spec = pl.BlockSpec((None, None, layout.block_rows, layout.out_cols, block_n),
                                lambda n, g, j, r: (n, g, r, 0, j))
        kernel = functools.partial(_conv_kernel, p=p, layout=layout,
                                   precision=mosaic_precision(precision))
    if bias is not None:
        in_specs.append(bias_spec)
    out = mosaic_call(
        kernel,
        out_shape=_epilogue.out_shapes(out_shape, p.out_dtype, p.epilogue),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
            out_specs=out_spec if p.epilogue.saved is None else (out_spec, out_spec)),
        dimension_semantics=("parallel",) * 4,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        vmem_limit_bytes=vmem_limit(vmem_bytes(p, layout, block_n)),
        name="conv2d_depthwise_mosaic" if p.depthwise else "conv2d_mosaic",
    )(xs, ws, *_epilogue.operands(biases, None))
    return jax.tree.map(lambda out: _nhwc(out, p), out)


def _nhwc(out: jax.Array, p: Problem) -> jax.Array:
    """(N, groups or multiplier, OH', OW', channels) -> (N, OH, OW, O) in HWIO channel order."""
    out = out[:, :, :p.oh, :p.ow]
    if p.depthwise:
        return out.transpose(0, 2, 3, 4, 1).reshape(p.n, p.oh, p.ow, p.o)
    return out.transpose(0, 2, 3, 1, 4).reshape(p.n, p.oh, p.ow, p.o)
