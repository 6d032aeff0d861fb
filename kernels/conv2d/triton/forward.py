"""conv2d's forward (and, run on the output gradient, its input gradient) as Pallas kernels
lowered through Triton (GPU) (the package's docstring has every kernel's loop nest).

Block schedules
---------------
Forward (`conv`), GEMM path (C_in/G > 1):
  grid = (cdiv(M, block_m), cdiv(O/G, block_n), G). Program (i, j, g) owns the output tile of
  block_m pixels x block_n channels of group g. It loops over the K blocks (`num_k_blocks`):
  gathers a (block_m, block_k) patch tile (masked), loads the (block_k, block_n) weight tile
  (masked past K and past the group's channels), and accumulates their dot in float32 (float64
  for float64) registers; 16-bit inputs are multiplied on the tensor cores with float32
  accumulation, float32 as TF32 (the tiles rounded to nearest TF32 in registers first:
  `patches.dot`), whose instructions take K-major tiles only: there the weights
  are copied transposed to (O, K) by XLA first (a small copy, `_blocks.K_MAJOR_MIN_REUSE`) and
  loaded as (block_n, block_k) tiles 16 bytes at a time. The epilogue (bias, activation) is
  applied to the accumulator, and the tile is cast and stored once, masked to the array.
  Traffic: the output is written once, the weights read cdiv(M, block_m) times, each input
  pixel about KH·KW/stride² times per column block (mostly from L2/L1: neighbouring pixels
  share it).
Forward, depthwise path (C_in/G == 1, each output channel reads one input channel):
  grid = (cdiv(M, block_m), cdiv(O, block_n)). A program loops over the KH·KW taps; each step
  gathers the (block_m, block_n) input values of that tap for its pixels and channels
  (channel = out_channel // (O/G)) and FMAs them with the tap's weight row in float32. No dot:
  a dot with K = 1 would leave the tensor cores multiplying padding.
The input gradient is the forward kernel run on the output gradient, one launch per sub-pixel
phase when the forward is strided (see `kernels.conv2d`).

All tiles are powers of 2 >= 16 (Triton's rule and its dot's minimum); offsets are int32, so
arrays of 2³¹ elements or more are declined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _epilogue
from kernels._blocks import K_MAJOR_MIN_REUSE, int32_loop, tensor_float32
from kernels._pallas import pl, triton_call, triton_load
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.triton.config import forward_traffic, num_k_blocks, resolve_config
from kernels.conv2d.triton.patches import (arange_valid, dot, gather_input, input_channel,
                                           k_block_at, load_2d, patch_tile, pixel_range, store_2d)

__all__ = ["conv"]


def _store_outputs(acc, bias_ref, out_ref, z_ref, p: Problem, row_start, rows_valid, col_start,
                   cols_valid):
    """The epilogue on the accumulator tile, then its one store (and z's, saved)."""
    bias = None
    if bias_ref is not None:
        view = bias_ref.at[pl.ds(col_start, cols_valid.shape[0])]
        bias = triton_load(view, mask=cols_valid, other=0)[None, :]
    y, z = _epilogue.on_accumulator(acc, bias, None, p.epilogue)
    store_2d(out_ref, y, row_start, rows_valid, col_start, cols_valid)
    if z_ref is not None:
        store_2d(z_ref, z, row_start, rows_valid, col_start, cols_valid)


def _conv_kernel(*refs, p: Problem, config: Conv2dConfig, precision, k_major: bool):
    (x_ref, w_ref), bias_ref, _, out_ref, z_ref = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    row_start, group = pl.program_id(0) * block_m, pl.program_id(2)
    col_start = group * p.og + pl.program_id(1) * block_n
    pixels = pixel_range(p, row_start, block_m)
    cols_valid = arange_valid(pl.program_id(1) * block_n, block_n, p.og)

    def step(k_block, acc):
        k = k_block_at(p, block_k, k_block)
        patches = patch_tile(x_ref, p, group, pixels, k)
        if k_major:  # the weights stored (O, K): a (block_n, block_k) tile
            weights = load_2d(w_ref, col_start, cols_valid, k.start, k.valid)
        else:
            weights = load_2d(w_ref, k.start, k.valid, col_start, cols_valid)
        return acc + dot(patches, weights, p, precision, transpose_b=k_major)

    acc = int32_loop(num_k_blocks(p, block_k), step,
                     jnp.zeros((block_m, block_n), p.accumulator_dtype))
    _store_outputs(acc, bias_ref, out_ref, z_ref, p, row_start, pixels[0], col_start, cols_valid)


def _depthwise_kernel(*refs, p: Problem, config: Conv2dConfig):
    (x_ref, w_ref), bias_ref, _, out_ref, z_ref = _epilogue.split_refs(refs, p.epilogue, 2)
    block_m, block_n = config.block_m, config.block_n
    row_start, col_start = pl.program_id(0) * block_m, pl.program_id(1) * block_n
    m_valid, n, oh, ow = pixel_range(p, row_start, block_m)
    out_channel = col_start + jnp.arange(block_n, dtype=jnp.int32)
    cols_valid = out_channel < p.o
    in_channel = input_channel(p, out_channel)
    valid = m_valid[:, None] & cols_valid[None, :]

    def step(tap, acc):
        kh, kw = lax.div(tap, jnp.int32(p.kw)), lax.rem(tap, jnp.int32(p.kw))
        values = gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None], kh, kw,
                               in_channel[None, :], valid)
        weights = triton_load(w_ref.at[tap, pl.ds(col_start, block_n)], mask=cols_valid,
                              other=0)
        return acc + values.astype(acc.dtype) * weights.astype(acc.dtype)[None, :]

    acc = int32_loop(p.kh * p.kw, step,
                     jnp.zeros((block_m, block_n), p.accumulator_dtype))
    _store_outputs(acc, bias_ref, out_ref, z_ref, p, row_start, m_valid, col_start, cols_valid)


def conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
         config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The convolution of a problem that `check` accepted, with `p.epilogue`: (N, OH, OW, O)
    in p.out_dtype, and the pre-activation beside it where the epilogue saves it."""
    config = resolve_config(p, config)
    weights = w.reshape(p.k, p.o)
    if p.depthwise:
        kernel = functools.partial(_depthwise_kernel, p=p, config=config)
        grid = (pl.cdiv(p.m, config.block_m), pl.cdiv(p.o, config.block_n))
    else:
        # TF32 dots take K-major tiles: the small weight matrix copied transposed by XLA.
        k_major = (tensor_float32(p.compute_dtype, precision) and p.w_dtype.itemsize == 4
                   and p.m >= K_MAJOR_MIN_REUSE)
        kernel = functools.partial(_conv_kernel, p=p, config=config, precision=precision,
                                   k_major=k_major)
        grid = (pl.cdiv(p.m, config.block_m), pl.cdiv(p.og, config.block_n), p.groups)
        weights = weights.T if k_major else weights
    outs = triton_call(
        kernel,
        out_shape=_epilogue.out_shapes((p.m, p.o), p.out_dtype, p.epilogue),
        grid=grid,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=forward_traffic(p, config),
        name="conv2d_depthwise_triton" if p.depthwise else "conv2d_triton",
    )(x.reshape(-1), weights, *_epilogue.operands(bias, None))
    return jax.tree.map(lambda out: out.reshape(p.n, p.oh, p.ow, p.o), outs)
