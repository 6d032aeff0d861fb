"""The scatter-add gradient of gather as Pallas kernels lowered through Triton (GPU) (the
package's docstring has both kernels' loop nests).

Backward block schedule (deterministic scatter-add)
---------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`): `order` lists the index
positions by target row, `row_starts` delimits each row's segment. No program's work grows with
how often an id repeats: a row's segment is summed by its owner only up to `length` ≈ sqrt(m)
positions; the rest of it is cut into pieces of `length` positions (`pieces`, `piece_table`:
at most m // length of them, laid out by XLA in O(m + n)).
Pieces (`scatter_add_pieces_triton`, launched when m > length): grid = (batch · pieces,
cdiv(columns, block_columns)). Program (b·pieces + q, c) loads piece q's cotangent rows
`g[b, order[start:stop], column block]` segment_rows at a time (one masked pointer gather per
step: independent loads in flight), sums them in float32 (float64 for float64) and stores the
partial row `partials[b, q, column block]`. Unused pieces store zeros.
Rows (`scatter_add_triton`): grid = (batch · cdiv(n, block_rows), cdiv(columns,
block_columns)): program (t, c) owns `block_rows` table rows of batch slice b, column block c.
For each of its rows it sums the first `length` positions of the row's segment the same way,
then the row's pieces' partial rows (contiguous, segment_rows at a time), and stores the
table-gradient row once, cast to its dtype. Rows no index lands on are written as zeros by the
program that owns them (block_rows rows per program, not one program per row of a large
vocabulary). Dropped indices sort past the last row and are never read. No atomics: every
output element has one writer and a fixed summation order, so every run gives the same bits.
Whatever the ids, a row costs its owner at most length/segment_rows + pieces/segment_rows load
steps (`longest_loop`: 24 for 8192 ids at 512 columns, where one id hit 8192 times took 1024
steps in a single program).
In the fast interpreter, whose cost is per loop step and per scattered element, a rows program
owns 64 rows and walks them side by side, one position of each per step (`rows_schedule`):
as many steps as its longest segment, not one loop per row; and it writes them as its own
(64, block_columns) output block (a BlockSpec), which the interpreter copies back once, where
a pointer store into the table interprets as an element-wise scatter (24 of 26 ms at 20000x256
with 4096 ids on jax 0.12). The device schedule keeps the pointer stores: it is the one that
ran on an H100 and compiles for sm_90/sm_80.

Memory traffic: the cotangent is read once, the table gradient written once, and the pieces'
float32 partial rows (at most m / length of them) written once and read once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.gather.common import (GatherConfig, Pieces, Problem, ScatterPlan, accumulator_dtype,
                                   piece_table, scatter_bytes)
from kernels.gather.triton.config import (RowsSchedule, pieces, pieces_bytes,
                                          resolve_config, rows_schedule, segment_rows)
from kernels.gather.triton.forward import load_rows

__all__ = ["scatter_add"]


def _sum_segments(load, starts, stops, rows_per_step: int, acc):
    """acc[r] + the rows starts[r]..stops[r]-1 that `load(positions, valid)` returns, for
    every r at once, rows_per_step positions of each per step: independent loads in flight,
    not one dependent load per row."""
    steps = jnp.arange(rows_per_step, dtype=jnp.int32)

    def add(step, acc):
        positions = starts[:, None] + step * rows_per_step + steps[None, :]
        rows = load(positions, positions < stops[:, None])
        return acc + jnp.sum(rows.astype(acc.dtype), axis=1)

    longest = jnp.max(stops - starts)
    return lax.fori_loop(jnp.int32(0), (longest + rows_per_step - 1) // rows_per_step, add, acc)


def _cells(valid: jax.Array, column_valid: jax.Array) -> jax.Array:
    """The mask of rows `valid` (any rank) by the block's columns, broadcast explicitly so the
    kernel holds under jax_numpy_rank_promotion="raise"."""
    return valid[..., None] & column_valid.reshape((1,) * valid.ndim + (-1,))


def _cotangent_rows(order_ref, g_ref, batch, columns, column_valid):
    """load(positions, valid) of the cotangent rows at sorted positions (positions of any
    rank: the rows come back with a trailing column axis)."""
    def load(positions, valid):
        sources = triton_load(order_ref.at[positions], mask=valid, other=0)
        return load_rows(g_ref, batch, sources, columns, _cells(valid, column_valid))
    return load


def _piece_kernel(order_ref, bounds_ref, g_ref, out_ref, *, p: Problem, block_columns: int):
    batch, piece = pl.program_id(0) // out_ref.shape[1], pl.program_id(0) % out_ref.shape[1]
    first_column = pl.program_id(1) * block_columns
    columns = first_column + jnp.arange(block_columns, dtype=jnp.int32)
    column_valid = columns < p.columns
    bounds = [jnp.full((1,), bounds_ref[piece, k], jnp.int32) for k in (0, 1)]
    acc = _sum_segments(_cotangent_rows(order_ref, g_ref, batch, columns, column_valid),
                        *bounds, segment_rows(block_columns),
                        jnp.zeros((1, block_columns), out_ref.dtype))
    triton_store(out_ref.at[batch, piece, pl.ds(first_column, block_columns)], jnp.sum(acc, 0),
                 mask=column_valid)


def _scatter_add_kernel(order_ref, row_starts_ref, row_pieces_ref, g_ref, partials_ref,
                        out_ref, *, p: Problem, block_columns: int, layout: Pieces,
                        schedule: RowsSchedule):
    row_blocks = pl.cdiv(p.n, schedule.block_rows)
    batch, row_block = pl.program_id(0) // row_blocks, pl.program_id(0) % row_blocks
    first_column = pl.program_id(1) * block_columns
    columns = first_column + jnp.arange(block_columns, dtype=jnp.int32)
    column_valid = columns < p.columns
    cotangents = _cotangent_rows(order_ref, g_ref, batch, columns, column_valid)

    def piece_partials(positions, valid):
        return load_rows(partials_ref, batch, positions, columns,
                          _cells(valid, column_valid))

    def row_group(i, carry):
        # Rows past the table's end have an empty segment (clamped bounds) and store nothing.
        first_row = row_block * schedule.block_rows + i * schedule.rows_at_once
        rows = jnp.minimum(first_row + jnp.arange(schedule.rows_at_once, dtype=jnp.int32), p.n)
        next_rows = jnp.minimum(rows + 1, p.n)
        starts = triton_load(row_starts_ref.at[rows])
        stops = triton_load(row_starts_ref.at[next_rows])
        acc = jnp.zeros((schedule.rows_at_once, block_columns), accumulator_dtype(p.dtype))
        acc = _sum_segments(cotangents, starts, jnp.minimum(stops, starts + layout.length),
                            schedule.rows_per_step, acc)
        if layout.count:
            acc = _sum_segments(piece_partials, triton_load(row_pieces_ref.at[rows]),
                                triton_load(row_pieces_ref.at[next_rows]),
                                schedule.rows_per_step, acc)
        if schedule.blocked_output:  # one row group: the whole block; the pipeline drops
            out_ref[...] = acc.astype(out_ref.dtype)  # rows and columns past the table's end
        else:
            triton_store(out_ref.at[batch, rows[:, None], columns[None, :]],
                         acc.astype(out_ref.dtype),
                         mask=(rows < p.n)[:, None] & column_valid[None, :])
        return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(schedule.block_rows // schedule.rows_at_once),
                  row_group, 0)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    layout = pieces(p, config.block_columns)
    table = piece_table(plan, p, layout)
    column_blocks = pl.cdiv(p.columns, config.block_columns)
    partials_shape = (p.batch, max(layout.count, 1), p.columns)
    partials = jnp.zeros(partials_shape, accumulator_dtype(p.dtype))
    partial_bytes = layout.count * p.batch * p.columns * partials.dtype.itemsize
    if layout.count:
        partials = triton_call(
            functools.partial(_piece_kernel, p=p, block_columns=config.block_columns),
            out_shape=jax.ShapeDtypeStruct(partials_shape, partials.dtype),
            grid=(p.batch * layout.count, column_blocks),
            num_warps=4,
            num_stages=config.num_stages,
            interpret=interpret,
            flops=p.batch * p.num_indices * p.columns,
            bytes_accessed=pieces_bytes(p, partial_bytes),
            name="scatter_add_pieces_triton",
        )(plan.order, table.bounds, g)
    schedule = rows_schedule(config.block_columns)
    kernel = functools.partial(_scatter_add_kernel, p=p, block_columns=config.block_columns,
                               layout=layout, schedule=schedule)
    row_blocks = pl.cdiv(p.n, schedule.block_rows)
    specs = {}
    if schedule.blocked_output:
        specs = dict(in_specs=[pl.BlockSpec()] * 5, out_specs=pl.BlockSpec(
            (None, schedule.block_rows, config.block_columns),
            lambda t, c: (t // row_blocks, t % row_blocks, c)))
    return triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid=(p.batch * row_blocks, column_blocks),
        **specs,
        num_warps=4,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=p.batch * p.num_indices * p.columns,
        bytes_accessed=scatter_bytes(p) + partial_bytes,
        name="scatter_add_triton",
    )(plan.order, plan.row_starts, table.row_pieces, g, partials)
