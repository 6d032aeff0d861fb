"""`kernels.conv2d`: `lax.conv_general_dilated` on images as Pallas kernels, with
kernel-computed gradients.

The public function validates its arguments (through `reference.conv2d`'s `geometry`, the one
normalization of stride, dilation and padding), converts NCHW/OIHW to NHWC/HWIO in the wrapper
(XLA transposes; the kernels work in NHWC), and routes to `_conv`, a `custom_vjp` over a grouped
convolution with general window arithmetic. Its backward pass runs kernels of the same
implementation:
- the input gradient is a forward convolution of the output gradient with the spatially flipped
  kernel whose in/out channels are swapped within each group; the forward stride becomes that
  convolution's input (lhs) dilation, with padding chosen so the result has the input's shape
  (`_input_gradient`). A strided forward's input gradient runs as stride² sub-pixel phases
  (`common.subpixel_phases`), so no kernel multiplies the zeros of the dilation;
- the weight gradient is a correlation of the input with the output gradient, reduced over
  pixels: the `weight_grad` kernels (`_weight_gradient`, itself a `custom_vjp`).
Both are bilinear, and the backward of each is expressed through `_conv` and
`_weight_gradient`, so `grad` of `grad` runs kernels too, to any order. The fused epilogue
(`activation(conv + bias)`, `kernels._epilogue`) runs in the forward kernel; with an activation
the training forward also writes the pre-activation z, and the backward's dZ = g·activation'(z)
and dbias are one XLA pass before the two gradient kernels. A 1x1 convolution with
stride 1 and no padding (and its input and weight gradients) runs on the matmul kernels of the
same implementation (`_is_pointwise`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from kernels import _dispatch, _targets, partition, registry
from kernels._epilogue import Epilogue, gradients, saved_dtype
from kernels.registry import Op
from kernels.conv2d import sharding
from kernels.conv2d.common import (Conv2dConfig, Phase, Problem, make_problem,
                                   subpixel_phases)
from kernels.matmul import OP as MATMUL
from kernels.matmul.common import make_problem as matmul_problem
from kernels.reference.conv2d import Geometry, conv2d as reference_conv2d, dilated_size
from kernels.reference.conv2d import geometry as make_geometry
from kernels.reference import epilogue as epilogue_reference

__all__ = ["conv2d", "Conv2dConfig"]

OP = Op("conv2d", reference_conv2d, __name__, Conv2dConfig, sharding,
        check=lambda kernel, p, config: _check(kernel, p, config))


class _Static(NamedTuple):
    """The hashable, non-differentiable arguments of `_conv` and `_weight_gradient`."""

    implementation: str
    interpret: bool | str  # resolved by the dispatch: False, True or "strict"
    config: Conv2dConfig | None
    precision: Any
    geometry: Geometry
    out_dtype: jnp.dtype
    # The mesh axes asked of the NHWC output's dims on Explicit axes (partition.Layout
    # .requested): sharded input channels then reduce-scatter into them. The forward's only.
    requested: tuple[partition.Dims | None] | None = None
    epilogue: Epilogue = Epilogue()  # the forward's only
    # The device the program is traced for (`_targets.program_device`), so that the backward,
    # traced later, is built for it too (`partition.partitioned`).
    device: Any = None


def _is_pointwise(p: Problem, config: Conv2dConfig | None) -> bool:
    """A 1x1 convolution with stride 1, no padding and one group is the matmul
    (N·H·W, C) @ (C, O) of contiguous rows: it runs on the matmul kernels (their tiles by shape
    class, split-K, vectorized loads) unless a conv config asks for the conv kernel."""
    g = p.geometry
    return (config is None and (p.kh, p.kw, p.groups) == (1, 1, 1) and g.stride == (1, 1)
            and g.padding == ((0, 0), (0, 0)))


def _check(kernel: str, p: Problem, config: Conv2dConfig | None) -> None:
    if _is_pointwise(p, config):
        a = jax.ShapeDtypeStruct((p.m, p.c), p.x_dtype)
        b = jax.ShapeDtypeStruct((p.c, p.o), p.w_dtype)
        MATMUL.module(kernel).check(matmul_problem(a, b, False, False, p.out_dtype, p.epilogue),
                                    None)
    else:
        OP.module(kernel).check(p, config)


def _matmul(a: jax.Array, b: jax.Array, transpose_a: bool, static: _Static,
            out_dtype: jnp.dtype, bias: jax.Array | None = None
            ) -> jax.Array | tuple[jax.Array, jax.Array]:
    kernel = MATMUL.module(static.implementation)
    p = matmul_problem(a, b, transpose_a, False, out_dtype, static.epilogue)
    return kernel.matmul(a, b, bias, None, p, config=None, precision=static.precision,
                         interpret=static.interpret)


def _run_whole(x: jax.Array, w: jax.Array, bias: jax.Array | None,
               static: _Static) -> jax.Array | tuple[jax.Array, jax.Array]:
    p = make_problem(x.shape, w.shape, x.dtype, w.dtype, static.geometry, static.out_dtype,
                     static.epilogue, static.precision)
    if p.is_empty:  # a strided input gradient's phase that no tap reaches (`subpixel_phases`)
        return jnp.zeros((p.n, p.oh, p.ow, p.o), p.out_dtype)
    if _is_pointwise(p, static.config):
        out = _matmul(x.reshape(p.m, p.c), w.reshape(p.c, p.o), False, static, p.out_dtype,
                      bias)
        return jax.tree.map(lambda y: y.reshape(p.n, p.oh, p.ow, p.o), out)
    return OP.module(static.implementation).conv(x, w, bias, p, config=static.config,
                                                 precision=static.precision,
                                                 interpret=static.interpret)


# Each device runs the kernel on its blocks of a mesh-sharded convolution (kernels.partition).
_run = partition.partitioned(_run_whole, sharding.rule, sharding.factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv(x: jax.Array, w: jax.Array, bias: jax.Array | None,
          static: _Static) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Grouped NHWC/HWIO convolution of geometry `static.geometry` with `static.epilogue`, in
    `static.out_dtype`; (y, z) where the epilogue saves z."""
    return _run(x, w, bias, static)


