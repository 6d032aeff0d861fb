"""The meaning of `kernels.conv2d`: `lax.conv_general_dilated` on 2-D images.

The argument normalization here (`geometry`: stride, dilation and every padding form turned into
explicit pairs, with the validation that names a bad argument) is the one both the reference and
the kernels use, so they cannot disagree on what "SAME" means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import epilogue

DATA_FORMATS = {"NHWC": "HWIO", "NCHW": "OIHW"}
PADDING_STRINGS = ("SAME", "VALID", "SAME_LOWER")

Pair = tuple[int, int]
Padding = tuple[Pair, Pair]


class Geometry(NamedTuple):
    """A 2-D convolution's window arithmetic, every field a per-axis (rows, columns) pair.

    Output pixel (oh, ow) and kernel tap (kh, kw) read the input at position
    `oh * stride + kh * rhs_dilation - padding_lo` of the input dilated by `lhs_dilation`
    (lhs_dilation - 1 zeros between pixels); positions outside it, or between its pixels, read
    zero. The public op has lhs_dilation 1; the input gradient is a convolution with
    lhs_dilation = the forward stride. Padding may be negative (it crops).
    """

    stride: Pair
    padding: Padding
    lhs_dilation: Pair
    rhs_dilation: Pair
    groups: int


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def normalize_pair(name: str, value: Any) -> Pair:
    """`stride`/`dilation`: an int or a pair of ints, each >= 1."""
    if _is_int(value):
        pair = (int(value), int(value))
    elif (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
          and all(_is_int(v) for v in value)):
        pair = (int(value[0]), int(value[1]))
    else:
        raise TypeError(f"conv2d: {name} must be an int or a pair of ints, got {value!r}")
    if min(pair) < 1:
        raise ValueError(f"conv2d: {name} must be >= 1, got {value!r}")
    return pair


def dilated_size(size: int, dilation: int) -> int:
    return 0 if size == 0 else (size - 1) * dilation + 1


def normalize_padding(padding: Any, in_hw: Pair, window_hw: Pair, stride: Pair,
                      dilation: Pair) -> Padding:
    """Every padding form the ops take (docs/design.md) as ((top, bottom), (left, right)).

    "SAME"/"VALID"/"SAME_LOWER" (any case) follow `lax.padtype_to_pads`, so "SAME" accounts
    for the stride and the dilated window exactly as `lax.conv_general_dilated` does.
    """
    if isinstance(padding, str):
        if padding.upper() not in PADDING_STRINGS:
            raise ValueError(f"conv2d: padding must be one of {PADDING_STRINGS}, an int, a pair "
                             f"of ints or ((top, bottom), (left, right)), got {padding!r}")
        window = tuple(dilated_size(k, d) for k, d in zip(window_hw, dilation))
        pads = lax.padtype_to_pads(in_hw, window, stride, padding.upper())
        return tuple((int(lo), int(hi)) for lo, hi in pads)
    if _is_int(padding):
        return ((int(padding),) * 2,) * 2
    if isinstance(padding, Sequence) and len(padding) == 2:
        if all(_is_int(p) for p in padding):
            return tuple((int(p), int(p)) for p in padding)
        if all(isinstance(p, Sequence) and len(p) == 2 and all(_is_int(v) for v in p)
               for p in padding):
            return tuple((int(lo), int(hi)) for lo, hi in padding)
    raise ValueError(f"conv2d: padding must be one of {PADDING_STRINGS}, an int, a pair of ints "
                     f"or ((top, bottom), (left, right)), got {padding!r}")


def output_size(size: int, window: int, stride: int, padding: Pair, lhs_dilation: int,
                rhs_dilation: int) -> int:
    """Output length along one axis, as `lax.conv_general_dilated` computes it (>= 0)."""
    padded = dilated_size(size, lhs_dilation) + padding[0] + padding[1]
    return max(0, (padded - dilated_size(window, rhs_dilation)) // stride + 1)


def geometry(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride: Any, padding: Any,
             dilation: Any, feature_group_count: Any, data_format: Any) -> Geometry:
    """Validates the arguments of `conv2d` and returns its `Geometry` (lhs_dilation 1).

    Raises ValueError/TypeError naming the argument and the value.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"conv2d: data_format must be 'NHWC' or 'NCHW', got {data_format!r}")
    kernel_format = DATA_FORMATS[data_format]
    for name, shape, fmt in (("x", x_shape, data_format), ("w", w_shape, kernel_format)):
        if len(shape) != 4:
            raise ValueError(f"conv2d: {name} must have rank 4 ({fmt}), got shape {shape}")
    stride = normalize_pair("stride", stride)
    dilation = normalize_pair("dilation", dilation)
    if not _is_int(feature_group_count):
        raise TypeError(f"conv2d: feature_group_count must be an int, got "
                        f"{feature_group_count!r}")
    groups = int(feature_group_count)
    if groups < 1:
        raise ValueError(f"conv2d: feature_group_count must be >= 1, got {groups}")
    x_dims = dict(zip(data_format, x_shape))
    w_dims = dict(zip(kernel_format, w_shape))
    channels, in_per_group, out_channels = x_dims["C"], w_dims["I"], w_dims["O"]
    if channels % groups:
        raise ValueError(f"conv2d: feature_group_count={groups} must divide the input channels "
                         f"{channels} (x shape {x_shape})")
    if out_channels % groups:
        raise ValueError(f"conv2d: feature_group_count={groups} must divide the output channels "
                         f"{out_channels} (w shape {w_shape})")
    if channels != in_per_group * groups:
        raise ValueError(f"conv2d: x has {channels} channels (shape {x_shape}, {data_format}) but "
                         f"w ({kernel_format}, shape {w_shape}) expects {in_per_group} per group "
                         f"x feature_group_count={groups} = {in_per_group * groups}")
    in_hw = (x_dims["H"], x_dims["W"])
    pads = normalize_padding(padding, in_hw, (w_dims["H"], w_dims["W"]), stride, dilation)
    return Geometry(stride, pads, (1, 1), dilation, groups)


def conv2d(
    x: jax.Array,
    w: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    stride: int | Pair = 1,
    padding: Any = "SAME",
    dilation: int | Pair = 1,
    feature_group_count: int = 1,
    data_format: str = "NHWC",
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.conv_general_dilated` with kernel "HWIO" for "NHWC" and "OIHW" for "NCHW".

    Mixed input dtypes are promoted with `jnp.result_type` first (lax itself requires equal
    dtypes). `out_sharding`: the result's sharding, as `lax.conv_general_dilated` takes it.
    With `bias` (output features) or `activation`: `activation(conv + bias)`, the convolution
    kept in float32 (float64) until the one rounding, and a 16-bit layer's gradient keeping z
    and dZ in its dtype (`epilogue.layer`).
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    g = geometry(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation,
                 feature_group_count=feature_group_count, data_format=data_format)
    dtype = jnp.result_type(x, w)
    out_dtype = epilogue.result_dtype(preferred_element_type or dtype, bias, None)

    def convolution(x, w, preferred):
        return lax.conv_general_dilated(
            x.astype(dtype), w.astype(dtype), window_strides=g.stride, padding=g.padding,
            rhs_dilation=g.rhs_dilation,
            dimension_numbers=(data_format, DATA_FORMATS[data_format], data_format),
            feature_group_count=g.groups, precision=precision,
            preferred_element_type=preferred or preferred_element_type,
            out_sharding=out_sharding)

    if epilogue.is_identity(bias, activation):
        return convolution(x, w, None)
    return epilogue.layer(convolution, x, w, bias, activation, None, out_dtype,
                          bias_axis=data_format.index("C"))
