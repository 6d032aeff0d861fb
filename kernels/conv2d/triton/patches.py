"""The implicit GEMM's tiles both conv2d passes gather (`forward.py`, `backward.py`): the input
position of every (pixel, tap) (`source`), the K blocks (`k_block`), the masked patch tile
(`patch_tile`), 2-D loads and stores, and the one dot.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import tensor_core_operand
from kernels._pallas import pl, triton_load, triton_store
from kernels.conv2d.common import Problem
from kernels.conv2d.triton.config import tap_major

__all__ = ["KBlock", "arange_valid", "dot", "gather_input", "input_channel", "k_block_at",
           "load_2d", "patch_tile", "pixel_range", "source", "store_2d"]


def source(p: Problem, out_pos, tap, axis: int):
    """Input index along `axis` read by output position `out_pos` at kernel tap `tap`, and
    whether it is a real pixel (not padding)."""
    g = p.geometry
    pos = out_pos * g.stride[axis] + tap * g.rhs_dilation[axis] - g.padding[axis][0]
    return pos, (pos >= 0) & (pos < (p.h, p.w)[axis])


def input_channel(p: Problem, out_channel):
    """The input channel a depthwise output channel reads (a plain copy at multiplier 1, so
    the compiler still sees consecutive channels)."""
    return out_channel if p.og == 1 else lax.div(out_channel, jnp.int32(p.og))


def pixel_range(p: Problem, start, size: int):
    """Flat output pixels start..start+size-1 as (valid, n, oh, ow) vectors."""
    m = start + jnp.arange(size, dtype=jnp.int32)
    n = lax.div(m, jnp.int32(p.oh * p.ow))
    rest = lax.rem(m, jnp.int32(p.oh * p.ow))
    return m < p.m, n, lax.div(rest, jnp.int32(p.ow)), lax.rem(rest, jnp.int32(p.ow))


def gather_input(x_ref, p: Problem, n, oh, ow, kh, kw, channel, valid):
    """Input values at (pixel, tap, channel) (broadcastable int32 arrays) of the flat NHWC
    input; padding, edges and `~valid` read 0 and touch no memory.

    Out-of-image positions are clamped before the channel is added, so where the pixel and tap
    are per row and the channel per column (a tile of one tap), every row is a run of
    consecutive, aligned addresses: Triton's axis analysis sees it and issues 16-byte vector
    loads, which its pipeliner turns into `cp.async` copies a few K steps ahead."""
    ih, valid_h = source(p, oh, kh, 0)
    iw, valid_w = source(p, ow, kw, 1)
    position_valid = valid_h & valid_w
    position = jnp.where(position_valid, (n * p.h + ih) * p.w + iw, 0)
    return triton_load(x_ref.at[position * p.c + channel], mask=valid & position_valid,
                       other=0)


class KBlock(NamedTuple):
    """Rows [start, start + block_k) of a group's K = taps x channels axis as one K step sees
    them: `tap` a scalar when the block lies in one tap, else per row like `channel`."""

    start: Any
    tap: Any
    channel: jax.Array
    valid: jax.Array


def k_block_at(p: Problem, block_k: int, index) -> KBlock:
    """K block `index` of `num_k_blocks`: tap-major blocks are (tap, channel block) pairs, so
    the per-element tap arithmetic becomes one scalar division per step."""
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    if tap_major(p):
        per_tap = pl.cdiv(p.cg, block_k)
        tap, first_channel = index // per_tap, (index % per_tap) * block_k
        channel = first_channel + lanes
        return KBlock(tap * p.cg + first_channel, tap, channel, channel < p.cg)
    k = index * block_k + lanes
    return KBlock(index * block_k, lax.div(k, jnp.int32(p.cg)), lax.rem(k, jnp.int32(p.cg)),
                  k < p.k)


def patch_tile(x_ref, p: Problem, group, pixels, k: KBlock):
    """The (block_m, block_k) tile of the implicit im2col matrix of `group`."""
    m_valid, n, oh, ow = pixels
    kh, kw = lax.div(k.tap, jnp.int32(p.kw)), lax.rem(k.tap, jnp.int32(p.kw))
    if jnp.ndim(k.tap):
        kh, kw = kh[None, :], kw[None, :]
    return gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None], kh, kw,
                         group * p.cg + k.channel[None, :], m_valid[:, None] & k.valid[None, :])


def load_2d(ref, row_start, rows_valid, col_start, cols_valid):
    view = ref.at[pl.ds(row_start, rows_valid.shape[0]), pl.ds(col_start, cols_valid.shape[0])]
    return triton_load(view, mask=rows_valid[:, None] & cols_valid[None, :], other=0)


def store_2d(ref, value, row_start, rows_valid, col_start, cols_valid):
    view = ref.at[pl.ds(row_start, rows_valid.shape[0]), pl.ds(col_start, cols_valid.shape[0])]
    triton_store(view, value.astype(ref.dtype), mask=rows_valid[:, None] & cols_valid[None, :])


def arange_valid(start, size: int, limit: int):
    return start + jnp.arange(size, dtype=jnp.int32) < limit


def dot(a, b, p: Problem, precision, transpose_a: bool = False, transpose_b: bool = False):
    dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
    return lax.dot_general(tensor_core_operand(a, p.compute_dtype, precision),
                           tensor_core_operand(b, p.compute_dtype, precision), dims,
                           precision=precision, preferred_element_type=p.accumulator_dtype)