def _conv_fwd(x, w, bias, static):
    # The primal goes through `_conv` itself, not `_run`: a higher-order derivative of this
    # rule then differentiates it with these rules rather than tracing into the kernel.
    epilogue = static.epilogue
    if epilogue.activation is None or epilogue.saved is not None:
        out = _conv(x, w, bias, static)
        return out, (x, w, bias, out[1] if epilogue.saved is not None else None)
    saved = saved_dtype(x.dtype, w.dtype, static.out_dtype)
    y, z = _conv(x, w, bias, static._replace(epilogue=epilogue._replace(saved=saved)))
    return y, (x, w, bias, z)


def _conv_bwd(static: _Static, residuals, g):
    x, w, bias, z = residuals
    dy, dbias, _ = gradients(static.epilogue, g, z, bias, None, (x.dtype, w.dtype))
    static = static._replace(requested=None, epilogue=Epilogue())
    dx = _input_gradient(dy, w, static, x.shape[1:3], x.dtype)
    dw = _weight_gradient(x, dy, static._replace(out_dtype=jnp.dtype(w.dtype)), w.shape[:2])
    return partition.like(dx, x), partition.like(dw, w), dbias


_conv.defvjp(_conv_fwd, _conv_bwd)
# Eager calls hit jit's cache instead of re-tracing and re-compiling the kernel each time.
_jitted_conv = jax.jit(_conv, static_argnums=-1)


