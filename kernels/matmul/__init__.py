"""`kernels.matmul`: `jnp.matmul` as tiled Pallas kernels, with a fused epilogue
(`activation(a @ b + bias) + residual`, `kernels._epilogue`) and kernel-computed gradients.

The public function validates its inputs, normalizes ranks (rank-1 operands become matrices;
batch dims of `a` fold into M when `b` is a plain matrix, the `x @ W` of every dense layer) and
routes to `_product`, a `custom_vjp` over batched products whose backward runs the same
implementation's kernel on transposed operand views: dA = dZ @ Bᵀ and dB = Aᵀ @ dZ, where
dZ = g·activation'(z) (g itself without an activation), in the layer's dtype for 16-bit
operands (`reference.epilogue.layer`). With an activation the training forward's kernel also
writes the pre-activation z (`Epilogue.saved`); dZ and dbias are one XLA pass over g and z; a
residual's gradient is g.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from kernels import reference
from kernels import _dispatch, _targets, partition, registry
from kernels._dtypes import promoted
from kernels._epilogue import Epilogue, gradients, saved_dtype
from kernels.reference.epilogue import accumulator_dtype
from kernels.registry import Op
from kernels.matmul import sharding
from kernels.matmul.common import MatmulConfig, make_problem
from kernels.reference import epilogue as epilogue_reference

__all__ = ["matmul", "MatmulConfig"]

OP = Op("matmul", reference.matmul, __name__, MatmulConfig, sharding)


class _Static(NamedTuple):
    """The hashable, non-differentiable arguments of `_product`."""

    implementation: str
    interpret: bool | str  # resolved by the dispatch: False, True or "strict"
    config: MatmulConfig | None
    precision: lax.PrecisionLike
    transpose_a: bool
    transpose_b: bool
    out_dtype: jnp.dtype
    # The mesh axes asked of the product's dims on Explicit axes (partition.Layout.requested):
    # a sharded K then reduce-scatters into them.
    requested: tuple[partition.Dims | None] | None = None
    epilogue: Epilogue = Epilogue()
    # The device the program is traced for (`_targets.program_device`), so that the backward,
    # traced later, is built for it too (`partition.partitioned`).
    device: Any = None


def _run_whole(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
               static: _Static) -> jax.Array | tuple[jax.Array, jax.Array]:
    p = make_problem(a, b, static.transpose_a, static.transpose_b, static.out_dtype,
                     static.epilogue, static.precision)
    return OP.module(static.implementation).matmul(a, b, bias, residual, p,
                                                   config=static.config,
                                                   precision=static.precision,
                                                   interpret=static.interpret)


# Each device runs the kernel on its blocks of a mesh-sharded product (see kernels.partition).
_run = partition.partitioned(_run_whole, sharding.rule, sharding.factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _product(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
             static: _Static) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The batched product with `static.epilogue`; (y, z) where the epilogue saves z."""
    return _run(a, b, bias, residual, static)


def _product_fwd(a, b, bias, residual, static):
    # Calls `_product`, not `_run`: higher-order differentiation goes through the forward too,
    # and it must meet this custom_vjp there, not a raw pallas_call.
    epilogue = static.epilogue
    if epilogue.activation is None or epilogue.saved is not None:
        out = _product(a, b, bias, residual, static)
        z = out[1] if epilogue.saved is not None else None
        return out, (a, b, bias, residual, z)
    saving = static._replace(epilogue=epilogue._replace(saved=saved_dtype(a.dtype, b.dtype,
                                                                         static.out_dtype)))
    y, z = _product(a, b, bias, residual, saving)
    return y, (a, b, bias, residual, z)


