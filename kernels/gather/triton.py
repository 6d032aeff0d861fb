"""Gather and its scatter-add gradient as Pallas kernels lowered through Triton (GPU).

Both kernels work on the `(batch, n, columns)` view of the table (see common.py).

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

Backward block schedule (deterministic scatter-add)
---------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`): `order` lists the index
positions by target row, `row_starts` delimits each row's segment. grid = (batch *
cdiv(n, block_rows), cdiv(columns, block_columns)): program (t, c) owns `block_rows` table rows
of batch slice b, column block c. For each of its rows it walks the row's segment
`segment_rows` positions at a time: one masked pointer gather loads those cotangent rows
`g[b, order[s:s + segment_rows], column block]` together (independent loads in flight, not one
dependent load per index), sums them into a float32 (float64 for float64) register
accumulator, and finally stores the table-gradient row once, cast to its dtype. Rows no index
lands on are written as zeros by the program that owns them (block_rows rows per program, not
one program per row of a large vocabulary). Dropped indices sort past the last row and are
never read. No atomics: every output element has one writer and a fixed summation order, so
every run gives the same bits. A row hit k times costs its program cdiv(k, segment_rows)
steps (a padding id hit 4096 times with 8-row steps: 512 steps, where one load per index took
4096 dependent loads).

Memory traffic: the cotangent is read once, the table gradient written once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import check_triton_config, next_power_of_2, require_int32_offsets
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, accumulator_dtype,
                                   check_int, gather_cost, normalize_row, scatter_cost)

_MAX_BLOCK_INDICES = 64
_MAX_BLOCK_COLUMNS = 512


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """Power-of-2 blocks: up to 64 indices by up to 512 columns (a 64 KiB float32 tile)."""
    config = config or GatherConfig()
    block_columns = config.block_columns or min(_MAX_BLOCK_COLUMNS,
                                                next_power_of_2(p.columns))
    # Short rows (the last-axis gather): take more indices per program instead.
    block_indices = config.block_indices or min(
        max(_MAX_BLOCK_INDICES, _MAX_BLOCK_INDICES * 64 // block_columns),
        next_power_of_2(max(p.num_indices, 1)))
    num_warps = config.num_warps or (8 if block_indices * block_columns >= 16384 else 4)
    return dataclasses.replace(config, block_indices=block_indices, block_columns=block_columns,
                               num_warps=num_warps, num_stages=config.num_stages or 2)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Takes every dtype; declines tables and outputs past int32 offsets; rejects a config
    that Triton cannot compile."""
    require_int32_offsets(x=p.batch * p.n * p.columns, output=p.batch * p.num_indices * p.columns)
    for field in ("block_indices", "block_columns", "num_warps", "num_stages"):
        check_int(config or GatherConfig(), field)
    # No dot here, so blocks of any power of 2 (1 included: a last-axis gather's rows).
    check_triton_config(resolve_config(p, config), ("block_indices", "block_columns"),
                        min_block=1)


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
    rows, in_range = normalize_row(indices, p.n, p.mode)
    read = column_valid[None, :] & (in_range[:, None] if p.mode == "fill" else True)
    # Array indexers on every dim: the one form both the Triton lowering and interpret mode take
    # for a pointer gather.
    tile = triton_load(x_ref.at[batch, rows[:, None], columns[None, :]], mask=read,
                       other=jnp.asarray(p.fill_value, x_ref.dtype))
    out = out_ref.at[batch, pl.ds(first_index, block_indices), pl.ds(first_column, block_columns)]
    triton_store(out, tile, mask=index_valid[:, None] & column_valid[None, :])


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool) -> jax.Array:
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
        cost_estimate=gather_cost(p),
        name="gather_triton",
    )(indices, x)


_BLOCK_ROWS = 8  # table rows per backward program
_SEGMENT_TILE = 4096  # elements of the (segment_rows, block_columns) cotangent tile per step


def _segment_rows(block_columns: int) -> int:
    return max(1, _SEGMENT_TILE // block_columns)


def _scatter_add_kernel(order_ref, row_starts_ref, g_ref, out_ref, *, p: Problem,
                        block_columns: int):
    row_blocks = pl.cdiv(p.n, _BLOCK_ROWS)
    batch, row_block = pl.program_id(0) // row_blocks, pl.program_id(0) % row_blocks
    first_column = pl.program_id(1) * block_columns
    columns = first_column + jnp.arange(block_columns, dtype=jnp.int32)
    column_valid = columns < p.columns
    segment_rows = _segment_rows(block_columns)
    steps = jnp.arange(segment_rows, dtype=jnp.int32)

    def row_gradient(i, carry):
        # Rows past the table's end have an empty segment (clamped bounds) and store nothing.
        row = jnp.minimum(row_block * _BLOCK_ROWS + i, p.n)
        start, stop = row_starts_ref[row], row_starts_ref[jnp.minimum(row + 1, p.n)]

        def add(step, acc):
            positions = start + step * segment_rows + steps
            valid = positions < stop
            sources = triton_load(order_ref.at[positions], mask=valid, other=0)
            g_rows = triton_load(g_ref.at[batch, sources[:, None], columns[None, :]],
                                 mask=valid[:, None] & column_valid[None, :], other=0)
            return acc + jnp.sum(g_rows.astype(acc.dtype), axis=0)

        acc = lax.fori_loop(jnp.int32(0), (stop - start + segment_rows - 1) // segment_rows, add,
                            jnp.zeros((block_columns,), accumulator_dtype(p.dtype)))
        triton_store(out_ref.at[batch, row, pl.ds(first_column, block_columns)],
                     acc.astype(out_ref.dtype), mask=column_valid & (row < p.n))
        return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(_BLOCK_ROWS), row_gradient, 0)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    kernel = functools.partial(_scatter_add_kernel, p=p, block_columns=config.block_columns)
    return triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid=(p.batch * pl.cdiv(p.n, _BLOCK_ROWS), pl.cdiv(p.columns, config.block_columns)),
        num_warps=4,
        num_stages=config.num_stages,
        interpret=interpret,
        cost_estimate=scatter_cost(p),
        name="scatter_add_triton",
    )(plan.order, plan.row_starts, g)
