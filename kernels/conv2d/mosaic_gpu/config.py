"""How the Mosaic GPU conv2d lays its operands out for the matmul kernel's shifted rows (the
kernels are in `forward.py` beside it): the tap-row layout of the input (`TapRows`), the GEMM
each pass runs (`forward_problem`, `weight_grad_problem`) and the checks that decline a
problem (`check`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import require_floating
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import pad_to
from kernels.conv2d.common import Conv2dConfig, Problem
from kernels.matmul.common import MatmulConfig, Problem as MatmulProblem
from kernels.gemm.mosaic_gpu import config as gemm_config
from kernels.gemm.mosaic_gpu.tiles import ONE_TERM

__all__ = ["TapRows", "tap_rows", "tap_rows_matrix", "is_depthwise", "summed_depthwise",
           "forward_problem", "forward_plan", "forward_terms", "forward_config",
           "weight_grad_problem", "weight_grad_reads_shifted", "check", "resolve_config"]


# The tap rows are padded to whole blocks of this many rows: the matmul's largest tile
# (`CONSUMERS` x 128) and a multiple of its K step.
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
        largest shift. The forward's windows (tiles of up to `ROW_BLOCK` rows) lie in it; the
        weight gradient's last pixel split may read past it, where TMA reads zeros and dY is
        zero anyway. One count for both passes: XLA computes the forward's and the weight
        gradient's matrix of the same input once."""
        return _round_up(self.stride * self.phase_rows, ROW_BLOCK) + self.max_shift


