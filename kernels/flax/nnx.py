"""Flax NNX layers on `kernels`' ops: drop-ins for `flax.nnx.Linear`, `Conv`, `LayerNorm`,
`RMSNorm` and `Embed` (see `kernels.flax` for what they share with Flax's and what they do not
take). Each is Flax's own class with `implementation=` and `interpret=` added:

    from kernels.flax import nnx as knnx
    layer = knnx.Linear(784, 128, rngs=nnx.Rngs(0), implementation="triton")
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from kernels import flax as common

__all__ = ["Linear", "Conv", "LayerNorm", "RMSNorm", "Embed"]


def _replaced(kwargs: dict[str, Any], name: str, layer: str) -> None:
    if name in kwargs:
        raise TypeError(f"kernels.flax.nnx.{layer}: {name} is what this layer replaces with "
                        f"kernels' op; use flax.nnx.{layer} for a custom one")


class Linear(nnx.Linear):
    """`flax.nnx.Linear` whose product is `kernels.matmul`, its bias added in the kernel."""

    def __init__(self, in_features: int, out_features: int, *,
                 implementation: common.Implementation = None, interpret: bool | str | None = None,
                 **kwargs: Any):
        _replaced(kwargs, "dot_general", "Linear")
        super().__init__(in_features, out_features, **kwargs, dot_general=common.MatmulDotGeneral(
            common.as_implementation(implementation), interpret))

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias),
                                                  dtype=self.dtype)
        return common.dense(self, inputs, kernel, bias, out_sharding=out_sharding,
                            preferred_element_type=self.preferred_element_type)


class Conv(nnx.Conv):
    """`flax.nnx.Conv` whose convolution is `kernels.conv2d` (1-D and 2-D kernels), its bias
    added in the kernel."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int | Any,
                 strides: Any = 1, *, implementation: common.Implementation = None,
                 interpret: bool | str | None = None, **kwargs: Any):
        _replaced(kwargs, "conv_general_dilated", "Conv")
        super().__init__(in_features, out_features, kernel_size, strides, **kwargs,
                         conv_general_dilated=common.Conv2dGeneralDilated(
                             common.as_implementation(implementation), interpret))

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        if self.bias is None:
            return super().__call__(inputs, out_sharding=out_sharding)
        bias = self.bias[...]
        dtype = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)[0].dtype
        conv = functools.partial(self.conv_general_dilated, bias=bias.astype(dtype))
        return nnx.Conv.__call__(common.BiasInConvolution(self, dtype, conv), inputs,
                                 out_sharding=out_sharding)


class _KernelOptions:
    """`implementation` and `interpret`, kept on the layer for its op (static attributes)."""

    def _set_options(self, implementation: Any, interpret: bool | str | None) -> None:
        self.implementation = common.as_implementation(implementation)
        self.interpret = interpret


class _Normalization(_KernelOptions):
    """LayerNorm's and RMSNorm's call: Flax's parameters and promotion, `kernels.normalize`."""

    def _normalize(self, x: jax.Array, mask: jax.Array | None, subtract_mean: bool,
                   residual: jax.Array | None, out_sharding: Any
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if getattr(self, "bias", None) is not None else None
        promoted, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return common.normalize(
            x, scale, bias, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            epsilon=self.epsilon, subtract_mean=subtract_mean, out_dtype=promoted.dtype,
            layer=type(self).__name__, implementation=self.implementation,
            interpret=self.interpret, axis_name=self.axis_name, mask=mask, residual=residual,
            input_dtype=promoted.dtype, out_sharding=out_sharding)


class LayerNorm(_Normalization, nnx.LayerNorm):
    """`flax.nnx.LayerNorm` computed by `kernels.layer_norm`."""

    def __init__(self, num_features: int, *, implementation: common.Implementation = None,
                 interpret: bool | str | None = None, **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self._set_options(implementation, interpret)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None,
                 residual: jax.Array | None = None, out_sharding: Any = None
                 ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """With `residual`: `(layer(x + residual), x + residual)`, from one fused kernel;
        `out_sharding` is the layer's output's (the sum keeps x's)."""
        return self._normalize(x, mask, True, residual, out_sharding)


class RMSNorm(_Normalization, nnx.RMSNorm):
    """`flax.nnx.RMSNorm` computed by `kernels.rms_norm`."""

    def __init__(self, num_features: int, *, implementation: common.Implementation = None,
                 interpret: bool | str | None = None, **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self._set_options(implementation, interpret)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None,
                 residual: jax.Array | None = None, out_sharding: Any = None
                 ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """With `residual`: `(layer(x + residual), x + residual)`, from one fused kernel;
        `out_sharding` is the layer's output's (the sum keeps x's)."""
        return self._normalize(x, mask, False, residual, out_sharding)


class Embed(_KernelOptions, nnx.Embed):
    """`flax.nnx.Embed` whose lookup is `kernels.gather` with `mode` for out-of-range ids
    ("fill", Flax's NaN rows, by default; "clip", "drop", "wrap", "promise_in_bounds") and
    whose `attend` is `kernels.matmul`."""

    def __init__(self, num_embeddings: int, features: int, *, mode: str | None = "fill",
                 implementation: common.Implementation = None, interpret: bool | str | None = None,
                 **kwargs: Any):
        super().__init__(num_embeddings, features, **kwargs)
        self.mode = mode
        self._set_options(implementation, interpret)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype,
                                          inexact=False)
        return common.embed(embedding, inputs, mode=self.mode, out_sharding=out_sharding,
                            implementation=self.implementation, interpret=self.interpret)

    def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return common.attend(query, embedding, out_sharding=out_sharding,
                             implementation=self.implementation, interpret=self.interpret)
