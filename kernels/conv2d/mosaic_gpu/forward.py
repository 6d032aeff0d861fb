"""conv2d's forward (and, run on the output gradient, its input gradient) and weight gradient
on the Mosaic GPU GEMM engine, NHWC images read in place (the package's docstring has the loop
nests and why).

Block schedules
---------------
Both passes are launches of `kernels.gemm.mosaic_gpu` (persistent, warp-specialized: a TMA
producer and wgmma consumers on Hopper, tcgen05 on Blackwell; its docstring has the CTA's
schedule):
  - forward (`tiles.Pixels`): one batch per group; the CTA tile is block_m rows of output
    pixels (pieces of output rows, `config.forward_pixels`) x block_n output channels; K step
    k = (tap, block_k channels) copies a box of x a piece and the (block_n, block_k) weight
    tile, and the epilogue (bias per group, activation; z where saved) stores a box a piece
    into the (N, OH, OW, G, O/G) output. One K split.
  - weight gradient (`tiles.PixelSums`): one batch per (group, tap): the (O/G, C/G) product
    dYᵀ x over the output pixels, K slices of `config.WEIGHT_GRAD_PIXELS` in pieces of 8, a
    box of dY a piece and channel span and a box of x a piece, split along the pixels where
    the tiles leave SMs idle (float32 partials that XLA sums), transposed to HWIO by XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas.mosaic_gpu import pad_to
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.mosaic_gpu import depthwise
from kernels.conv2d.mosaic_gpu.config import (
    forward_pixels, forward_plan, forward_problem, forward_terms, image_operand, is_depthwise,
    k_slice, output_channels, output_grad_operand, summed_depthwise, weight_grad_in_place,
    weight_grad_plan, weight_grad_problem, weight_grad_sums)
from kernels.matmul.common import make_problem as matmul_problem
from kernels.gemm.mosaic_gpu.launch import Terms, bfloat16_parts, gemm, launch
from kernels.gemm.mosaic_gpu.tiles import ONE_TERM

__all__ = ["conv", "weight_grad"]


def conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
         config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The convolution of a problem that `check` accepted, with `p.epilogue`: (N, OH, OW, O)
    in p.out_dtype, and the pre-activation beside it where the epilogue saves it."""
    del precision  # `p.highest`: declined by `check`
    if is_depthwise(p):
        return depthwise.conv(x, w, bias, p, interpret=interpret)
    if summed_depthwise(p):
        return depthwise.summed_conv(x, w, bias, p, interpret=interpret)
    kernel, pairs, plan = forward_problem(p), forward_terms(p), forward_plan(p, config)
    split = pairs != ONE_TERM  # Blackwell's float32: each operand's parts once (`Terms`)
    x_parts, w_parts = (bfloat16_parts(x), bfloat16_parts(w)) if split else ([x], [w])
    pixels = forward_pixels(p, len(x_parts), interpret)
    if plan.block_k != k_slice(p) or plan.splits != 1:
        raise AssertionError(f"the forward's K slices of {k_slice(p)} channels in {plan}")
    a = image_operand(x_parts, p, kernel.a_dtype, interpret)

    def weights(part):  # (G, O/G padded, KH·KW, C/G padded to whole K slices)
        b = part.reshape(p.kh * p.kw, p.cg, p.groups, p.og).transpose(2, 3, 0, 1)
        return pad_to(b.astype(kernel.b_dtype), kernel.n, p.kh * p.kw, pixels.blocks * plan.block_k)

    b = jnp.stack([weights(part) for part in w_parts], axis=3)  # parts side by side a tap
    b = pad_to(b.reshape(p.groups, kernel.n, -1), kernel.n, len(w_parts) * kernel.k)
    channels = output_channels(p)
    outs = launch(a, b, None if bias is None else bias.reshape(p.groups, p.og), None, kernel,
                  plan, len(pairs) * flops_and_bytes(p)[0], interpret, name="conv2d",
                  terms=Terms(pairs, pixels.blocks) if split else None, pixels=pixels,
                  out_shape=(p.n, p.oh, p.ow, p.groups, channels))
    return jax.tree.map(lambda out: out[..., :p.og].reshape(p.n, p.oh, p.ow, p.o), outs)


def weight_grad(x: jax.Array, dy: jax.Array, p: Problem, *, precision, interpret: bool | str,
                dtype) -> jax.Array:
    """dW (KH, KW, C/G, O) in `dtype` of the convolution `p` for its output gradient dy."""
    if is_depthwise(p):
        return depthwise.weight_grad(x, dy, p, interpret=interpret, dtype=dtype)
    flops = flops_and_bytes(p)[0]
    if weight_grad_in_place(p, dy.dtype, dtype):  # 16-bit: x and dY read in place
        kernel = weight_grad_problem(p, dy.dtype, dtype)
        dw = launch(output_grad_operand(dy, p), image_operand([x], p, x.dtype, interpret),
                    None, None, kernel, weight_grad_plan(p, dy.dtype, dtype), flops, interpret,
                    name="conv2d_weight_grad", pixels=weight_grad_sums(p, interpret))
        dw = dw[:, :p.og, :p.cg].reshape(p.groups, p.kh, p.kw, p.og, p.cg)
        return dw.transpose(1, 2, 4, 0, 3).reshape(p.kh, p.kw, p.cg, p.o).astype(dtype)
    # Each tap's window of x copied by XLA, then K-major (TF32) or split by the engine's gemm.
    windows = _tap_windows(x, p)
    dy = dy.reshape(p.m, p.groups, p.og).transpose(1, 0, 2)[:, None]
    dw = gemm(windows, dy, None, None, matmul_problem(windows, dy, True, False, dtype),
              config=None, interpret=interpret)
    dw = dw.reshape(p.groups, p.kh, p.kw, p.cg, p.og).transpose(1, 2, 3, 0, 4)
    return dw.reshape(p.kh, p.kw, p.cg, p.o).astype(dtype)


def _tap_windows(x: jax.Array, p: Problem) -> jax.Array:
    """(G, KH·KW, N·OH·OW, C/G): the input pixels each tap multiplies, per group."""
    g = p.geometry
    (stride_h, stride_w), (dilation_h, dilation_w) = g.stride, g.rhs_dilation
    x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (*g.padding[0], 0), (*g.padding[1], 0),
                                            (0, 0, 0)))
    windows = [lax.slice(x, (0, kh * dilation_h, kw * dilation_w, 0),
                         (p.n, kh * dilation_h + (p.oh - 1) * stride_h + 1,
                          kw * dilation_w + (p.ow - 1) * stride_w + 1, p.c),
                         (1, stride_h, stride_w, 1))
               for kh in range(p.kh) for kw in range(p.kw)]
    windows = jnp.stack(windows).reshape(p.kh * p.kw, p.m, p.groups, p.cg)
    return windows.transpose(2, 0, 1, 3)
