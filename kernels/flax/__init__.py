"""Drop-in Flax layers whose arithmetic runs on `kernels`' ops (the `flax` extra).

`kernels.flax.nnx` (`Linear`, `Conv`, `LayerNorm`, `RMSNorm`, `Embed`) and `kernels.flax.linen`
(`Dense`, `Conv`, `LayerNorm`, `RMSNorm`, `Embed`) subclass Flax's own layers: the constructor
arguments, parameter names, shapes, dtypes, initializers and dtype promotion are Flax's, so a
checkpoint of either loads into the other. Each adds `implementation=` and `interpret=` (passed
to the op, as everywhere in `kernels`), and `Embed` adds `mode=` for out-of-range ids
(default "fill", NaN rows: what Flax's `jnp.take` gives). Every layer takes `out_sharding`, which
it hands to its op: NNX layers as a call argument, as Flax's NNX Linear, Conv and Embed take it
(LayerNorm and RMSNorm too), Linen layers as a field, Linen's way of configuring a layer (Flax's
Linen layers take none).

Linear/Dense and Conv keep Flax's own `__call__` and replace only the product it calls
(`dot_general`, `conv_general_dilated`) with `kernels.matmul` / `kernels.conv2d`; so bias,
masks, circular and causal padding and batch flattening are Flax's code. The normalizations and
Embed compute their whole result with `kernels.layer_norm`, `kernels.rms_norm` and
`kernels.gather`.

What Flax offers that these do not (each raises an error naming the argument):
- Conv: `input_dilation` (transposed-convolution style lhs dilation) and 3-D convolutions
  (`kernels.conv2d` is 2-D; 1-D convolutions run as 2-D ones of height 1);
- Linear/Dense, Conv: a custom `dot_general` / `conv_general_dilated` (the point of these
  layers is to replace them);
- LayerNorm, RMSNorm: `axis_name`/`axis_index_groups` (statistics across devices), `mask`, and
  `feature_axes` outside `reduction_axes`. `use_fast_variance` is accepted and has no effect:
  the kernels compute the variance as the mean squared deviation, the more accurate formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import kernels
from kernels import partition
from kernels._dtypes import promoted
from kernels.reference.normalize import statistics_dtype

Implementation = str | tuple[str, ...] | None


def as_implementation(implementation: Any) -> Implementation:
    """`implementation` as a hashable value (a list becomes a tuple): layers keep it as a static
    attribute, which jit caches on."""
    if isinstance(implementation, Sequence) and not isinstance(implementation, str):
        return tuple(implementation)
    return implementation


@dataclasses.dataclass(frozen=True)
class MatmulDotGeneral:
    """The `dot_general` Flax's Linear/Dense call, as `kernels.matmul` (which folds the inputs'
    batch dims into rows: one large product instead of a batched one). `out_sharding`: the
    Linen layer's field, where Flax's call passes none. `bias`: the layers' own calls pass
    theirs, added in the product's epilogue."""

    implementation: Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                 precision: Any = None, preferred_element_type: Any = None,
                 out_sharding: Any = None, bias: jax.Array | None = None) -> jax.Array:
        if rhs.ndim != 2 or tuple(map(tuple, dimension_numbers[0])) != ((lhs.ndim - 1,), (0,)) \
                or any(dimension_numbers[1]):
            raise NotImplementedError(
                "kernels.flax Linear: only the product of the last input axis with the kernel's "
                f"first, got dimension_numbers={dimension_numbers}")
        return kernels.matmul(lhs, rhs, bias=bias, precision=precision,
                              preferred_element_type=preferred_element_type,
                              out_sharding=self.out_sharding if out_sharding is None
                              else out_sharding,
                              implementation=self.implementation, interpret=self.interpret)


_CHANNELS_LAST = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}


