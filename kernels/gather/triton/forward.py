"""Gather as a Pallas kernel lowered through Triton (GPU): the forward (the package's docstring
has both kernels' loop nests).

Forward block schedule
----------------------
grid = (batch * cdiv(m, block_indices), cdiv(columns, block_columns)). Program (t, c) takes
batch slice b = t // cdiv(m, block_indices) and index block t % cdiv(m, block_indices): it loads
block_indices int32 indices (masked past m), counts negative ones from the end and applies the
mode (clamp to [0, n), or wrap, or mark the out-of-range ones), then loads the
(block_indices, block_columns) tile `x[b, rows, columns]` with one pointer gather whose mask
also covers out-of-range rows (they read `fill` without touching memory) and columns past the
row's end, and stores it to `out[b, index block, column block]`, masked. Rows are always in
[0, n) before the load, so no load leaves the table whatever the index values.

Memory traffic: every gathered row is read once and every output element written once; the
indices are read once per column block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.gather.common import GatherConfig, Problem, gather_bytes, row_of_index
from kernels.gather.triton.config import resolve_config

__all__ = ["gather", "load_rows"]


def load_rows(ref, batch, rows, columns, mask, other=0):
    """The (*rows.shape, columns) tile of `ref[batch]` by one masked pointer gather. Array
    indexers on every dim: the one form both the Triton lowering and interpret mode take."""
    columns = columns.reshape((1,) * rows.ndim + columns.shape)
    return triton_load(ref.at[batch, rows[..., None], columns], mask=mask, other=other)


def _gather_kernel(indices_ref, x_ref, out_ref, *, p: Problem, block_indices: int,
                   block_columns: int):
    num_index_blocks = pl.cdiv(p.num_indices, block_indices)
    batch, index_block = pl.program_id(0) // num_index_blocks, pl.program_id(0) % num_index_blocks
    first_index, first_column = index_block * block_indices, pl.program_id(1) * block_columns
    positions = first_index + jnp.arange(block_indices, dtype=jnp.int32)
    columns = first_column + jnp.arange(block_columns, dtype=jnp.int32)
    index_valid, column_valid = positions < p.num_indices, columns < p.columns
    indices = triton_load(indices_ref.at[pl.ds(first_index, block_indices)], mask=index_valid,
                          other=0)
    rows, in_range = row_of_index(indices, p.n, p.mode)
    read = column_valid[None, :] & (in_range[:, None] if p.mode == "fill" else True)
    tile = load_rows(x_ref, batch, rows, columns, read,
                      other=jnp.asarray(p.fill_value, x_ref.dtype))
    out = out_ref.at[batch, pl.ds(first_index, block_indices), pl.ds(first_column, block_columns)]
    triton_store(out, tile, mask=index_valid[:, None] & column_valid[None, :])


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    config = resolve_config(p, config)
    kernel = functools.partial(_gather_kernel, p=p, block_indices=config.block_indices,
                               block_columns=config.block_columns)
    grid = (p.batch * pl.cdiv(p.num_indices, config.block_indices),
            pl.cdiv(p.columns, config.block_columns))
    return triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.num_indices, p.columns), x.dtype),
        grid=grid,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        bytes_accessed=gather_bytes(p),
        name="gather_triton",
    )(indices, x)
