"""The epilogue matmul and conv2d kernels fuse (`reference.epilogue` defines it):
`activation(acc + bias) + residual` on the float32 (float64) accumulator tile, before the one
rounding and the one store.

`apply` is written in operations every backend lowers (Triton has no erf: `_erfc` is a
Chebyshev fit of fractional error below 1.2e-7 everywhere, Numerical Recipes' `erfcc`), so one
function serves the Triton and Mosaic kernels on their tiles and XLA where the epilogue runs
after a reduction (split-K partials, a contraction sharded over a mesh). A float64 gelu is
declined by the kernels: the fit is float32-accurate only.

Training keeps the pre-activation z = acc + bias: a kernel with `Epilogue.saved` set writes it
beside the output, and the backward computes dz = g·activation'(z) once in XLA (`gradients`),
one memory-bound pass that also yields dbias. Both follow the reference's rule
(`reference.epilogue.layer`): a 16-bit layer saves z and passes dz to the two gradient products
in its own dtype, so they are 16-bit products (no float32 operand copy, half the bytes of z);
a float32 layer keeps both in float32.
Fused instead into the two backward GEMMs' operand loads, the derivative (about 20 flops an
element on the CUDA cores for gelu) would be recomputed for every tile that reads dz, costing
about as much time as the GEMMs' tensor-core work.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kernels.partition.shardings import like
from kernels.reference.epilogue import ACTIVATIONS, accumulator_dtype, sixteen_bit

__all__ = ["Epilogue", "on_accumulator", "apply_after_sum", "saved_dtype", "gradients",
           "require_supported",
           "operands", "split_refs", "out_shapes"]

# erfc(t) = τ·exp(-t² + P(τ)) with τ = 1 / (1 + t/2), t >= 0; P's coefficients, lowest first.
_ERFC_COEFFICIENTS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                      -1.13520398, 1.48851587, -0.82215223, 0.17087277)


class Epilogue(NamedTuple):
    """What a kernel applies to its accumulator (hashable: part of a kernel's problem).

    has_bias: a (features,) operand is added along the output's last (channel) dim.
    has_residual: an operand of the output's shape is added after the activation.
    saved: the dtype in which the pre-activation z is written as a second output (training
      with an activation), or None.
    """

    activation: str | None = None
    has_bias: bool = False
    has_residual: bool = False
    saved: Any = None

    @property
    def is_identity(self) -> bool:
        return self.activation is None and not self.has_bias and not self.has_residual

    @property
    def num_outputs(self) -> int:
        return 1 if self.saved is None else 2

    def bytes_per_output(self, out_dtype: Any) -> int:
        """Bytes a kernel moves per output element: the output, the residual it reads
        (counted at the output's width, into which its dtype promotes) and the pre-activation
        it saves; the bias, a vector, is left out."""
        out = jnp.dtype(out_dtype).itemsize
        return (out * (1 + self.has_residual)
                + (0 if self.saved is None else jnp.dtype(self.saved).itemsize))


def operands(bias: jax.Array | None, residual: jax.Array | None) -> list[jax.Array]:
    """The epilogue's operands a kernel takes after its inputs, in `split_refs`' order."""
    return [x for x in (bias, residual) if x is not None]


def split_refs(refs: Any, epilogue: Epilogue, num_inputs: int) -> tuple[list, Any, Any, Any, Any]:
    """A kernel's refs (inputs, bias, residual, output, saved z) as `operands` and
    `Epilogue.num_outputs` lay them out; absent ones are None."""
    refs = list(refs)
    inputs, rest = refs[:num_inputs], refs[num_inputs:]
    bias = rest.pop(0) if epilogue.has_bias else None
    residual = rest.pop(0) if epilogue.has_residual else None
    return inputs, bias, residual, rest[0], rest[1] if epilogue.saved is not None else None


def out_shapes(shape: tuple[int, ...], dtype: Any, epilogue: Epilogue) -> Any:
    """A kernel's out_shape: the output, and z where the epilogue saves it."""
    out = jax.ShapeDtypeStruct(shape, dtype)
    if epilogue.saved is None:
        return out
    return out, jax.ShapeDtypeStruct(shape, epilogue.saved)


def _erfc(x: jax.Array) -> jax.Array:
    t = jnp.abs(x)
    tau = 1 / (1 + 0.5 * t)
    poly = jnp.full_like(x, _ERFC_COEFFICIENTS[-1])
    for c in _ERFC_COEFFICIENTS[-2::-1]:
        poly = c + tau * poly
    tail = tau * jnp.exp(-t * t + poly)
    return jnp.where(x >= 0, tail, 2 - tail)


def _activate(z: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return z
    if activation == "relu":
        return jnp.maximum(z, jnp.zeros_like(z))
    if activation == "gelu":
        return 0.5 * z * _erfc(z * -math.sqrt(0.5))
    if activation == "gelu_tanh":
        return 0.5 * z * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z * z * z)))
    if activation == "silu":
        return z / (1 + jnp.exp(-z))
    raise AssertionError(activation)