@dataclasses.dataclass(frozen=True)
class Conv2dGeneralDilated:
    """The `conv_general_dilated` Flax's Conv calls, as `kernels.conv2d`: channels-last 2-D
    convolutions, and 1-D ones as 2-D of height 1."""

    implementation: Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None

    def __call__(self, lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
                 padding: Any, lhs_dilation: Sequence[int] | None = None,
                 rhs_dilation: Sequence[int] | None = None, dimension_numbers: Any = None,
                 feature_group_count: int = 1, batch_group_count: int = 1,
                 precision: Any = None, preferred_element_type: Any = None,
                 out_sharding: Any = None, bias: jax.Array | None = None) -> jax.Array:
        out_sharding = self.out_sharding if out_sharding is None else out_sharding
        spatial = lhs.ndim - 2
        if spatial not in _CHANNELS_LAST:
            raise NotImplementedError(
                f"kernels.flax Conv: kernel_size must have 1 or 2 dims (kernels.conv2d is 2-D), "
                f"got a {spatial}-D convolution")
        if dimension_numbers != lax.conv_dimension_numbers(lhs.shape, rhs.shape,
                                                           _CHANNELS_LAST[spatial]):
            raise NotImplementedError("kernels.flax Conv: channels-last inputs only, got "
                                      f"dimension_numbers={dimension_numbers}")
        if any(d != 1 for d in (lhs_dilation or ())):
            raise NotImplementedError(
                f"kernels.flax Conv: input_dilation must be 1, got {tuple(lhs_dilation)}")
        if batch_group_count != 1:
            raise NotImplementedError("kernels.flax Conv: batch_group_count must be 1")
        dilation = tuple(rhs_dilation or (1,) * spatial)
        strides = tuple(window_strides)
        if spatial == 1:  # a row of height 1: the kernel's single row, no padding along it
            lhs, rhs = lhs[:, None], rhs[None]
            strides, dilation = (1,) + strides, (1,) + dilation
            if not isinstance(padding, str):
                padding = ((0, 0),) + tuple(map(tuple, padding))
            sharding = partition.out_sharding(out_sharding, "kernels.flax Conv", 3)
            if sharding is not None:  # (N, W, O) as the 2-D output's (N, 1, W, O)
                spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
                out_sharding = NamedSharding(sharding.mesh, PartitionSpec(spec[0], None,
                                                                          *spec[1:]))
        out = kernels.conv2d(lhs, rhs, bias=bias, stride=strides, padding=padding,
                             dilation=dilation,
                             feature_group_count=feature_group_count, precision=precision,
                             preferred_element_type=preferred_element_type,
                             out_sharding=out_sharding, implementation=self.implementation,
                             interpret=self.interpret)
        return out[:, 0] if spatial == 1 else out


def dense(layer: Any, inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None,
          **options: Any) -> jax.Array:
    """Flax's Linear/Dense call on its promoted arrays, with the bias in the product's epilogue
    (one kernel, rounded once, where Flax adds it after the product)."""
    return layer.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                             precision=layer.precision, bias=bias, **options)


class BiasInConvolution:
    """A Flax Conv as its own `__call__` sees it with the bias moved into the convolution:
    `conv` adds it in the kernel's epilogue, so there is none to add after (`use_bias` False,
    `bias` None), and `dtype` is the one Flax promotes inputs, kernel and bias to together.
    Every other attribute (and, in Linen, `param`) is the layer's own: Flax's code runs as is,
    its padding modes, masks and batch flattening included."""

    def __init__(self, layer: Any, dtype: Any, conv: Callable[..., jax.Array]):
        self._layer, self.dtype, self.conv_general_dilated = layer, dtype, conv
        self.bias, self.use_bias = None, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _axes(rank: int, axes: int | Sequence[int]) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(sorted({a % rank for a in axes}))


def _as_reduced_shape(param: jax.Array | None, x_shape: tuple[int, ...],
                      reduction_axes: tuple[int, ...], feature_axes: tuple[int, ...]):
    """A scale or bias of the feature axes' shape (Flax's parameter) as the kernels take it:
    the shape of the normalized axes, broadcast over the reduced axes that are not features."""
    if param is None:
        return None
    shape = [x_shape[a] if a in feature_axes else 1 for a in reduction_axes]
    return jnp.broadcast_to(param.reshape(shape), [x_shape[a] for a in reduction_axes])


