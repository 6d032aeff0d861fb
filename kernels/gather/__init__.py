"""`kernels.gather`: `x[..., indices, ...]` with JAX's out-of-bounds modes, and its gradient.

The public function validates, narrows the indices to int32 without changing any index's
outcome (`reference.gather.bounded_indices`), views the table as `(batch, n, columns)` (a free
reshape: the gather axis is never transposed) and routes to `_gather`, a `custom_vjp` whose
backward is `_scatter_add`, a deterministic scatter-add kernel of the same implementation, whose
own backward is `_gather` again, so `grad` of `grad` works.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from kernels.reference.gather import (bounded_indices, check_arguments, default_fill_value,
                              host_indices)
from kernels.reference.gather import gather as reference_gather
from kernels import _dispatch, _targets, partition, registry
from kernels.registry import Op
from kernels.gather import sharding
from kernels.gather.common import (FORWARD_MODE, SCATTER_MODE, TRANSPOSED_MODE, GatherConfig,
                                   Problem, fill_bits, fill_scalar, scatter_plan,
                                   table_view)

__all__ = ["gather", "GatherConfig"]

OP = Op("gather", reference_gather, __name__, GatherConfig, sharding,
        check=lambda kernel, p, config: _check(kernel, p, config))


class _Static(NamedTuple):
    """The hashable, non-differentiable arguments of `_gather` and `_scatter_add`."""

    implementation: str
    interpret: bool | str  # resolved by the dispatch: False, True or "strict"
    config: GatherConfig | None
    problem: Problem
    scatter_mode: str  # the backward's rule: "drop", "clip" or "wrap"
    table_axes: tuple[str, ...] = ()  # explicit mesh axes of the gathered dim (see sharding)
    # The mesh axes asked of the gather's (batch, m, columns) output on Explicit axes
    # (partition.Layout.requested): a vocab-parallel table's sum then reduce-scatters into them.
    requested: tuple[partition.Dims | None] | None = None
    # The device the program is traced for (`_targets.program_device`), so that the backward,
    # traced later, is built for it too (`partition.partitioned`).
    device: Any = None


def _gather_whole(x3: jax.Array, indices: jax.Array, static: _Static) -> jax.Array:
    return OP.module(static.implementation).gather(x3, indices, static.problem,
                                                   config=static.config,
                                                   interpret=static.interpret)


def _scatter_add_whole(g: jax.Array, indices: jax.Array, static: _Static) -> jax.Array:
    plan = scatter_plan(indices, static.problem.n, static.scatter_mode)
    return OP.module(static.implementation).scatter_add(g, plan, static.problem,
                                                        config=static.config,
                                                        interpret=static.interpret)


# Each device runs the kernels on its blocks of mesh-sharded operands (kernels.partition).
_gather_sharded = partition.partitioned(_gather_whole, sharding.gather_rule,
                                        sharding.gather_factors)
_scatter_add_sharded = partition.partitioned(_scatter_add_whole, sharding.scatter_rule,
                                             sharding.scatter_factors)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather(x3: jax.Array, indices: jax.Array, static: _Static) -> jax.Array:
    return _gather_sharded(x3, indices, static)


def _gather_fwd(x3, indices, static):
    return _gather(x3, indices, static), indices


def _float0_zeros(x: jax.Array) -> np.ndarray:
    return np.zeros(x.shape, jax.dtypes.float0)


def _gather_bwd(static: _Static, indices, g):
    p = static.problem
    if not jnp.issubdtype(p.dtype, jnp.inexact):  # integer tables have no gradient
        return np.zeros((p.batch, p.n, p.columns), jax.dtypes.float0), _float0_zeros(indices)
    return _scatter_add(g, indices, static._replace(requested=None)), _float0_zeros(indices)


_gather.defvjp(_gather_fwd, _gather_bwd)
# Eager calls hit jit's cache instead of re-tracing and re-compiling the kernel each time.
_jitted_gather = jax.jit(_gather, static_argnums=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scatter_add(g: jax.Array, indices: jax.Array, static: _Static) -> jax.Array:
    """The transpose of `_gather` in `static`: g (batch, m, columns) -> (batch, n, columns)."""
    return _scatter_add_sharded(g, indices, static)


def _scatter_add_fwd(g, indices, static):
    return _scatter_add(g, indices, static), indices


def _scatter_add_bwd(static: _Static, indices, ct):
    # Its transpose is a gather with the matching forward rule (dropped rows gather zero).
    transposed = static.problem._replace(mode=TRANSPOSED_MODE[static.scatter_mode],
                                         fill=fill_bits(0, static.problem.dtype))
    dg = _gather(ct, indices, static._replace(problem=transposed))
    return dg, _float0_zeros(indices)


_scatter_add.defvjp(_scatter_add_fwd, _scatter_add_bwd)


def gather(
    x: jax.Array,
    indices: jax.Array,
    *,
    axis: int = 0,
    mode: str | None = None,
    fill_value: Any = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    implementation: str | tuple[str, ...] | None = None,
    interpret: bool | str | None = None,
    config: GatherConfig | None = None,
) -> jax.Array:
    """`x.at[(slice(None),) * axis + (indices,)].get(mode=mode, fill_value=fill_value,
    out_sharding=out_sharding)`.

    mode: None, "promise_in_bounds" or "clip" clamp out-of-range indices to the edge; "drop" or
    "fill" give `fill_value` (default: NaN for inexact dtypes, the minimum for signed integers,
    the maximum for unsigned, True for bool); "wrap" is `jnp.take(..., mode="wrap")`. Negative
    indices count from the end first. Output shape: `x.shape[:axis] + indices.shape +
    x.shape[axis + 1:]`. Any dtype of `x`, any integer dtype of `indices`, and NumPy's answer
    for every index value (no narrow-dtype overflow). The gradient with respect to `x` is
    JAX's: a scatter-add of the cotangent under the same mode (the default mode drops
    out-of-range indices in the backward). `out_sharding` as `.at[].get` takes it (on Explicit
    axes: a table sharded along `axis` reduce-scatters into it); without it on Explicit axes
    the result has the indices' sharding, the table's other dims keep theirs and the gathered
    rows are whole. `implementation` and `interpret` choose the kernel as in docs/design.md;
    `config` sets block sizes.
    """
    x, indices = jnp.asarray(x), host_indices(indices)
    OP.validate(config, booleans=True, x=x)
    axis = check_arguments(x, indices, axis, mode)
    out_shape = x.shape[:axis] + indices.shape + x.shape[axis + 1:]
    out_sharding = partition.out_sharding(out_sharding, "gather", len(out_shape))
    batch, n, columns = table_view(x.shape, axis)
    # The output dims that each dim of the kernels' (batch, m, columns) output is made of.
    groups = (x.shape[:axis], indices.shape, x.shape[axis + 1:])
    # The kernels carry bool as uint8 (1 byte, the same values).
    kernel_dtype = jnp.dtype(jnp.uint8) if x.dtype == jnp.bool_ else x.dtype
    fill = None
    if FORWARD_MODE[mode] == "fill":
        value = default_fill_value(x.dtype) if fill_value is None else fill_value
        # Converted to the table's dtype first, as JAX does (2 -> True for a bool table).
        fill = fill_bits(fill_scalar(fill_bits(value, x.dtype), x.dtype), kernel_dtype)
    problem = Problem(batch, n, columns, indices.size, kernel_dtype, FORWARD_MODE[mode], fill)
    checks = OP.checks(problem, config)
    # Host indices stay NumPy constants: as operands they would be narrowed to 32 bits.
    host = None if isinstance(indices, jax.Array) else indices

    def call(name, interpret, out_sharding, x, *traced_indices):
        indices = traced_indices[0] if traced_indices else host
        if not registry.get(name).is_kernel:
            if out_sharding is None and not partition.dims_of(x)[axis]:
                # The kernels' sharding, which JAX's gather alone may not type (the table and
                # the indices sharded over different axes) even where no kernel takes the
                # table; a table sharded along `axis` gets the kernels' from the dispatch.
                table_dims = partition.dims_of(x)
                out_sharding = partition.sharding(
                    (*table_dims[:axis], *partition.dims_of(indices), *table_dims[axis + 1:]), x)
            return reference_gather(x, indices, axis=axis, mode=mode, fill_value=fill_value,
                                    out_sharding=out_sharding)
        flat_indices = jnp.asarray(bounded_indices(indices, n, mode)).reshape(-1)
        wanted = partition.requested(out_sharding, len(out_shape))
        static = _Static(name, interpret, config, problem, SCATTER_MODE[mode],
                         partition.dims_of(x)[axis],
                         None if wanted is None else (_view_dims(wanted, groups),),
                         _targets.program_device())
        table = x.astype(kernel_dtype).reshape(batch, n, columns)
        out = _jitted_gather(*partition.match_varying(table, flat_indices), static)
        sizes = partition.axis_sizes(out)
        out_dims = sum((partition.split(axes, shape, sizes)
                        for axes, shape in zip(partition.dims_of(out), groups)), ())
        out = partition.reshape(out.astype(x.dtype), out_shape, out_dims)
        return partition.constrain(out, out_sharding)

    operands = (x,) if host is not None else (x, indices)
    return _dispatch.run("gather", implementation, interpret, checks, call, *operands,
                         config=config, out_sharding=out_sharding,
                         empty=math.prod(out_shape) == 0, dtype=x.dtype)


def _view_dims(dims: partition.Dims, groups: tuple[tuple[int, ...], ...]) -> partition.Dims:
    """The output `dims` as the kernels' (batch, m, columns) output's: each group merged."""
    view, start = [], 0
    for shape in groups:
        view.append(partition.merged(shape, dims[start:start + len(shape)]))
        start += len(shape)
    return tuple(view)


def _check(kernel: str, problem: Problem, config: GatherConfig | None) -> None:
    if jnp.issubdtype(problem.dtype, jnp.complexfloating):
        raise NotImplementedError(f"{problem.dtype.name} tables are not supported")
    OP.module(kernel).check(problem, config)
