"""Flax Linen layers on `kernels`' ops: drop-ins for `flax.linen.Dense`, `Conv`, `LayerNorm`,
`RMSNorm` and `Embed` (see `kernels.flax` for what they share with Flax's and what they do not
take). Each is Flax's own module with the fields `implementation` and `interpret` added:

    from kernels.flax import linen as knn
    layer = knn.Dense(128, implementation="triton")
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from kernels import flax as common

__all__ = ["Dense", "Conv", "LayerNorm", "RMSNorm", "Embed"]


class _KernelOp:
    """The two fields every layer adds, and the op a Dense/Conv hands Flax's own `__call__`
    in place of its `dot_general`/`conv_general_dilated` field."""

    implementation: common.Implementation = None
    interpret: bool | None = None

    def _replace_field(self, name: str, op: type) -> None:
        if isinstance(getattr(self, name), op):  # a clone of a layer built before
            return
        if getattr(self, name) is not None or getattr(self, f"{name}_cls") is not None:
            raise TypeError(f"kernels.flax.linen.{type(self).__name__}: {name} is what this "
                            "layer replaces with kernels' op; use Flax's layer for a custom one")
        # Still inside construction: Linen freezes the module in its own __post_init__.
        object.__setattr__(self, "implementation", common.as_implementation(self.implementation))
        object.__setattr__(self, name, op(self.implementation, self.interpret))


class Dense(_KernelOp, nn.Dense):
    """`flax.linen.Dense` whose product is `kernels.matmul`."""

    implementation: common.Implementation = None
    interpret: bool | None = None

    def __post_init__(self) -> None:
        self._replace_field("dot_general", common.MatmulDotGeneral)
        super().__post_init__()


class Conv(_KernelOp, nn.Conv):
    """`flax.linen.Conv` whose convolution is `kernels.conv2d` (1-D and 2-D kernels)."""

    implementation: common.Implementation = None
    interpret: bool | None = None

    def __post_init__(self) -> None:
        self._replace_field("conv_general_dilated", common.Conv2dGeneralDilated)
        super().__post_init__()


def _normalization_params(module: nn.Module, x: jax.Array, use_bias: bool):
    """The scale and bias Flax's LayerNorm/RMSNorm create: feature-shaped, in param_dtype."""
    features = [x.shape[a] for a in sorted(a % x.ndim for a in (
        (module.feature_axes,) if isinstance(module.feature_axes, int) else module.feature_axes))]
    scale = (module.param("scale", module.scale_init, features, module.param_dtype)
             if module.use_scale else None)
    bias = (module.param("bias", module.bias_init, features, module.param_dtype)
            if use_bias else None)
    return scale, bias


def _out_dtype(dtype: Any, *arrays: jax.Array | None) -> Any:
    """Flax's result dtype: `dtype`, else the promotion of the input and the parameters."""
    return dtype if dtype is not None else jnp.result_type(*(a for a in arrays if a is not None))


class LayerNorm(_KernelOp, nn.LayerNorm):
    """`flax.linen.LayerNorm` computed by `kernels.layer_norm`."""

    implementation: common.Implementation = None
    interpret: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        scale, bias = _normalization_params(self, x, self.use_bias)
        return common.normalize(
            x, scale, bias, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            epsilon=self.epsilon, subtract_mean=True,
            out_dtype=_out_dtype(self.dtype, x, scale, bias), layer="LayerNorm",
            implementation=common.as_implementation(self.implementation),
            interpret=self.interpret, axis_name=self.axis_name, mask=mask)


class RMSNorm(_KernelOp, nn.RMSNorm):
    """`flax.linen.RMSNorm` computed by `kernels.rms_norm`."""

    implementation: common.Implementation = None
    interpret: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        scale, _ = _normalization_params(self, x, False)
        return common.normalize(
            x, scale, None, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            epsilon=self.epsilon, subtract_mean=False, out_dtype=_out_dtype(self.dtype, x, scale),
            layer="RMSNorm", implementation=common.as_implementation(self.implementation),
            interpret=self.interpret, axis_name=self.axis_name, mask=mask)


class Embed(_KernelOp, nn.Embed):
    """`flax.linen.Embed` whose lookup is `kernels.gather` with `mode` for out-of-range ids
    ("fill", Flax's NaN rows, by default) and whose `attend` is `kernels.matmul`."""

    mode: str | None = "fill"
    implementation: common.Implementation = None
    interpret: bool | None = None

    def __call__(self, inputs: jax.Array) -> jax.Array:
        (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return common.embed(embedding, inputs, mode=self.mode,
                            implementation=common.as_implementation(self.implementation),
                            interpret=self.interpret)

    def attend(self, query: jax.Array) -> jax.Array:
        query, embedding = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        return common.attend(query, embedding,
                             implementation=common.as_implementation(self.implementation),
                             interpret=self.interpret)
