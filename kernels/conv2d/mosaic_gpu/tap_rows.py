"""The tap-row layout of an image that the depthwise kernels read (`depthwise.py`): per output
pixel, the KW input pixels its window reads along W side by side, so that a tap row along H is
a row shift of whole 8-row TMA tiles (`TapRows`). One XLA copy of KW times the input."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import round_up
from kernels._pallas.mosaic_gpu import pad_to
from kernels.conv2d.common import Problem
from kernels.gemm.mosaic_gpu import config as gemm_config

__all__ = ["TapRows", "tap_rows", "tap_rows_matrix", "ROW_BLOCK"]


# The tap rows are padded to whole blocks of this many rows (a multiple of the depthwise
# kernels' `BLOCK_ROWS`).
ROW_BLOCK = 256


class TapRows(NamedTuple):
    """The input as a matrix whose row shifts are the kernel's taps along H.

    Row (n, i, j) of stride phase a holds, for every tap column kw, the input pixel that output
    column j reads at kw: input row i·stride_h + a, column j·stride_w + kw·dilation_w (zero in
    the padding), its group's channels, kw-major; a row is `width` wide (KW·C/G padded to
    `gemm_config.TMA_COLUMNS`). The W axis of the window is thus folded into K by XLA's copy
    (KW times the input), and the H axis is a row shift: output (n, oh, ow) at tap row kh reads
    row q + `shift(kh)` of the matrix, q = (n·rows + oh)·cols + ow its row in the output grid,
    the shift `(kh·dh mod sh)·phase_rows + (kh·dh div sh)·cols`. `cols` (OW rounded up to
    `gemm_config.TMA_ROWS`) makes every shift whole 8-row TMA tiles; the output grid's rows
    past OH and columns past OW are computed and cut off by XLA."""

    rows: int  # OH plus the rows the taps reach below it, per stride phase
    cols: int
    images: int
    width: int
    num_tap_rows: int  # KH
    dilation: int  # along H
    stride: int  # along H

    @property
    def phase_rows(self) -> int:
        """Rows of one stride phase: every image's output grid."""
        return self.images * self.rows * self.cols

    def shift(self, kh):
        """The row offset of tap row `kh` (a Python int or a traced int32)."""
        offset = kh * self.dilation
        return offset % self.stride * self.phase_rows + offset // self.stride * self.cols

    @property
    def max_shift(self) -> int:
        """The last tap row's shift: rows every window reads beyond its output rows."""
        return max(self.shift(kh) for kh in range(self.num_tap_rows))

    @property
    def num_rows(self) -> int:
        """Rows of the matrix: the stride phases, then zeros to a whole `ROW_BLOCK` and the
        largest shift."""
        return round_up(self.stride * self.phase_rows, ROW_BLOCK) + self.max_shift


def tap_rows(p: Problem) -> TapRows:
    """The layout of `p`'s input (per group), for its output grid of OW rounded up to 8."""
    g = p.geometry
    rows = p.oh + (p.kh - 1) * g.rhs_dilation[0] // g.stride[0]
    return TapRows(rows, round_up(p.ow, gemm_config.TMA_ROWS), p.n,
                   round_up(p.kw * p.cg, gemm_config.TMA_COLUMNS), p.kh, g.rhs_dilation[0],
                   g.stride[0])


def tap_rows_matrix(x: jax.Array, p: Problem, layout: TapRows, dtype) -> jax.Array:
    """(G, `layout.num_rows`, width): the input laid out as `layout` says (XLA's copy:
    padding, the KW column windows, the stride phases, the groups), then zero rows."""
    g = p.geometry
    (stride_h, stride_w), dilation_w = g.stride, g.rhs_dilation[1]
    (top, _), (left, _) = g.padding
    height = layout.rows * stride_h
    span = (layout.cols - 1) * stride_w + 1
    width = span + (p.kw - 1) * dilation_w
    x = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (top, height - p.h - top, 0),
                                            (left, width - p.w - left, 0), (0, 0, 0)))
    x = jnp.stack([lax.slice_in_dim(x, kw * dilation_w, kw * dilation_w + span,
                                    stride=stride_w, axis=2) for kw in range(p.kw)], axis=3)
    x = x.reshape(p.n, layout.rows, stride_h, layout.cols, p.kw, p.groups, p.cg)
    x = x.transpose(5, 2, 0, 1, 3, 4, 6).reshape(p.groups, stride_h * layout.phase_rows,
                                                  p.kw * p.cg)
    return pad_to(x.astype(dtype), layout.num_rows, layout.width)