def _flip_and_swap(w: jax.Array, groups: int) -> jax.Array:
    """(KH, KW, C/G, O) -> (KH, KW, O/G, C): spatially flipped, in/out swapped per group."""
    kh, kw, cg, o = w.shape
    w = w.reshape(kh, kw, cg, groups, o // groups).transpose(0, 1, 4, 3, 2)
    return w.reshape(kh, kw, o // groups, groups * cg)[::-1, ::-1]


def _transposed_geometry(g: Geometry, in_hw, kernel_hw, out_hw) -> Geometry:
    """The geometry of the input gradient as a convolution of the output gradient.

    Output gradient position o sits at o·stride in the forward's padded input; dilating it by
    the stride (lhs dilation), padding by (dilated window - 1 - pad_lo) in front and what makes
    the result as long as the lhs-dilated input behind, and striding by the forward lhs dilation
    gives exactly the input positions (`jax`'s own conv transpose rule)."""
    padding = []
    for axis in range(2):
        window = dilated_size(kernel_hw[axis], g.rhs_dilation[axis])
        before = window - 1 - g.padding[axis][0]
        after = (dilated_size(in_hw[axis], g.lhs_dilation[axis]) + window - 1
                 - dilated_size(out_hw[axis], g.stride[axis]) - before)
        padding.append((before, after))
    return Geometry(g.lhs_dilation, tuple(padding), g.stride, g.rhs_dilation, g.groups)


def _input_gradient(dy, w, static: _Static, in_hw, dtype) -> jax.Array:
    """dX of `_conv(x, w, static)` for output gradient dy, as `_conv`s of dy.

    A strided forward makes this a convolution of the zero-dilated dy. Rather than storing or
    multiplying those zeros, it runs as stride_h·stride_w sub-pixel phases (`subpixel_phases`):
    each a stride-1 convolution of dy itself with the taps that reach its pixels, together
    executing the forward's multiply-adds; XLA interleaves their outputs (one copy of dX)."""
    geometry = _transposed_geometry(static.geometry, in_hw, w.shape[:2], dy.shape[1:3])
    transposed = static._replace(config=None, geometry=geometry, out_dtype=jnp.dtype(dtype))
    w = _flip_and_swap(w, static.geometry.groups)
    phases = subpixel_phases(geometry, dy.shape[1:3], w.shape[:2], tuple(in_hw))
    if phases is None:
        return _conv(dy, w, None, transposed)
    outputs = [_phase_output(dy, w, transposed, phase) for phase in phases]
    return _interleave(outputs, geometry.lhs_dilation, tuple(in_hw))


def _phase_output(dy, w, static: _Static, phase: Phase) -> jax.Array:
    """The phase's pixels of dX, padded to the ceil(H/L) x ceil(W/L) grid of every phase."""
    w = w[phase.taps]
    shape = (dy.shape[0], *phase.out_hw, w.shape[3])
    if 0 in w.shape[:2] or 0 in phase.out_hw:  # no tap reaches these pixels
        return jnp.zeros(shape, static.out_dtype)
    return _conv(dy, w, None, static._replace(geometry=phase.geometry))


def _interleave(outputs: list[jax.Array], lhs_dilation, out_hw) -> jax.Array:
    """Phase (a, b)'s output j, i lands at (a + L_h·j, b + L_w·i)."""
    rows, cols = (-(-size // step) for size, step in zip(out_hw, lhs_dilation))
    padded = [jnp.pad(o, ((0, 0), (0, rows - o.shape[1]), (0, cols - o.shape[2]), (0, 0)))
              for o in outputs]
    n, c = padded[0].shape[0], padded[0].shape[3]
    # On Explicit mesh axes JAX cannot infer these reshapes' shardings: the batch keeps its own.
    batch = partition.dims_of(padded[0])[0]
    grid = partition.reshape(jnp.stack(padded), (*lhs_dilation, n, rows, cols, c),
                             ((), (), batch, (), (), ()))
    dx = partition.reshape(grid.transpose(2, 3, 0, 4, 1, 5),
                           (n, rows * lhs_dilation[0], cols * lhs_dilation[1], c),
                           (batch, (), (), ()))
    return dx[:, :out_hw[0], :out_hw[1]]


def _weight_gradient_whole(x, dy, statics: tuple[_Static, tuple[int, int]]) -> jax.Array:
    static, (kh, kw) = statics
    # The weight-gradient kernels multiply x by dy: dy's dtype takes w's place in the problem.
    p = make_problem(x.shape, (kh, kw, x.shape[3] // static.geometry.groups, dy.shape[3]), x.dtype,
                     dy.dtype, static.geometry, dy.dtype, precision=static.precision)
    shape = (kh, kw, p.cg, p.o)
    if p.is_empty:
        return jnp.zeros(shape, static.out_dtype)
    if (p.oh, p.ow) != dy.shape[1:3]:
        raise AssertionError(f"output gradient shape {dy.shape} does not match {p}")
    if _is_pointwise(p, None):  # dW = xᵀ @ dy over the pixels
        dw = _matmul(x.reshape(p.m, p.c), dy.reshape(p.m, p.o), True, static, static.out_dtype)
        return dw.reshape(shape)
    return OP.module(static.implementation).weight_grad(
        x, dy, p, precision=static.precision, interpret=static.interpret, dtype=static.out_dtype)


_run_weight_gradient = partition.partitioned(_weight_gradient_whole,
                                             sharding.weight_gradient_rule,
                                             sharding.weight_gradient_factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _weight_gradient(x: jax.Array, dy: jax.Array, static: _Static, kernel_hw) -> jax.Array:
    """dW of `_conv(x, w, static)` with w of spatial shape `kernel_hw`, in
    `static.out_dtype`."""
    return _run_weight_gradient(x, dy, (static, tuple(kernel_hw)))


def _weight_gradient_fwd(x, dy, static, kernel_hw):
    return _weight_gradient(x, dy, static, kernel_hw), (x, dy)


def _weight_gradient_bwd(static: _Static, kernel_hw, residuals, ddw):
    # dW(x, dy) is bilinear: its cotangent ddw acts as a kernel. Against x it is the input
    # gradient of a convolution with kernel ddw; against dy, the convolution of x with ddw.
    x, dy = residuals
    dx = _input_gradient(dy, ddw, static, x.shape[1:3], x.dtype)
    ddy = _conv(x, ddw.astype(static.out_dtype), None,
                static._replace(config=None, out_dtype=dy.dtype))
    return dx, ddy


_weight_gradient.defvjp(_weight_gradient_fwd, _weight_gradient_bwd)


def conv2d(
    x: jax.Array,
    w: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    stride: int | tuple[int, int] = 1,
    padding: Any = "SAME",
    dilation: int | tuple[int, int] = 1,
    feature_group_count: int = 1,
    data_format: str = "NHWC",
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: Conv2dConfig | None = None,
) -> jax.Array:
    """`activation(lax.conv_general_dilated(x, w, ...) + bias)` on 2-D images as a Pallas
    kernel.

    x is NHWC with kernel w in HWIO, or NCHW with w in OIHW (`data_format`); `stride` and
    `dilation` (the kernel's) are ints or pairs; `padding` is "SAME", "VALID", an int, a pair
    of ints or ((top, bottom), (left, right)). `feature_group_count` groups the channels
    (depthwise: equal to the input channels). Mixed dtypes promote as `jnp.result_type`; the
    result has `preferred_element_type` if given. 16-bit inputs accumulate in float32.
    `bias` (output features) and `activation` (None, "relu", "gelu", "gelu_tanh", "silu") are
    applied to the float32 accumulator in the kernel and rounded once (docs/design.md).
    `out_sharding` as `lax.conv_general_dilated` takes it (on Explicit axes: sharded input
    channels reduce-scatter into it).

    The kernels work in NHWC/HWIO: NCHW input is transposed in the wrapper (an XLA copy each
    way). `implementation` and `interpret` choose the kernel as in docs/design.md; `config` sets the
    forward kernel's block sizes (`None` picks them from the shapes).
    """
    OP.validate(config, booleans=True, x=x, w=w,
                **({} if bias is None else {"bias": bias}))
    x, w = jnp.asarray(x), jnp.asarray(w)
    geometry = make_geometry(
        x.shape, w.shape, stride=stride, padding=padding, dilation=dilation,
        feature_group_count=feature_group_count, data_format=data_format)
    if isinstance(precision, list):
        precision = tuple(precision)
    nhwc = (0, 2, 3, 1) if data_format == "NCHW" else (0, 1, 2, 3)
    hwio = (2, 3, 1, 0) if data_format == "NCHW" else (0, 1, 2, 3)
    w_hwio = tuple(w.shape[d] for d in hwio)
    epilogue_reference.check("conv2d", (), w_hwio[3], bias, activation, None)
    bias = None if bias is None else jnp.asarray(bias)
    out_dtype = epilogue_reference.result_dtype(
        preferred_element_type or jnp.result_type(x, w), bias, None)
    epilogue = Epilogue(activation, has_bias=bias is not None)
    problem = make_problem(tuple(x.shape[d] for d in nhwc), w_hwio, x.dtype, w.dtype, geometry,
                           out_dtype, epilogue, precision)
    checks = OP.checks(problem, config)
    out_sharding = partition.out_sharding(out_sharding, "conv2d", 4)

    def call(name, interpret, out_sharding, x, w, bias):
        if not registry.get(name).is_kernel:
            return reference_conv2d(
                x, w, bias=bias, activation=activation, stride=stride, padding=padding,
                dilation=dilation, feature_group_count=feature_group_count,
                data_format=data_format, precision=precision,
                preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        if data_format == "NCHW":
            x, w = x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0)
        wanted = partition.requested(out_sharding, 4)
        static = _Static(name, interpret, config, precision, geometry, out_dtype,
                         None if wanted is None else (tuple(wanted[d] for d in nhwc),), epilogue,
                         _targets.program_device())
        out = _jitted_conv(*partition.match_varying(x, w, bias), static)
        out = out.transpose(0, 3, 1, 2) if data_format == "NCHW" else out
        return partition.constrain(out, out_sharding)

    return _dispatch.run("conv2d", implementation, interpret, checks, call, x, w, bias,
                         config=config, out_sharding=out_sharding, empty=problem.is_empty,
                         dtype=x.dtype)
