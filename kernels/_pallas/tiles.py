"""How an interpreted Triton kernel reaches its tiles: `triton_load` and `triton_store` index a
`ref.at[...]` of slices by int arrays, the same pointers for the compiler, but an interpreted
program then costs O(tile) instead of O(array); a kernel of very few programs keeps its slices
(`tile_access`, set by `launch.triton_call` around each trace).
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.state import indexing as state_indexing
from jax._src.state import types as state_types

__all__ = ["TILE_ACCESS", "tile_access", "triton_backend", "triton_load", "triton_store"]


def triton_backend() -> Any:
    """`jax.experimental.pallas.triton`, imported when a Triton kernel is built: JAX has
    deprecated that backend, and a jax without it must still import this library (the
    registry then declines `triton`, `kernels.registry.unavailable`)."""
    from jax.experimental.pallas import triton

    return triton


# How the Triton kernel being traced reaches its tiles (set by `triton_call` around the trace):
# "pointers" compiled (as written), else interpreted as "slices" (a kernel with so few
# programs that its tiles are best read and written as slices) or "index_arrays".
TILE_ACCESS: contextvars.ContextVar[str] = contextvars.ContextVar("tile_access",
                                                                  default="pointers")
# Up to this many tile visits (programs times the tiles each walks) an interpreted kernel
# accesses its tiles as slices.
_SLICED_VISITS = 4


def tile_access(interpret: bool | str, tile_visits: int) -> str:
    if not interpret:
        return "pointers"
    return "slices" if tile_visits <= _SLICED_VISITS else "index_arrays"


def _tile_indexer(ref: Any) -> Any:
    """The one `NDIndexer` that `ref.at[...]` applied to its array, else None."""
    if not isinstance(ref, state_types.TransformedRef) or len(ref.transforms) != 1:
        return None
    (indexer,) = ref.transforms
    return indexer if isinstance(indexer, state_indexing.NDIndexer) else None


def _as_index_arrays(ref: Any) -> Any:
    """`ref.at[...]` of slices (and scalars) as the same tile indexed by int arrays.

    A Triton kernel computes the same pointers either way (start + iota per dim), and the
    compilers see the same contiguity; but Pallas' interpreter pads and unpads the whole array
    around every sliced store (and pads for every sliced load) so a slice may pass the edge,
    which makes each interpreted program cost O(array), while index arrays become a gather or
    scatter of the tile (out-of-bounds lanes are masked, and a scatter drops them anyway), at
    several times the cost of a copy per element. So an interpreted kernel that visits only a
    few tiles in all (the fast interpreter's schedule, `_targets.INTERPRETER`, at its best:
    one program over whole arrays) keeps its slices: O(array) a few times, at a copy's speed.
    """
    indexer = _tile_indexer(ref)
    if TILE_ACCESS.get() != "index_arrays" or indexer is None or any(
            not isinstance(i, state_indexing.Slice) and jnp.ndim(i) for i in indexer.indices):
        return ref
    slices = [i for i in indexer.indices if isinstance(i, state_indexing.Slice)]
    indices, dim = [], 0
    for index in indexer.indices:
        if isinstance(index, state_indexing.Slice):
            shape = [1] * len(slices)
            shape[dim] = index.size
            positions = index.start + index.stride * jnp.arange(index.size, dtype=jnp.int32)
            indices.append(positions.reshape(shape))
            dim += 1
        else:
            indices.append(index)
    return ref.ref.at[tuple(indices)]


def _masked_lanes_dropped(ref: Any, mask: jax.Array) -> Any:
    """An interpreted store's `ref.at[int arrays]` with each masked-off lane's first index
    moved past the array's end, where the interpreter's scatter drops it: the same writes as
    the mask, without the gather of the old values and the select that a masked store
    interprets as. None where `ref` is not indexed by int arrays on every dim."""
    indexer = _tile_indexer(ref)
    if indexer is None or any(isinstance(i, state_indexing.Slice) for i in indexer.indices):
        return None
    first, *rest = indexer.indices
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in indexer.indices), jnp.shape(mask))
    first = jnp.where(mask, jnp.broadcast_to(first, shape), ref.ref.shape[0])
    return ref.ref.at[(first, *rest)]


def triton_load(ref: Any, **kwargs: Any) -> jax.Array:
    """`pallas.triton.load` of a tile (see `_as_index_arrays`)."""
    return triton_backend().load(_as_index_arrays(ref), **kwargs)


def triton_store(ref: Any, value: jax.Array, *, mask: jax.Array | None = None) -> None:
    """`pallas.triton.store` of a tile (see `_as_index_arrays` and `_masked_lanes_dropped`),
    converted to the ref's dtype as Triton's store converts to the pointer's element type."""
    ref, value = _as_index_arrays(ref), value.astype(ref.dtype)
    if mask is not None and TILE_ACCESS.get() == "index_arrays":
        dropping = _masked_lanes_dropped(ref, mask)
        if dropping is not None:
            ref, mask = dropping, None
    triton_backend().store(ref, value, mask=mask)
