"""What an op's rule (`kernels/<op>/sharding.py`) sees and returns: a `Layout` of its operands
(shapes and, per dim, mesh axes) in, a `Plan` (operand and output shardings, what one device
runs) out, and the `Reduction` that turns per-shard partials into the result.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["Axes", "Dims", "Layout", "Plan", "Rule", "Factors", "spec", "dims_of_sharding",
           "Reduction", "reduction"]


Axes = tuple[str, ...]  # the mesh axes one dim is sharded over, major first
Dims = tuple[Axes, ...]  # per dim of one array


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a rule sees: per operand its shape and `Dims` (None for an absent operand), the
    mesh's axis sizes, and (Auto meshes only) the `Dims` XLA would like each output to have."""

    shapes: tuple[tuple[int, ...] | None, ...]
    dims: tuple[Dims | None, ...]
    axis_sizes: Mapping[str, int]
    requested: tuple[Dims | None, ...] | None = None

    def size(self, axes: Axes) -> int:
        return math.prod(self.axis_sizes[a] for a in axes)

    def fit(self, length: int, axes: Axes, used: set[str] | None = None) -> Axes:
        """The longest prefix of `axes` (skipping axes in `used`) that evenly divides a dim of
        `length`: a shard_map block must be whole, and a padded shard would add garbage into
        a sum."""
        kept: list[str] = []
        for axis in axes:
            if used is not None and axis in used:
                continue
            if length % self.size((*kept, axis)):
                break
            kept.append(axis)
        if used is not None:
            used.update(kept)
        return tuple(kept)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs over the mesh: operand and output shardings, and the per-device
    function (kernel + collectives) on blocks."""

    in_dims: tuple[Dims | None, ...]
    out_dims: Dims | tuple[Dims | None, ...]  # a tuple per output (None: absent) if multiple
    local: Callable[..., Any]
    multiple: bool = False


Rule = Callable[[Callable[..., Any], Any, Layout], Plan]
Factors = Callable[[Any, tuple[tuple[int, ...] | None, ...]], str]


def spec(dims: Dims) -> PartitionSpec:
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes
                           for axes in dims))


def dims_of_sharding(sharding: Any, ndim: int) -> Dims:
    if not isinstance(sharding, NamedSharding):
        return ((),) * ndim
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in entries[:ndim])


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How per-shard partial sums become the result: a reduce-scatter over `scatter` along
    output dim `dim` (when XLA wants the output sharded by those axes), then an all-reduce over
    the rest."""

    all_reduce: Axes
    scatter: Axes = ()
    dim: int = 0

    def __call__(self, partial: jax.Array) -> jax.Array:
        if self.scatter:
            partial = lax.psum_scatter(partial, self.scatter, scatter_dimension=self.dim,
                                       tiled=True)
        return lax.psum(partial, self.all_reduce) if self.all_reduce else partial


def reduction(axes: Axes, out_shape: Sequence[int], out_dims: list[Axes], layout: Layout,
              output: int = 0) -> Reduction:
    """The `Reduction` of partials summed over mesh `axes` into an output of `out_shape` (None
    for a dim that may not be scattered); records a scattered dim in `out_dims`."""
    requested = layout.requested[output] if layout.requested else None
    for d, wanted in enumerate(requested or ()):
        scatter = tuple(a for a in wanted if a in axes)
        if (scatter and not out_dims[d] and out_shape[d] is not None
                and out_shape[d] % layout.size(scatter) == 0):
            out_dims[d] = scatter
            return Reduction(tuple(a for a in axes if a not in scatter), scatter, d)
    return Reduction(tuple(axes))
