"""The views both Mosaic GPU normalize kernels (`forward.py`, `backward.py`) take of their
operands and pieces: the (rows, aligned) matrix of the 3-D view (`rows_view`, and back; an
output's matrix, `output_matrix`), per-row
statistics padded to whole blocks (`padded_rows`), scale and offset padded to whole pieces
(`params_view`), a piece's register layout (`layout_of`) and the loop over a row's pieces
(`fold`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels._pallas.mosaic_gpu import PIECE, pad_to, row_layout, stored_shape
from kernels.normalize.common import Problem
from kernels.normalize.mosaic_gpu.config import Plan

__all__ = ["layout_of", "fold", "rows_view", "output_matrix", "from_rows_view", "padded_rows",
           "params_view"]


def layout_of(plan: Plan) -> object:
    """The register layout of a block's piece: the 4 warps along it, 2 adjacent values a
    thread per row (a 256-column piece over 128 threads), whatever the dtype."""
    return row_layout(plan.block_rows, PIECE, jnp.dtype(jnp.float32).itemsize)


def fold(plan: Plan, step, carry):
    """carry = step(piece, carry) for each piece of the row, in order, `Plan.unroll` pieces a
    loop step."""
    return jax.lax.fori_loop(0, plan.num_pieces, step, carry, unroll=plan.unroll)


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
    """scale and offset as float32 rows of the pieces' width (zero past the row)."""
    return {name: jnp.pad(v.reshape(plan.reduced).astype(jnp.float32),
                          (0, plan.width - plan.reduced))
            for name, v in (("scale", scale), ("offset", offset)) if v is not None}
