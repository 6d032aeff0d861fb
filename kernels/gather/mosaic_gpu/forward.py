"""Gather as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a): the forward (the
package's docstring has both kernels' loop nests).

Block schedule
--------------
Grid `(batch · blocks,)`, one CTA (one warpgroup) per batch slice b and tile of `tile_rows`
indices (`config.plan_of`). The CTA walks its rows' pieces of `PIECE` columns through a ring
of `slots` (tile_rows, PIECE) tiles in shared memory, each with a barrier of tile_rows
arrivals:

    for piece k (the first slots - 1 started before the loop):
        start loading piece k + slots - 1 into its slot:      # once the store that used it
            for i in range(tile_rows):                        # has read it
                row = mode(indices[first + i])                 # clamp / wrap; "fill": in range?
                TMA: x[b, row, piece] (or the fill row) -> slot[i]
        wait for piece k's slot; TMA: slot -> out[b, tile, piece]

A gather copies bits: rows move GMEM to shared memory to GMEM by TMA and never pass through
registers, so NaN payloads and -0.0 survive, and `slots - 1` tiles load while one is stored.
An out-of-range row under "fill" copies a one-row array of the fill value instead (built by
XLA, one row), so every copy arrives on its barrier and no register pass masks anything. Each
row index is in [0, n) before its copy, and the tile's positions past the last index repeat
it (their rows are dropped by the store: TMA drops writes past an array's edge), so no copy
leaves an array whatever the index values.

Memory traffic: each gathered row read once and written once, as `common.gather_bytes`, plus
the indices read once per piece (4 bytes against the piece's 512 or more; from L1 after the
first; `_cost`). Rows that are not a multiple of 16 bytes (TMA's stride rule) are padded: a
copy of the whole table before the launch and of the output after it, by XLA (the last-axis
gather's rows of one element, for one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import PIECE, mosaic_gpu_call, piece_columns, smem
from kernels.gather.common import GatherConfig, Problem, gather_bytes, row_of_index
from kernels.gather.mosaic_gpu.config import Plan, plan_of

__all__ = ["gather", "padded_rows"]


def padded_rows(a: jax.Array, plan: Plan) -> jax.Array:
    """`a` (batch, rows, columns) with rows of `plan.aligned` columns (a copy where they are
    not already)."""
    extra = plan.aligned - a.shape[-1]
    return a if not extra else jnp.pad(a, ((0, 0), (0, 0), (0, extra)))


def _gather_tile(indices_ref, x_ref, fill_ref, out_ref, tiles, barriers, p: Problem,
                 plan: Plan) -> None:
    """The body of one CTA."""
    program = jax.lax.axis_index("tiles")
    batch, first = program // plan.blocks, program % plan.blocks * plan.tile_rows

    def load_piece(piece, slot):
        def copy_row(i, carry):
            index = indices_ref[jnp.minimum(first + i, p.num_indices - 1)]
            row, in_range = row_of_index(index, p.n, p.mode)
            destination = tiles.at[slot, pl.ds(i, 1)]
            source = x_ref.at[batch, pl.ds(row, 1), piece_columns(piece)]
            if fill_ref is None:
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot])
                return carry

            @pl.when(in_range)
            def _():
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot])

            @pl.when(jnp.logical_not(in_range))
            def _():
                plgpu.copy_gmem_to_smem(fill_ref.at[:, piece_columns(piece)], destination,
                                        barriers.at[slot])
            return carry

        jax.lax.fori_loop(0, plan.tile_rows, copy_row, 0)

    for piece in range(plan.slots - 1):
        load_piece(jnp.int32(piece), piece)

    def store_piece(piece, carry):
        ahead = piece + plan.slots - 1

        @pl.when(ahead < plan.num_pieces)
        def _():
            # Its slot was last stored from at piece - 1: that store must have read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load_piece(ahead, ahead % plan.slots)

        slot = piece % plan.slots
        plgpu.barrier_wait(barriers.at[slot])
        plgpu.copy_smem_to_gmem(tiles.at[slot], out_ref.at[
            batch, pl.ds(first, plan.tile_rows), piece_columns(piece)])
        return carry

    jax.lax.fori_loop(0, plan.num_pieces, store_piece, 0)
    plgpu.wait_smem_to_gmem(0)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    plan = plan_of(p, config)
    table = padded_rows(x, plan)
    operands = [indices, table]
    if p.mode == "fill":
        operands.append(jnp.full((1, plan.aligned), p.fill_value, x.dtype))
    body = functools.partial(_body, p=p, plan=plan, has_fill=p.mode == "fill")
    out = mosaic_gpu_call(
        body, out_shape=[jax.ShapeDtypeStruct((p.batch, p.num_indices, plan.aligned), x.dtype)],
        grid=(plan.programs,), grid_names=("tiles",), interpret=interpret,
        name="gather_mosaic_gpu",
        scratch=[smem((plan.slots, plan.tile_rows, PIECE), x.dtype),
                 plgpu.Barrier(num_arrivals=plan.tile_rows, num_barriers=plan.slots)],
        flops_and_bytes=(0, _cost(p, plan)))(*operands)[0]
    return out[..., :p.columns] if plan.aligned != p.columns else out


def _body(*refs, p: Problem, plan: Plan, has_fill: bool) -> None:
    indices_ref, x_ref, *rest = refs
    fill_ref = rest.pop(0) if has_fill else None
    _gather_tile(indices_ref, x_ref, fill_ref, *rest, p=p, plan=plan)


def _cost(p: Problem, plan: Plan) -> int:
    """`gather_bytes` at the padded rows, with the indices read once per piece."""
    padded = p._replace(columns=plan.aligned)
    return gather_bytes(padded) + 4 * p.batch * p.num_indices * (plan.num_pieces - 1)
