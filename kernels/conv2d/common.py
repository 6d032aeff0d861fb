"""What the conv2d kernels share: the problem they solve, its block config and its cost.

Every kernel works in NHWC / HWIO. One problem is a grouped convolution with general window
arithmetic (`reference.conv2d.Geometry`: stride, explicit possibly negative padding and kernel
(rhs) dilation): the forward pass and the input gradient are both such convolutions. The input
gradient of a strided forward would be a convolution of the zero-dilated output gradient (lhs
dilation); it runs instead as sub-pixel phases (`subpixel_phases`), so no kernel sees an lhs
dilation. Its size as a GEMM per group: M = N·OH·OW output pixels, N = O/G output channels,
K = KH·KW·C/G taps times input channels.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

import jax.numpy as jnp

from kernels._blocks import tensor_float32
from kernels._dtypes import promoted
from kernels._epilogue import Epilogue
from kernels.reference.conv2d import Geometry, output_size


@dataclasses.dataclass(frozen=True)
class Conv2dConfig:
    """Block sizes of the forward conv2d kernels; `None` fields are picked from the shapes.

    block_m: Triton: output pixels (rows of the implicit GEMM) per program; Mosaic GPU: output
        grid rows per CTA tile, a multiple of 128 (its two consumer warpgroups' 64s).
    block_n: output channels per program (Triton, a power of 2) or grid step (Mosaic: all the
        group's output channels, or a multiple of 128 that divides them; on the depthwise path
        input channels, the channel multiplier being a grid axis; Mosaic GPU: per CTA tile, a
        multiple of 8 up to 64 or of 64).
    block_k: Triton: slice of the KH·KW·C_in reduction loaded per loop step.
    block_rows: Mosaic: output rows per grid step (the input tile is these rows plus the
        kernel's halo).
    num_warps, num_stages: Triton compiler params; Mosaic GPU takes num_stages (its TMA ring)
        and rejects block_k (TMA's swizzle span), block_rows and num_warps.
    The backward kernels pick their own blocks; Mosaic GPU's depthwise kernels too.
    """

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    block_rows: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None



class Problem(NamedTuple):
    """One grouped convolution: x (N, H, W, C) * w (KH, KW, C/G, O) -> (N, OH, OW, O)."""

    n: int
    h: int
    w: int
    c: int
    kh: int
    kw: int
    o: int
    geometry: Geometry
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    out_dtype: jnp.dtype
    epilogue: Epilogue = Epilogue()
    highest: bool = False  # float32 asked at HIGHEST precision (IEEE float32, no TF32)

    @property
    def groups(self) -> int:
        return self.geometry.groups

    @property
    def cg(self) -> int:
        """Input channels per group."""
        return self.c // self.groups

    @property
    def og(self) -> int:
        """Output channels per group."""
        return self.o // self.groups

    @property
    def oh(self) -> int:
        g = self.geometry
        return output_size(self.h, self.kh, g.stride[0], g.padding[0], g.lhs_dilation[0],
                           g.rhs_dilation[0])

    @property
    def ow(self) -> int:
        g = self.geometry
        return output_size(self.w, self.kw, g.stride[1], g.padding[1], g.lhs_dilation[1],
                           g.rhs_dilation[1])

    @property
    def m(self) -> int:
        return self.n * self.oh * self.ow

    @property
    def k(self) -> int:
        return self.kh * self.kw * self.cg

    @property
    def depthwise(self) -> bool:
        """Each output channel reads one input channel: vector FMAs, not the matrix unit."""
        return self.cg == 1

    @property
    def compute_dtype(self) -> jnp.dtype:
        return promoted(self.x_dtype, self.w_dtype)

    @property
    def accumulator_dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.float64 if self.compute_dtype == jnp.float64 else jnp.float32)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (an empty output) or nothing to read (an empty input or
        reduction): the result is zeros of its shape."""
        return self.m * self.o * self.k * self.n * self.h * self.w * self.c == 0


def make_problem(x_shape, w_shape, x_dtype, w_dtype, geometry: Geometry, out_dtype,
                 epilogue: Epilogue = Epilogue(), precision=None) -> Problem:
    if geometry.lhs_dilation != (1, 1):  # the input gradient runs as phases (`subpixel_phases`)
        raise AssertionError(f"conv2d kernels take no lhs dilation, got {geometry}")
    n, h, w, c = x_shape
    kh, kw, _, o = w_shape
    return Problem(n, h, w, c, kh, kw, o, geometry, jnp.dtype(x_dtype), jnp.dtype(w_dtype),
                   jnp.dtype(out_dtype), epilogue, not tensor_float32(jnp.float32, precision))


def flops_and_bytes(p: Problem) -> tuple[int, int]:
    """2·M·K·O flops (zeros of padding and dilation included: the kernels multiply them);
    bytes if x and w are read once and the output (and a saved pre-activation) written once.

    The weight gradient reads x and the output gradient and writes w: the same arrays, so the
    same count serves it.
    """
    flops = 2 * p.m * p.k * p.o
    nbytes = (p.n * p.h * p.w * p.c * p.x_dtype.itemsize
              + p.kh * p.kw * p.cg * p.o * p.w_dtype.itemsize
              + p.m * p.o * p.epilogue.bytes_per_output(p.out_dtype))
    return flops, nbytes


class Phase(NamedTuple):
    """One sub-pixel phase of a convolution whose input is lhs-dilated by L (the input
    gradient of a stride-L forward): the outputs at positions `offset + L·j` of each axis.

    Only the taps `taps[axis]` (a slice of the kernel) land on real input pixels for these
    outputs, and they read the undilated input, so the phase is an ordinary stride-1
    convolution with `geometry` of the sub-kernel: no zero of the dilation is stored or
    multiplied. An empty `taps` range means the phase's outputs are all zero.
    """

    offset: tuple[int, int]
    taps: tuple[slice, slice]
    geometry: Geometry
    out_hw: tuple[int, int]


def _axis_phase(g: Geometry, axis: int, offset: int, in_size: int, out_size: int,
                kernel_size: int):
    """(taps, padding, rhs dilation, output length) of phase `offset` along one axis.

    Output o = offset + L·j reads dilated position o + k·D - pad_lo, a real pixel iff that is
    a multiple of L: pixel j + q_k with q_k = (offset + k·D - pad_lo) / L. The taps that
    qualify are every (L / gcd(D, L))-th from the first, and q_k grows by D / gcd(D, L) along
    them: a sub-kernel with that dilation and front padding -q_first."""
    lhs_dilation, rhs_dilation = g.lhs_dilation[axis], g.rhs_dilation[axis]
    pad_lo = g.padding[axis][0]
    length = len(range(offset, out_size, lhs_dilation))
    first = next((k for k in range(min(kernel_size, lhs_dilation))
                  if (offset + k * rhs_dilation - pad_lo) % lhs_dilation == 0), kernel_size)
    step = lhs_dilation // math.gcd(rhs_dilation, lhs_dilation)
    taps = slice(first, kernel_size, step)
    count = len(range(first, kernel_size, step))
    dilation = rhs_dilation // math.gcd(rhs_dilation, lhs_dilation)
    before = -((offset + first * rhs_dilation - pad_lo) // lhs_dilation)
    after = length - in_size - before + (count - 1) * dilation
    return taps, (before, after), dilation, length


def subpixel_phases(g: Geometry, in_hw: tuple[int, int], kernel_hw: tuple[int, int],
                    out_hw: tuple[int, int]) -> list[Phase] | None:
    """The L_h·L_w phases of a stride-1 convolution with lhs dilation L (see `Phase`), or None
    when it has no lhs dilation."""
    if g.lhs_dilation == (1, 1):
        return None
    if g.stride != (1, 1):  # an input gradient's stride is the forward's lhs dilation: 1
        raise AssertionError(f"sub-pixel phases of a strided convolution: {g}")
    phases = []
    for offset in itertools.product(range(g.lhs_dilation[0]), range(g.lhs_dilation[1])):
        axes = [_axis_phase(g, axis, offset[axis], in_hw[axis], out_hw[axis], kernel_hw[axis])
                for axis in range(2)]
        geometry = Geometry((1, 1), tuple(a[1] for a in axes), (1, 1),
                            tuple(a[2] for a in axes), g.groups)
        phases.append(Phase(offset, tuple(a[0] for a in axes), geometry,
                            tuple(a[3] for a in axes)))
    return phases