def on_accumulator(acc: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
                   epilogue: Epilogue) -> tuple[jax.Array, jax.Array]:
    """(output, pre-activation) in `acc`'s dtype: `bias` broadcasts along the last dim
    (a tile of it, or the whole vector), `residual` is a tile of the output's shape."""
    if bias is not None:
        bias = bias.reshape((1,) * (acc.ndim - bias.ndim) + bias.shape)
    z = acc if bias is None else acc + bias.astype(acc.dtype)
    y = _activate(z, epilogue.activation)
    if residual is not None:
        y = y + residual.astype(acc.dtype)
    return y, z


def apply_after_sum(acc: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
                    epilogue: Epilogue, out_dtype: Any, bias_axis: int = -1
                    ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`on_accumulator` in XLA on a summed accumulator (split-K, a sharded contraction), rounded to
    the kernel's outputs: y in `out_dtype`, and z where `epilogue.saved`."""
    if bias is not None:
        axis = bias_axis % acc.ndim
        bias = bias.reshape((1,) * axis + (-1,) + (1,) * (acc.ndim - 1 - axis))
    y, z = on_accumulator(acc, bias, residual, epilogue)
    if epilogue.saved is None:
        return y.astype(out_dtype)
    return y.astype(out_dtype), z.astype(epilogue.saved)


def saved_dtype(x_dtype: Any, w_dtype: Any, out_dtype: Any) -> jnp.dtype:
    """The dtype a training forward saves z in: a 16-bit layer's own (its operands'), else the
    accumulator's (`reference.epilogue.layer`)."""
    return sixteen_bit(x_dtype, w_dtype) or accumulator_dtype(x_dtype, w_dtype, out_dtype)


def gradients(epilogue: Epilogue, g: Any, z: jax.Array | None, bias: jax.Array | None,
              residual: jax.Array | None, operand_dtypes: tuple[Any, ...] = ()
              ) -> tuple[jax.Array, Any, Any]:
    """(dZ, dbias, dresidual) from the cotangent g of the output (a pair with z's where the
    forward returned z). dZ is g itself without an activation, else g·activation'(z) by JAX's
    own derivative, in float32 (float64); for a layer of 16-bit operands (`operand_dtypes`,
    `reference.epilogue.sixteen_bit`) with an epilogue it is then rounded to their dtype, as
    the reference's gradient rounds it. dbias is summed in float32 over every dim but the last
    (the features), from the unrounded dZ; dresidual is g. On Explicit
    axes dbias and dresidual are typed like their primals (a replicated bias of a
    column-parallel layer, a residual sharded unlike the output), as JAX's own gradient types
    them: dZ has the output's sharding, which neither need share."""
    g_y, g_z = g if epilogue.saved is not None else (g, None)
    dz = g_y
    if epilogue.activation is not None:
        acc = accumulator_dtype(g_y.dtype, z.dtype)
        _, vjp = jax.vjp(ACTIVATIONS[epilogue.activation], z.astype(acc))
        dz = vjp(g_y.astype(acc))[0]
        dz = dz if g_z is None else dz + g_z.astype(acc)
    dbias = None
    if bias is not None:
        summed = jnp.sum(dz.astype(accumulator_dtype(dz.dtype)), axis=tuple(range(dz.ndim - 1)))
        dbias = like(summed.astype(bias.dtype), bias)
    sixteen = None if epilogue.is_identity else sixteen_bit(*operand_dtypes)
    dz = dz if sixteen is None else dz.astype(sixteen)
    return dz, dbias, None if residual is None else like(g_y.astype(residual.dtype), residual)


def require_supported(epilogue: Epilogue, *dtypes: Any) -> None:
    """Declines (NotImplementedError, so a sequence falls through to `xla`) an epilogue the
    kernels cannot apply to these dtypes: a float64 gelu (`_erfc` is float32-accurate)."""
    if epilogue.activation == "gelu" and any(jnp.dtype(d) == jnp.float64 for d in dtypes):
        raise NotImplementedError("the kernels' gelu (erf) is float32-accurate; a float64 gelu "
                                  "runs in xla")

