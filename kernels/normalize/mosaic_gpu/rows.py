"""What both Mosaic GPU normalize kernels (`forward.py`, `backward.py`) share: the views they
take of their operands (the (rows, aligned) matrix of the 3-D view, `rows_view`, and back; an
output's matrix, `output_matrix`; per-row statistics padded to whole blocks, `padded_rows`;
scale and offset as rows of whole pieces, `params_view`), a piece's register layout
(`layout_of`), the loop over a row's pieces (`fold`), a CTA's walk over its blocks
(`walk_blocks`, through `input_buffers`), the way its outputs leave (`output_buffers`,
`output_writer`), the rows it stages once (`stage_rows`, read by `param_piece`) and what a
streamed plan reads again (`reread_bytes`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, BlockBuffers, BlockWriter, RowWriter,
                                        StreamedRows, pad_to, row_layout, smem, stored_shape)
from kernels.normalize.common import Problem
from kernels.normalize.mosaic_gpu.config import Plan

__all__ = ["layout_of", "fold", "input_buffers", "output_buffers", "output_writer",
           "walk_blocks", "stage_rows", "param_piece", "reread_bytes", "rows_view",
           "output_matrix", "from_rows_view", "padded_rows", "params_view"]


def layout_of(plan: Plan) -> object:
    """The register layout of a block's piece: the 4 warps along it, 2 adjacent values a
    thread per row (a 256-column piece over 128 threads), whatever the dtype."""
    return row_layout(plan.block_rows, PIECE, jnp.dtype(jnp.float32).itemsize)


def fold(plan: Plan, step, carry):
    """carry = step(piece, carry) for each piece of the row, in order, `Plan.unroll` pieces a
    loop step."""
    return jax.lax.fori_loop(0, plan.num_pieces, step, carry, unroll=plan.unroll)


def input_buffers(plan: Plan, arrays: dict) -> tuple[dict, object]:
    """The shared memory `walk_blocks` moves `arrays` (name -> array) through: two whole
    blocks of each (resident) or a 2-piece ring, and its 2 barriers (one a block or slot,
    every array's copies into it arriving there)."""
    slots = 2 * plan.num_pieces if plan.resident else 2
    buffers = {name: smem((slots, plan.block_rows, PIECE), a.dtype)
               for name, a in arrays.items()}
    copies = len(arrays) * (plan.num_pieces if plan.resident else 1)
    return buffers, plgpu.Barrier(num_arrivals=copies, num_barriers=2)


def output_buffers(plan: Plan, dtypes: dict, whole: bool) -> dict:
    """The shared memory a block's outputs (name -> dtype) leave through: the whole block,
    stored once it is computed (`whole`), or a 2-piece ring stored piece by piece."""
    slots = plan.num_pieces if whole else 2
    return {name: smem((slots, plan.block_rows, PIECE), dtype) for name, dtype in dtypes.items()}


def output_writer(plan: Plan, gmem: dict, buffers: dict, whole: bool) -> RowWriter:
    """The writer of `output_buffers(..., whole)`: `BlockWriter` or `RowWriter`."""
    if whole:
        return BlockWriter(gmem, buffers, plan.block_rows, plan.num_pieces)
    return RowWriter(gmem, buffers, plan.block_rows)


def reread_bytes(p: Problem, plan: Plan, passes: int, element_bytes: int) -> int:
    """Bytes a streamed plan's passes after the first read again: its staged inputs,
    `element_bytes` an element of the problem (0 where the block stays in shared memory)."""
    return 0 if plan.resident else (passes - 1) * p.size * element_bytes


def walk_blocks(plan: Plan, gmem: dict, smem: dict, barriers, passes: int,
                compute: Callable, prefetch: Callable | None = None,
                ready: Callable[[], None] | None = None) -> None:
    """CTA q of the grid's `plan.programs` computes blocks q, q + programs, ... in turn:
    `compute(first, read, carry)` for the block of rows from `first`, where `read(pass_index,
    piece)` gives its pieces of the GMEM arrays `gmem` (name -> ref) in float32 registers, in
    order, `passes` times over. Resident (`Plan.resident`): the inputs move through two whole
    block buffers (`smem`: name -> (2·num_pieces, block_rows, PIECE); `barriers`: 2), the next
    block's copies started before the CTA waits for this one's; else streamed, piece by piece
    (`smem`: name -> (2, block_rows, PIECE); `barriers`: 2). `prefetch(block)`: what the walk
    carries to `compute` for a block, loaded a block ahead; `ready()`: waits for what the CTA
    staged before its walk, once the first block's copies are issued."""
    program = jax.lax.axis_index("programs")
    layout = layout_of(plan)
    if plan.resident:
        blocks = BlockBuffers(gmem, smem, barriers, plan.block_rows, plan.num_pieces)
        blocks.start(program * plan.block_rows, 0)
    else:
        rows = StreamedRows(gmem, smem, barriers, plan.block_rows, plan.num_pieces)
    if ready is not None:
        ready()
    count = (plan.num_blocks - program + plan.programs - 1) // plan.programs

    def step(i, carry):
        block = program + i * plan.programs
        first = block * plan.block_rows
        following = jnp.minimum(block + plan.programs, plan.num_blocks - 1)
        buffer = i % 2
        if plan.resident:
            @pl.when(i + 1 < count)
            def _():
                blocks.start(following * plan.block_rows, 1 - buffer)

        upcoming = carry if prefetch is None else prefetch(following)
        if plan.resident:
            blocks.wait(buffer)

            def read(pass_index, piece):
                return blocks.read(buffer, piece, layout)
        else:
            rows.start(first)

            def read(pass_index, piece):
                return rows.read(first, pass_index * plan.num_pieces + piece,
                                 passes * plan.num_pieces, layout)
        compute(first, read, carry)
        return upcoming

    jax.lax.fori_loop(0, count, step, 0 if prefetch is None else prefetch(program))


def stage_rows(gmem: dict, buffers: dict, barrier) -> tuple[dict, Callable[[], None]]:
    """Starts copying each (num_pieces, PIECE) row of `gmem` (name -> ref: scale, offset) into
    the shared-memory buffer of its name in `buffers`, one TMA copy each (a row of at most
    `TMA_MAX_BOX` pieces; `barrier`: len(gmem) arrivals); returns the staged rows (name ->
    ref) and the wait for them."""
    for name, ref in gmem.items():
        plgpu.copy_gmem_to_smem(ref, buffers[name], barrier)
    return {name: buffers[name] for name in gmem}, lambda: plgpu.barrier_wait(barrier)


def param_piece(row, piece, layout) -> jax.Array:
    """Piece `piece` of a (num_pieces, PIECE) float32 row (staged in shared memory or in GMEM),
    in the layout of a block's piece summed over its rows (`per_column` spreads it down the
    rows)."""
    return plgpu.load(row.at[piece], layout=layout.reduce(0), optimized=False)


def rows_view(a: jax.Array | None, p: Problem, plan: Plan) -> jax.Array | None:
    """The view-shaped `a` as the kernel's (rows, aligned) matrix: the columns layout
    transposed to rows (a copy), a row not a multiple of 16 bytes padded (a copy)."""
    if a is None:
        return None
    if not p.rows:
        a = jnp.swapaxes(a, 1, 2)
    return pad_to(a.reshape(plan.rows, plan.reduced), plan.aligned)


def output_matrix(plan: Plan) -> tuple[int, int]:
    """The (rows, columns) of an output the `RowWriter` stores in (block_rows, PIECE) pieces:
    (rows, aligned), or with blocks of one row, whole pieces (`stored_shape`)."""
    return stored_shape((plan.rows, plan.aligned), (plan.block_rows, PIECE))


def from_rows_view(a: jax.Array, p: Problem, plan: Plan) -> jax.Array:
    a = a[:, :plan.reduced] if a.shape[1] != plan.reduced else a
    if p.rows:
        return a.reshape(p.view_shape)
    return jnp.swapaxes(a.reshape(p.outer, p.groups, p.reduced), 1, 2)


def padded_rows(a: jax.Array, plan: Plan) -> jax.Array:
    """Per-row values for every row of every block (the last block's rows past the array read
    and write these, not past an array's edge)."""
    a = a.reshape(plan.rows)
    return jnp.pad(a, (0, plan.num_blocks * plan.block_rows - plan.rows))


def params_view(scale, offset, plan: Plan) -> dict:
    """scale and offset as float32 (num_pieces, PIECE) rows (zero past the row)."""
    return {name: jnp.pad(v.reshape(plan.reduced).astype(jnp.float32),
                          (0, plan.width - plan.reduced)).reshape(plan.num_pieces, PIECE)
            for name, v in (("scale", scale), ("offset", offset)) if v is not None}
