"""How gather and its scatter-add run over a mesh (see `kernels.partition`), on the kernels'
`(batch, n, columns)` view of the table and the flat index vector.

Sharded indices, batch slices and columns run locally. A table sharded along the gathered
axis n is the vocab-parallel embedding: each device resolves every index against the global
n (so clip, fill and wrap keep their global meaning), gathers the rows it owns from its slice
with the others masked to zero, and the partial results are summed over the table's shards
(as raw bits: one owner contributes, so every value, NaN payloads and -0.0 included, survives).
Indices out of range under "fill" then take the fill value. The scatter-add of the gradient
stays on the owning shard: each device adds the cotangent rows whose targets it owns into its
slice of the table gradient; partial gradients from index shards are summed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels.gather.common import fill_bits, normalize_row, scatter_targets
from kernels.partition import Layout, Plan, reduction


def _owner(layout: Layout, vocab: tuple[str, ...], n_local: int, row: jax.Array,
           owned_globally: jax.Array) -> jax.Array:
    """`row` (global, in [0, n)) as an index into this device's slice; n_local when another
    device owns it or no row does."""
    local = row - lax.axis_index(vocab) * n_local
    owned = owned_globally & (local >= 0) & (local < n_local)
    return jnp.where(owned, local, n_local).astype(jnp.int32)


def _sum_owned(partial: jax.Array, vocab: tuple[str, ...]) -> jax.Array:
    """Sum over the vocab shards of rows that only one shard filled, bit-exactly."""
    bits = jnp.dtype(f"uint{8 * partial.dtype.itemsize}")
    return lax.bitcast_convert_type(lax.psum(lax.bitcast_convert_type(partial, bits), vocab),
                                    partial.dtype)


def gather_factors(static: Any, shapes: tuple) -> str:
    return "b n c, m -> b m c"


def gather_rule(gather: Any, static: Any, layout: Layout) -> Plan:
    (table_shape, _), (table_dims, index_dims) = layout.shapes, layout.dims
    p = static.problem
    used: set[str] = set()
    batch = layout.fit(p.batch, table_dims[0], used)
    columns = layout.fit(p.columns, table_dims[2], used)
    indices = layout.fit(p.num_indices, index_dims[0], used)
    vocab = layout.fit(p.n, table_dims[1], used)
    n_local = p.n // layout.size(vocab)
    local_problem = p._replace(batch=p.batch // layout.size(batch),
                               columns=p.columns // layout.size(columns),
                               num_indices=p.num_indices // layout.size(indices), n=n_local)
    if vocab:  # rows owned elsewhere gather zero bits
        local_problem = local_problem._replace(mode="fill", fill=fill_bits(0, p.dtype))
    local_static = static._replace(problem=local_problem)

    def local(table, ids):
        if not vocab:
            return gather(table, ids, local_static)
        row, in_range = normalize_row(ids, p.n, p.mode)
        valid = in_range if p.mode == "fill" else jnp.ones_like(in_range)
        partial = gather(table, _owner(layout, vocab, n_local, row, valid), local_static)
        out = _sum_owned(partial, vocab)
        if p.mode != "fill":
            return out
        return jnp.where(in_range[None, :, None], out, jnp.asarray(p.fill_value, out.dtype))

    return Plan(((batch, vocab, columns), (indices,)), (batch, indices, columns), local)


def scatter_factors(static: Any, shapes: tuple) -> str:
    return "b m c, m -> b n c"


def scatter_rule(scatter_add: Any, static: Any, layout: Layout) -> Plan:
    (g_dims, index_dims) = layout.dims
    p = static.problem
    used: set[str] = set()
    batch = layout.fit(p.batch, g_dims[0], used)
    columns = layout.fit(p.columns, g_dims[2], used)
    indices = layout.fit(p.num_indices, g_dims[1] or index_dims[0], used)
    wanted = layout.requested[0][1] if layout.requested else static.table_axes
    vocab = layout.fit(p.n, wanted, used)
    n_local = p.n // layout.size(vocab)
    local_static = static._replace(problem=p._replace(
        batch=p.batch // layout.size(batch), columns=p.columns // layout.size(columns),
        num_indices=p.num_indices // layout.size(indices), n=n_local))
    if vocab:  # targets owned elsewhere are dropped here
        local_static = local_static._replace(scatter_mode="drop")
    out_dims = [batch, vocab, columns]
    sum_indices = reduction(indices, (p.batch, p.n, p.columns), out_dims, layout)

    def local(g, ids):
        if vocab:
            targets = scatter_targets(ids, p.n, static.scatter_mode)
            ids = _owner(layout, vocab, n_local, targets, targets < p.n)
        return sum_indices(scatter_add(g, ids, local_static))

    return Plan(((batch, indices, columns), (indices,)), tuple(out_dims), local)