def _sum_to_batch(x: jax.Array, batch: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """Sums `x` over the batch dims that `batch` broadcast from 1 (a gradient's reduction)."""
    axes = tuple(d for d, size in enumerate(batch) if size == 1 and x.shape[d] != 1)
    return jnp.sum(x, axis=axes, keepdims=True).astype(dtype) if axes else x.astype(dtype)


def _gradient(lhs, rhs, transpose_lhs, transpose_rhs, static: _Static, like: jax.Array):
    """One backward product, summed over broadcast batch dims to the shape of `like`."""
    batch = like.shape[:-2]
    out_batch = np.broadcast_shapes(lhs.shape[:-2], rhs.shape[:-2])
    reduced = tuple(out_batch) != tuple(batch)
    # Broadcast batches are summed in the accumulator dtype, then rounded once.
    out_dtype = promoted(like.dtype, jnp.float32) if reduced else like.dtype
    # A gradient is asked for its primal's sharding: a contraction over a sharded dim then
    # reduce-scatters into it (on Explicit axes; XLA asks so itself on Auto axes).
    product = static._replace(config=None, transpose_a=transpose_lhs, transpose_b=transpose_rhs,
                              out_dtype=out_dtype, epilogue=Epilogue(),
                              requested=None if reduced else (partition.dims_of(like),))
    out = _product(lhs, rhs, None, None, product)
    return partition.like(_sum_to_batch(out, batch, like.dtype), like)


def _product_bwd(static: _Static, residuals, g):
    a, b, bias, residual, z = residuals
    g, dbias, dresidual = gradients(static.epilogue, g, z, bias, residual,  # g becomes dZ
                                    (a.dtype, b.dtype))
    if static.transpose_a:  # A is stored (K, M): dA = op(B) @ gᵀ
        da = _gradient(b, g, static.transpose_b, True, static, a)
    else:  # dA = g @ op(B)ᵀ
        da = _gradient(g, b, False, not static.transpose_b, static, a)
    if static.transpose_b:  # B is stored (N, K): dB = gᵀ @ op(A)
        db = _gradient(g, a, True, static.transpose_a, static, b)
    else:  # dB = op(A)ᵀ @ g
        db = _gradient(a, g, not static.transpose_a, False, static, b)
    return da, db, dbias, dresidual


_product.defvjp(_product_fwd, _product_bwd)
# Eager calls hit jit's cache instead of re-tracing and re-compiling the kernel each time.
_jitted_product = jax.jit(_product, static_argnums=-1)


def _validated(a: jax.Array, b: jax.Array, config: MatmulConfig | None,
               **epilogue: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    OP.validate(config, a=a, b=b, **{k: v for k, v in epilogue.items() if v is not None})
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if x.ndim < 1:
            raise ValueError(f"matmul: {name} must have rank >= 1, got shape {x.shape}")
    k_a, k_b = a.shape[-1], b.shape[0] if b.ndim == 1 else b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"matmul: contracting dims differ: a has shape {a.shape} (K={k_a}), "
                         f"b has shape {b.shape} (K={k_b})")
    try:
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"matmul: batch dims of a {a.shape[:-2]} and b {b.shape[:-2]} do not "
                         "broadcast") from None
    return a, b


def _folds(a: jax.Array, b: jax.Array) -> bool:
    """x @ W: a's batch dims fold into M when b is a plain matrix (or vector), unless a dim of
    a's rows after the first one longer than 1 is sharded (each device's rows would not be one
    block of M, a reshape JAX refuses on Explicit axes): the product is batched instead."""
    if b.ndim > 2 or a.ndim <= 2:
        return False
    return partition.mergeable(a.shape[:-1], partition.dims_of(a)[:-1])


def _result_shape(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, ...]:
    """`jnp.matmul`'s result shape: broadcast batch dims, then M and N where a and b have them."""
    batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    return (*batch, *a_shape[-2:-1] * (len(a_shape) > 1), *b_shape[-1:] * (len(b_shape) > 1))


