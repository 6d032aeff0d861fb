"""The shardings of arrays as the ops see them while tracing: an array's `Dims`, the mesh axes'
sizes, an asked `out_sharding` checked as JAX's ops check it, merging and splitting dims across
a reshape, and resharding a result (`constrain`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax._src.sharding_impls import canonicalize_sharding  # JAX's ops' own out_sharding check
from jax.sharding import AxisType, NamedSharding

from kernels.partition.rules import Axes, Dims, dims_of_sharding, spec
# Defined beside the reference, whose own gradient rule types its cotangents so too.
from kernels.reference.shardings import explicit_mesh, typed_like as like

__all__ = ["explicit_mesh", "sharding", "reshape", "grouped", "ungrouped", "dims_of", "like",
           "out_sharding", "requested",
           "merged", "mergeable", "split", "axis_sizes", "constrain"]


def sharding(dims: Sequence[Axes], *operands: Any) -> NamedSharding | None:
    """The sharding `dims` says on the Explicit mesh `operands` live on, or None where they
    live on none (JAX infers or propagates the sharding there)."""
    mesh = explicit_mesh(operands)
    return None if mesh is None else NamedSharding(mesh, spec(tuple(dims)))


def reshape(x: jax.Array, shape: Sequence[int], dims: Sequence[Axes]) -> jax.Array:
    """`x.reshape(shape)`, whose result on an Explicit mesh is sharded as `dims` says: JAX
    cannot infer the sharding of a reshape that splits a sharded dim."""
    out_sharding = sharding(dims, x)
    if out_sharding is None:
        return x.reshape(shape)
    return lax.reshape(x, tuple(shape), out_sharding=out_sharding)


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(first dim, dims) of each run of dims `lengths` counts, in order."""
    return [(sum(lengths[:i]), n) for i, n in enumerate(lengths)]


def grouped(x: jax.Array, lengths: Sequence[int]) -> jax.Array:
    """`x` reshaped so that each run of its dims becomes one dim: `lengths` counts x's dims in
    each run, in order (0: a new dim of 1). On an Explicit mesh each merged dim keeps the axes
    `merged` gives it; where a run cannot keep them (a dim after its first one longer than 1 is
    sharded), those dims are first replicated (a reshard: XLA all-gathers them)."""
    shape, dims = tuple(x.shape), list(dims_of(x))
    for start, n in _runs(lengths):
        for d in [d for d in range(start, start + n) if shape[d] > 1][1:]:
            dims[d] = ()
    if tuple(dims) != dims_of(x):
        x = jax.sharding.reshard(x, sharding(dims, x))
    return reshape(x, [math.prod(shape[s:s + n]) for s, n in _runs(lengths)],
                   [merged(shape[s:s + n], dims[s:s + n]) for s, n in _runs(lengths)])


def ungrouped(x: jax.Array, shape: Sequence[int], lengths: Sequence[int]) -> jax.Array:
    """`grouped`'s inverse: `x` reshaped to `shape`, each of its dims split into a run of
    `lengths` dims of `shape`, sharded on an Explicit mesh as `split` gives each run."""
    sizes = axis_sizes(x)
    dims = sum((split(axes, shape[s:s + n], sizes) if n else ()
                for axes, (s, n) in zip(dims_of(x), _runs(lengths))), ())
    return reshape(x, shape, dims)


def dims_of(x: jax.Array) -> Dims:
    """The mesh axes each dim of `x` is sharded over, where its type says (Explicit axes)."""
    if explicit_mesh([x]) is None:
        return ((),) * x.ndim
    return dims_of_sharding(jax.typeof(x).sharding, x.ndim)


def out_sharding(value: Any, op: str, ndim: int) -> NamedSharding | None:
    """`out_sharding=` of an op whose output has `ndim` dims, checked as JAX's own ops check it
    (a NamedSharding, or a PartitionSpec under `jax.set_mesh`; Explicit axes only), before
    anything is traced. Returns it as a NamedSharding, or None."""
    sharding = canonicalize_sharding(value, op)
    if sharding is not None and len(sharding.spec) > ndim:
        raise ValueError(f"{op}: out_sharding {sharding.spec} has more entries than the "
                         f"output's {ndim} dims")
    return sharding


def requested(sharding: NamedSharding | None, ndim: int) -> Dims | None:
    """The mesh axes `sharding` (an op's `out_sharding`) asks of each of `ndim` output dims
    where it is a type (some axis Explicit), else None: JAX applies none on Auto axes."""
    if sharding is None or not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return dims_of_sharding(sharding, ndim)


def merged(shape: Sequence[int], dims: Sequence[Axes]) -> Axes:
    """The axes of dims of `shape` (sharded as `dims`) reshaped into one, where each device
    then holds one contiguous block of it: those of the first dim longer than 1, when no later
    dim is sharded; else () (no such block; the op reshards afterwards). `split` undoes it."""
    longer = [d for d, size in enumerate(shape) if size > 1]
    if not longer or not mergeable(shape, dims):
        return ()
    return tuple(dims[longer[0]])


def mergeable(shape: Sequence[int], dims: Sequence[Axes]) -> bool:
    """Whether dims of `shape` sharded as `dims` reshape into one with each device's part one
    contiguous block, as `merged` takes it: no dim after the first longer than 1 is sharded."""
    longer = [d for d, size in enumerate(shape) if size > 1]
    return not any(dims[d] for d in longer[1:])


def split(axes: Axes, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> Dims:
    """Per dim of `shape`, the axes of one dim reshaped into `shape`, major first: each dim
    takes the next axes while it divides into them, so a dim split to one element a device
    passes the rest on (JAX merges (2, 8) sharded ("data", "model") on a (2, 4) mesh into
    ("data", "model"); `merged`'s one sharded dim comes back on that dim)."""
    rest, dims = list(axes), []
    for size in shape:
        taken: list[str] = []
        while rest and size % math.prod(axis_sizes[a] for a in (*taken, rest[0])) == 0:
            taken.append(rest.pop(0))
        dims.append(tuple(taken))
    return tuple(dims) if not rest else (tuple(axes),) + ((),) * (len(shape) - 1)


def axis_sizes(x: jax.Array) -> dict[str, int]:
    """The axis sizes of the Explicit mesh `x` lives on ({} on none)."""
    mesh = explicit_mesh([x])
    return {} if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes))


def constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """`x` with the `out_sharding` its op was asked for, where that is a type (Explicit axes)
    and the rule did not already give it: a reshard, XLA's cheapest collective for it."""
    dims = requested(sharding, x.ndim)
    if dims is None or dims_of(x) == dims:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec(dims)))
