"""Flax Linen layers on `kernels`' ops: drop-ins for `flax.linen.Dense`, `Conv`, `LayerNorm`,
`RMSNorm` and `Embed` (see `kernels.flax` for what they share with Flax's and what they do not
take). Each is Flax's own module with the fields `implementation`, `interpret` and
`out_sharding` (the sharding of the layer's output, given to its op) added:

    from kernels.flax import linen as knn
    layer = knn.Dense(128, implementation="triton")
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from kernels import flax as common

__all__ = ["Dense", "Conv", "LayerNorm", "RMSNorm", "Embed"]


class _KernelOp:
    """What every layer adds: the fields `implementation`, `interpret` and `out_sharding` (each
    layer declares them: Linen makes fields of a module's own annotations) and, for Dense and
    Conv, the op handed to Flax's own `__call__` in place of the field named in `_replaces`."""

    _replaces: ClassVar[tuple[str, type] | None] = None

    def __post_init__(self) -> None:
        # Still inside construction: Linen freezes the module in its own __post_init__.
        object.__setattr__(self, "implementation", common.as_implementation(self.implementation))
        if self._replaces is not None:
            name, op = self._replaces
            if not isinstance(getattr(self, name), op):  # else a clone of a built layer
                if getattr(self, name) is not None or getattr(self, f"{name}_cls") is not None:
                    raise TypeError(
                        f"kernels.flax.linen.{type(self).__name__}: {name} is what this layer "
                        "replaces with kernels' op; use Flax's layer for a custom one")
                object.__setattr__(self, name, op(self.implementation, self.interpret,
                                                  self.out_sharding))
        super().__post_init__()


class Dense(_KernelOp, nn.Dense):
    """`flax.linen.Dense` whose product is `kernels.matmul`, its bias added in the kernel."""

    implementation: common.Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None
    _replaces = ("dot_general", common.MatmulDotGeneral)

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return common.dense(self, inputs, kernel, bias)


class Conv(_KernelOp, nn.Conv):
    """`flax.linen.Conv` whose convolution is `kernels.conv2d` (1-D and 2-D kernels), its bias
    added in the kernel."""

    implementation: common.Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None
    _replaces = ("conv_general_dilated", common.Conv2dGeneralDilated)

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        flax_call = nn.Conv.__call__.__wrapped__  # Flax's own code, in this call's scope
        if not self.use_bias:
            return flax_call(self, inputs)
        # The dtype Flax promotes inputs, kernel and bias (both param_dtype) to together.
        dtype = self.promote_dtype(*(jnp.zeros((), d) for d in (
            inputs.dtype, self.param_dtype, self.param_dtype)), dtype=self.dtype)[0].dtype

        def conv(*args: Any, **kwargs: Any) -> jax.Array:
            # Created where Flax creates it, after the kernel: the same parameter order.
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            return self.conv_general_dilated(*args, bias=bias.astype(dtype), **kwargs)

        return flax_call(common.BiasInConvolution(self, dtype, conv), inputs)


class _Normalization(_KernelOp):
    """LayerNorm's and RMSNorm's call (inside their compact `__call__`): the scale and bias
    Flax's layers create (feature-shaped, in param_dtype), Flax's result dtype (`dtype`, else
    the promotion of the input and the parameters), `kernels.normalize`."""

    def _normalize(self, x: jax.Array, mask: jax.Array | None, use_bias: bool,
                   subtract_mean: bool, residual: jax.Array | None
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
        axes = (self.feature_axes,) if isinstance(self.feature_axes, int) else self.feature_axes
        features = [x.shape[a] for a in sorted(a % x.ndim for a in axes)]
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if use_bias else None)
        out_dtype = self.dtype if self.dtype is not None else jnp.result_type(
            *(a for a in (x, scale, bias) if a is not None))
        return common.normalize(
            x, scale, bias, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
            epsilon=self.epsilon, subtract_mean=subtract_mean, out_dtype=out_dtype,
            layer=type(self).__name__, implementation=self.implementation,
            interpret=self.interpret, axis_name=self.axis_name, mask=mask, residual=residual,
            out_sharding=self.out_sharding)


class LayerNorm(_Normalization, nn.LayerNorm):
    """`flax.linen.LayerNorm` computed by `kernels.layer_norm`."""

    implementation: common.Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None,
                 residual: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        """With `residual`: `(layer(x + residual), x + residual)`, from one fused kernel."""
        return self._normalize(x, mask, self.use_bias, True, residual)


class RMSNorm(_Normalization, nn.RMSNorm):
    """`flax.linen.RMSNorm` computed by `kernels.rms_norm`."""

    implementation: common.Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None,
                 residual: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        """With `residual`: `(layer(x + residual), x + residual)`, from one fused kernel."""
        return self._normalize(x, mask, False, False, residual)


class Embed(_KernelOp, nn.Embed):
    """`flax.linen.Embed` whose lookup is `kernels.gather` with `mode` for out-of-range ids
    ("fill", Flax's NaN rows, by default) and whose `attend` is `kernels.matmul`
    (`out_sharding` is the lookup's: the logits of `attend` have other dims)."""

    mode: str | None = "fill"
    implementation: common.Implementation = None
    interpret: bool | str | None = None
    out_sharding: Any = None

    def __call__(self, inputs: jax.Array) -> jax.Array:
        (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return common.embed(embedding, inputs, mode=self.mode, out_sharding=self.out_sharding,
                            implementation=self.implementation, interpret=self.interpret)

    def attend(self, query: jax.Array) -> jax.Array:
        query, embedding = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        return common.attend(query, embedding, implementation=self.implementation,
                             interpret=self.interpret)