def tap_rows(p: Problem) -> TapRows:
    """The layout of `p`'s input (per group), for its output grid of OW rounded up to 8."""
    g = p.geometry
    rows = p.oh + (p.kh - 1) * g.rhs_dilation[0] // g.stride[0]
    return TapRows(rows, _round_up(p.ow, gemm_config.TMA_ROWS), p.n,
                   _round_up(p.kw * p.cg, gemm_config.TMA_COLUMNS), p.kh, g.rhs_dilation[0],
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


def _round_up(size: int, step: int) -> int:
    return pl.cdiv(size, step) * step


def _forward_gemm(p: Problem) -> MatmulProblem:
    layout = tap_rows(p)
    return MatmulProblem(
        (p.groups,), (p.groups,), (p.groups,), layout.phase_rows, p.og, p.kh * layout.width,
        False, True, p.x_dtype, p.w_dtype, p.out_dtype, p.epilogue, p.highest)


def forward_problem(p: Problem) -> MatmulProblem:
    """The forward as the matmul kernel's problem (`gemm_config.kernel_problem`: 16-bit
    operands of one dtype as they are, others as float32 on Hopper and as split bfloat16 on
    Blackwell), one batch per group: A the tap rows (output grid rows x `width` a part of x,
    shifted per K step), B the weights K-major (O/G padded, KH·parts·width), out (output grid
    rows, O/G padded); with split parts, the problem of one part (`forward_terms`)."""
    return gemm_config.kernel_problem(_forward_gemm(p))


def forward_plan(p: Problem, config: Conv2dConfig | None) -> gemm_config.Plan:
    """The forward's launch, planned for the problem as given (Blackwell's split parts take
    narrower tiles: `gemm_config.tcgen05_columns`)."""
    return gemm_config.plan_of(_forward_gemm(p), forward_config(config))


def forward_terms(p: Problem) -> tuple[tuple[int, int], ...]:
    """The (part of x, part of w) products the forward sums along each tap row's K: on
    Blackwell, float32 and mixed data as the matmul's split bfloat16 parts
    (`gemm_config.split_terms`), each operand's parts side by side in a tap row, once; else
    one (`tiles.ONE_TERM`)."""
    gemm = _forward_gemm(p)
    return gemm_config.split_terms(gemm) if gemm_config.is_split(gemm) else ONE_TERM


def forward_config(config: Conv2dConfig | None) -> MatmulConfig:
    """The matmul kernel's config of a forward: the conv config's tile, one K split (a split's
    K steps would need their own shifts)."""
    config = config or Conv2dConfig()
    return MatmulConfig(config.block_m, config.block_n, None, num_stages=config.num_stages,
                        split_k=1)


def _weight_grad_gemm(p: Problem, dy_dtype, dw_dtype) -> MatmulProblem:
    layout = tap_rows(p)
    return MatmulProblem(
        (p.groups, 1), (p.groups, 1), (p.groups, p.kh), layout.width, p.og, layout.phase_rows,
        True, False, p.x_dtype, dy_dtype, dw_dtype, highest=p.highest)


def weight_grad_problem(p: Problem, dy_dtype, dw_dtype) -> MatmulProblem:
    """The weight gradient as the matmul kernel's problem, one batch per (group, tap row):
    dW[g, kh] (width, O/G) = A[g, kh]ᵀ @ dY[g] over the output grid's pixels, A[g, kh] the tap
    rows shifted by tap row kh (stored (pixels, width): transposed)."""
    return gemm_config.kernel_problem(_weight_grad_gemm(p, dy_dtype, dw_dtype))


def weight_grad_reads_shifted(p: Problem, dy_dtype, dw_dtype) -> bool:
    """Whether the weight gradient's kernel reads the tap rows shifted, as they are (16-bit
    operands of one dtype, which the MMA takes transposed). Else (TF32 takes K-major tiles
    only; Blackwell's split bfloat16 parts lie along K, the pixels, which the shifts walk)
    XLA copies each tap row's windows for the matmul (`forward.weight_grad`)."""
    gemm = _weight_grad_gemm(p, dy_dtype, dw_dtype)
    return gemm_config.kernel_problem(gemm).transpose_a and not gemm_config.is_split(gemm)


def resolve_config(p: Problem, config: Conv2dConfig | None) -> Conv2dConfig:
    """The forward's tiles as the matmul kernel resolves them for `forward_problem`."""
    resolved = gemm_config.resolve_config(_forward_gemm(p), forward_config(config))
    return Conv2dConfig(resolved.block_m, resolved.block_n, num_stages=resolved.num_stages)


# Input channels a group below which a grouped convolution of one output channel a group runs
# as a depthwise one (`summed_depthwise`): wgmma's K is 16 (its tile pads a group's tap row
# to 64 columns, and its one output channel to 64).
MIN_GEMM_CHANNELS = 16


def is_depthwise(p: Problem) -> bool:
    """One input channel a group, several groups: the depthwise kernels (no product for
    wgmma)."""
    return p.depthwise and p.groups > 1


def summed_depthwise(p: Problem) -> bool:
    """A few input channels and one output channel a group (the input gradient of a depthwise
    convolution with a channel multiplier): a depthwise convolution of every input channel,
    each group's channels then summed by XLA."""
    return p.groups > 1 and p.og == 1 and 1 < p.cg < MIN_GEMM_CHANNELS


def check(p: Problem, config: Conv2dConfig | None) -> None:
    """Declines what the matmul kernel declines for the forward's GEMM (float64, HIGHEST) and
    integer data, the depthwise path alike (its FMAs keep the GEMM path's contract); rejects a
    config that is not a valid tiling of the GEMM (the depthwise path takes none)."""
    require_floating(x=p.x_dtype, w=p.w_dtype)
    if config is not None and (config.block_k, config.block_rows, config.num_warps) != (
            None, None, None):
        raise ValueError(f"Mosaic GPU conv2d takes block_m, block_n and num_stages (its K slice "
                         f"is TMA's swizzle span), got {config}")
    # The problem as given, not as laid out (`forward_problem`): Blackwell's split parts are
    # bfloat16, which would hide float32 at HIGHEST from the matmul's check.
    gemm_config.check(_forward_gemm(p), forward_config(config))