def normalize(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, *,
              reduction_axes: int | Sequence[int], feature_axes: int | Sequence[int],
              epsilon: float, subtract_mean: bool, out_dtype: Any, layer: str,
              implementation: Implementation, interpret: bool | str | None,
              axis_name: Any = None, mask: Any = None, residual: jax.Array | None = None,
              input_dtype: Any = None, out_sharding: Any = None
              ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flax's LayerNorm (`subtract_mean`) or RMSNorm of `x` with its feature-shaped `scale` and
    `bias`, by `kernels.normalize`, returned in `out_dtype`. `input_dtype`: the dtype Flax casts
    x to before normalizing (nnx: its promotion); by default (Linen) the wider of x's dtype and
    `out_dtype`, statistics in float32. With `residual`: the layer of `x + residual`, and that
    sum (`kernels.normalize`'s fused residual add). `out_sharding`: the layer's output's."""
    if axis_name is not None:
        raise NotImplementedError(f"kernels.flax {layer}: axis_name (statistics across devices) "
                                  "is not supported")
    if mask is not None:
        raise NotImplementedError(f"kernels.flax {layer}: mask is not supported")
    reduced, features = _axes(x.ndim, reduction_axes), _axes(x.ndim, feature_axes)
    if not set(features) <= set(reduced):
        raise NotImplementedError(
            f"kernels.flax {layer}: feature_axes {feature_axes} must be among reduction_axes "
            f"{reduction_axes}")
    if input_dtype is None:
        # Normalizing x in its own statistics dtype is normalizing it upcast, so the kernel
        # takes x as it is and rounds once to out_dtype (no copy of x cast, none of y); only a
        # float64 computation of narrower data casts x first.
        compute_dtype = promoted(x.dtype, out_dtype)
        same = statistics_dtype(compute_dtype) == statistics_dtype(x.dtype)
        input_dtype = x.dtype if same else compute_dtype
    if input_dtype != x.dtype:
        if residual is not None:  # the sum is in x's dtype: add it first, then the layer
            total = x + residual
            return normalize(total, scale, bias, reduction_axes=reduction_axes,
                             feature_axes=feature_axes, epsilon=epsilon,
                             subtract_mean=subtract_mean, out_dtype=out_dtype, layer=layer,
                             implementation=implementation, interpret=interpret,
                             input_dtype=input_dtype, out_sharding=out_sharding), total
        x = x.astype(input_dtype)
    return kernels.normalize(x, _as_reduced_shape(scale, x.shape, reduced, features),
                             _as_reduced_shape(bias, x.shape, reduced, features),
                             axis=reduced, epsilon=epsilon, subtract_mean=subtract_mean,
                             residual=residual, out_dtype=out_dtype, out_sharding=out_sharding,
                             implementation=implementation, interpret=interpret)


def embed(embedding: jax.Array, ids: jax.Array, *, mode: str | None,
          implementation: Implementation, interpret: bool | str | None,
          out_sharding: Any = None) -> jax.Array:
    """Flax's Embed lookup, by `kernels.gather` (Flax broadcasts a one-row table whatever the
    ids)."""
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError('Input type must be an integer or unsigned integer.')
    if embedding.shape[0] == 1:
        out = jnp.broadcast_to(embedding[0], ids.shape + embedding.shape[1:])
        return partition.constrain(out, partition.out_sharding(out_sharding, "kernels.flax Embed",
                                                               out.ndim))
    return kernels.gather(embedding, ids, axis=0, mode=mode, out_sharding=out_sharding,
                          implementation=implementation, interpret=interpret)


def attend(query: jax.Array, embedding: jax.Array, *, implementation: Implementation,
           interpret: bool | str | None, out_sharding: Any = None) -> jax.Array:
    """Flax's Embed.attend: the query against every embedding row, by `kernels.matmul`."""
    return kernels.matmul(query, embedding.T, out_sharding=out_sharding,
                          implementation=implementation, interpret=interpret)