def _as_batched_matrices(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """Reshapes (never copies) the operands to equal-rank batched matrices.

    Returns them and the shape the product must be reshaped to for `jnp.matmul`'s result.
    """
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    out_shape = _result_shape(a.shape, b.shape)
    if _folds(a, b):
        return a2.reshape(math.prod(a2.shape[:-1]), a2.shape[-1]), b2, out_shape
    rank = max(a2.ndim, b2.ndim)
    a2 = a2.reshape((1,) * (rank - a2.ndim) + a2.shape)
    b2 = b2.reshape((1,) * (rank - b2.ndim) + b2.shape)
    return a2, b2, out_shape


def _requested_product(dims: partition.Dims, a: jax.Array, b: jax.Array) -> partition.Dims:
    """The dims `dims` asked of `jnp.matmul(a, b)`'s result, as the batched product's: a rank-1
    operand's missing M or N asks nothing; folded batch dims ask their merge of M."""
    dims = list(dims)
    n = dims.pop() if b.ndim > 1 else ()
    m = dims.pop() if a.ndim > 1 else ()
    if _folds(a, b):
        return partition.merged(a.shape[:-1], [*dims, m]), n
    return (*dims, m, n)


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    residual: jax.Array | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jnp.dtype | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: MatmulConfig | None = None,
) -> jax.Array:
    """`activation(jnp.matmul(a, b, ...) + bias) + residual` as a Pallas kernel.

    Operands of rank >= 1 with broadcasting batch dims, any M, N, K, any float dtype (16-bit
    inputs accumulate in float32). The epilogue (docs/design.md) is applied to the float32
    accumulator in the kernel and rounded once: `bias` of shape (N,), `activation` one of None,
    "relu", "gelu", "gelu_tanh", "silu", `residual` broadcasting to the output; the result has
    the dtype jnp gives that formula. `out_sharding` as `jnp.matmul` takes it (on Explicit
    axes: a contraction over a sharded dim reduce-scatters into it). `implementation` and
    `interpret` choose the kernel as in docs/design.md; `config` sets block sizes (`None`
    picks them from the shapes).
    """
    a, b = _validated(a, b, config, bias=bias, residual=residual)
    if isinstance(precision, list):
        precision = tuple(precision)
    result_shape = _result_shape(a.shape, b.shape)
    epilogue_reference.check("matmul", result_shape, b.shape[-1] if b.ndim > 1 else None, bias,
                             activation, residual)
    bias = None if bias is None else jnp.asarray(bias)
    residual = None if residual is None else jnp.asarray(residual)
    product_dtype = jnp.dtype(preferred_element_type or jnp.result_type(a, b))
    out_dtype = epilogue_reference.result_dtype(product_dtype, bias, residual)
    epilogue = Epilogue(activation, has_bias=bias is not None, has_residual=residual is not None)
    a2, b2 = jax.eval_shape(lambda a, b: _as_batched_matrices(a, b)[:2], a, b)
    out_sharding = partition.out_sharding(out_sharding, "matmul", len(result_shape))
    problem = make_problem(a2, b2, False, False, out_dtype, epilogue, precision)
    checks = OP.checks(problem, config)

    def call(name, interpret, out_sharding, a, b, bias, residual):
        if not registry.get(name).is_kernel:
            return reference.matmul(a, b, bias=bias, activation=activation, residual=residual,
                                    precision=precision,
                                    preferred_element_type=preferred_element_type,
                                    out_sharding=out_sharding)
        a2, b2, out_shape = _as_batched_matrices(a, b)
        if residual is not None:  # laid out as the batched product's output
            if residual.shape != tuple(out_shape):  # JAX sums its gradient in this dtype
                residual = residual.astype(accumulator_dtype(residual.dtype))
            residual = jnp.broadcast_to(residual, out_shape).reshape(
                *problem.out_batch, problem.m, problem.n)
        dims = partition.requested(out_sharding, len(out_shape))
        static = _Static(name, interpret, config, precision, False, False, out_dtype,
                         None if dims is None else (_requested_product(dims, a, b),), epilogue,
                         _targets.program_device())
        operands = partition.match_varying(a2, b2, bias, residual)
        out = _jitted_product(*operands, static).reshape(out_shape)
        return partition.constrain(out, out_sharding)

    return _dispatch.run("matmul", implementation, interpret, checks, call, a, b, bias, residual,
                         config=config, out_sharding=out_sharding, empty=problem.is_empty,
                         dtype=a.dtype)
