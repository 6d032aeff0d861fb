"""How gather and its scatter-add run over a mesh (see `kernels.partition`), on the kernels'
`(batch, n, columns)` view of the table and the flat index vector.

Sharded indices, batch slices and columns run locally. A table sharded along the gathered
axis n is the vocab-parallel embedding: each device resolves every index against the global
n (so clip, fill and wrap keep their global meaning), gathers the rows it owns from its slice
with the others masked to zero (the first shard gives the fill value of indices out of range
under "fill"), and the partial results are summed over the table's shards (as raw bits: one
shard contributes, so every value, NaN payloads and -0.0 included, survives): an all-reduce,
or a reduce-scatter where the output is wanted sharded along the indices (the
sequence-parallel embedding of Megatron-style models). The scatter-add of the gradient
stays on the owning shard: each device adds the cotangent rows whose targets it owns into its
slice of the table gradient; partial gradients from index shards are summed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels.gather.common import fill_bits, row_of_index, scatter_targets
from kernels.partition import Axes, Layout, Plan, Reduction, reduction


def _owner(layout: Layout, vocab: tuple[str, ...], n_local: int, row: jax.Array,
           owned_globally: jax.Array) -> jax.Array:
    """`row` (global, in [0, n)) as an index into this device's slice; n_local when another
    device owns it or no row does."""
    local = row - lax.axis_index(vocab) * n_local
    owned = owned_globally & (local >= 0) & (local < n_local)
    return jnp.where(owned, local, n_local).astype(jnp.int32)


def _sum_owned(partial: jax.Array, sum_shards: Reduction) -> jax.Array:
    """`sum_shards` (over the vocab shards) of rows that only one shard filled, bit-exactly."""
    bits = jnp.dtype(f"uint{8 * partial.dtype.itemsize}")
    return lax.bitcast_convert_type(sum_shards(lax.bitcast_convert_type(partial, bits)),
                                    partial.dtype)


def _split(p: Any, layout: Layout, batch: Axes, indices: Axes, columns: Axes, vocab: Axes,
           vocab_first: bool = False):
    """The mesh axes kept on the batch, column, index and vocab dims (in that order of
    preference when two share an axis; the vocab before the indices when `vocab_first`), and
    one device's problem."""
    used: set[str] = set()
    batch = layout.fit(p.batch, batch, used)
    columns = layout.fit(p.columns, columns, used)
    if vocab_first:
        vocab = layout.fit(p.n, vocab, used)
    indices = layout.fit(p.num_indices, indices, used)
    if not vocab_first:
        vocab = layout.fit(p.n, vocab, used)
    local = p._replace(batch=p.batch // layout.size(batch),
                       columns=p.columns // layout.size(columns),
                       num_indices=p.num_indices // layout.size(indices),
                       n=p.n // layout.size(vocab))
    return batch, indices, columns, vocab, local


def gather_factors(static: Any, shapes: tuple) -> str:
    return "b n c, m -> b m c"


def gather_rule(gather: Any, static: Any, layout: Layout) -> Plan:
    table_dims, index_dims = layout.dims
    p = static.problem
    batch, indices, columns, vocab, local_problem = _split(
        p, layout, table_dims[0], index_dims[0], table_dims[2], table_dims[1])
    n_local = local_problem.n
    if vocab:  # rows owned elsewhere gather zero bits
        local_problem = local_problem._replace(mode="fill", fill=fill_bits(0, p.dtype))
    local_static = static._replace(problem=local_problem, requested=None)
    out_dims = [batch, indices, columns]
    sum_vocab = reduction(vocab, (p.batch, p.num_indices, p.columns), out_dims, layout)

    def local(table, ids):
        if not vocab:
            return gather(table, ids, local_static)
        row, in_range = row_of_index(ids, p.n, p.mode)
        valid = in_range if p.mode == "fill" else jnp.ones_like(in_range)
        partial = gather(table, _owner(layout, vocab, n_local, row, valid), local_static)
        if p.mode == "fill":
            fills = ~in_range & (lax.axis_index(vocab) == 0)
            partial = jnp.where(fills[None, :, None], jnp.asarray(p.fill_value, partial.dtype),
                                partial)
        return _sum_owned(partial, sum_vocab)

    return Plan(((batch, vocab, columns), (indices,)), tuple(out_dims), local)


def scatter_factors(static: Any, shapes: tuple) -> str:
    return "b m c, m -> b n c"


def scatter_rule(scatter_add: Any, static: Any, layout: Layout) -> Plan:
    g_dims, index_dims = layout.dims
    p = static.problem
    wanted = layout.requested[0][1] if layout.requested else static.table_axes
    # The table's gradient is typed like the table: its vocab axes before the indices' (a
    # cotangent reduce-scattered along the indices over the same axis is gathered back).
    batch, indices, columns, vocab, local_problem = _split(
        p, layout, g_dims[0], g_dims[1] or index_dims[0], g_dims[2], wanted, vocab_first=True)
    n_local = local_problem.n
    local_static = static._replace(problem=local_problem)
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
