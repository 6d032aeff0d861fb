"""Gather as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a): the forward (the
package's docstring has both kernels' loop nests).

Block schedule
--------------
Grid `(batch · blocks · groups,)`: one CTA (one warpgroup) per batch slice b, tile of
`tile_rows` ids and group of `pieces_per_group` pieces of `box` columns of the rows
(`config.forward_plan`: one group, the whole row, unless the tiles alone are fewer than two
waves of the target's SMs). The CTA walks its pieces through a ring of `slots` (tile_rows,
box) tiles in shared memory, each with a barrier of tile_rows arrivals:

    start loading the first slots - 1 pieces
    for piece k of the group:
        wait until piece k - 1's store has read its slot, then start loading piece
        k + slots - 1 into it:
            for i in range(tile_rows):
                row = mode(ids[first + i])                    # clamp / wrap; "fill": in range?
                TMA: x[b, row, piece] (or the fill row) -> slot[i]
        wait for piece k's slot;  TMA: slot -> out[b, tile, piece k]

A gather copies bits: rows move GMEM to shared memory to GMEM by TMA and never pass through
registers, so NaN payloads and -0.0 survive, and up to `slots - 1` tiles load while one is
stored. Every copy arrives on its slot's barrier: an out-of-range row under "fill" copies a
one-row array of the fill value (built by XLA), and the tile's positions past the last id
repeat it. Each row is in [0, n) before its copy, so every read is inside the table whatever
the ids; the store of a ragged last tile runs past the output's rows, which TMA drops (or,
where Mosaic GPU stores it as one run of GMEM, into the padding of `stored_shape`).

Memory traffic: each gathered row read once and written once, the ids read once per piece
(`_cost`; 4 bytes against the piece's 16 to 1024, from L1 after the first). Rows that are not
a multiple of 16 bytes (TMA's stride rule) are padded: a copy of the whole table before the
launch and of the output after it, by XLA (`config.check` declines where that copy would move
over `_MAX_PADDING` times the gathered rows: a last-axis gather of long rows, say).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (mosaic_gpu_call, pad_to, piece_columns, smem,
                                        stored_shape)
from kernels.gather.common import GatherConfig, Problem, row_of_index
from kernels.gather.mosaic_gpu.config import ForwardPlan, forward_plan

__all__ = ["gather"]


def _gather_tile(indices_ref, x_ref, fill_ref, out_ref, tiles, barriers, p: Problem,
                 plan: ForwardPlan) -> None:
    """The body of one CTA."""
    program = jax.lax.axis_index("tiles")
    group, tile = program % plan.groups, program // plan.groups
    batch, first = tile // plan.blocks, tile % plan.blocks * plan.tile_rows
    first_piece = group * plan.pieces_per_group
    num_pieces = jnp.minimum(plan.pieces_per_group, plan.num_pieces - first_piece)

    def load_piece(piece, slot):
        columns = piece_columns(first_piece + piece, plan.box)

        def copy_row(i, carry):
            index = indices_ref[jnp.minimum(first + i, p.num_indices - 1)]
            row, in_range = row_of_index(index, p.n, p.mode)
            destination = tiles.at[slot, pl.ds(i, 1)]
            source = x_ref.at[batch, pl.ds(row, 1), columns]
            if fill_ref is None:
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot])
                return carry

            @pl.when(in_range)
            def _():
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot])

            @pl.when(jnp.logical_not(in_range))
            def _():
                plgpu.copy_gmem_to_smem(fill_ref.at[:, columns], destination,
                                        barriers.at[slot])
            return carry

        jax.lax.fori_loop(0, plan.tile_rows, copy_row, 0)

    for piece in range(plan.slots - 1):
        @pl.when(piece < num_pieces)
        def _():
            load_piece(piece, piece)

    def store_piece(piece, carry):
        ahead = piece + plan.slots - 1

        @pl.when(ahead < num_pieces)
        def _():
            # Its slot was stored from at piece - 1 (or never): that store has read it. (Not
            # after piece's own store: with one slot, `ahead` is `piece`.)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load_piece(ahead, ahead % plan.slots)

        slot = piece % plan.slots
        plgpu.barrier_wait(barriers.at[slot])
        plgpu.copy_smem_to_gmem(tiles.at[slot], out_ref.at[
            batch, pl.ds(first, plan.tile_rows), piece_columns(first_piece + piece, plan.box)])
        return carry

    jax.lax.fori_loop(0, num_pieces, store_piece, 0)
    plgpu.wait_smem_to_gmem(0)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    plan = forward_plan(p, config)
    operands = [indices, pad_to(x, plan.aligned)]
    if p.mode == "fill":
        operands.append(jnp.full((1, plan.aligned), p.fill_value, x.dtype))
    body = functools.partial(_body, p=p, plan=plan, has_fill=p.mode == "fill")
    shape = stored_shape((p.batch, p.num_indices, plan.aligned), (plan.tile_rows, plan.box))
    out = mosaic_gpu_call(
        body, out_shape=[jax.ShapeDtypeStruct(shape, x.dtype)],
        grid=(plan.programs,), grid_names=("tiles",), interpret=interpret,
        name="gather_mosaic_gpu",
        scratch=[smem((plan.slots, plan.tile_rows, plan.box), x.dtype),
                 plgpu.Barrier(num_arrivals=plan.tile_rows, num_barriers=plan.slots)],
        flops_and_bytes=(0, _cost(p, plan)))(*operands)[0]
    return out[:, :p.num_indices, :p.columns]


def _body(*refs, p: Problem, plan: ForwardPlan, has_fill: bool) -> None:
    indices_ref, x_ref, *rest = refs
    fill_ref = rest.pop(0) if has_fill else None
    _gather_tile(indices_ref, x_ref, fill_ref, *rest, p=p, plan=plan)


def _cost(p: Problem, plan: ForwardPlan) -> int:
    """Each gathered row's pieces read once (the last tile's repeated positions too) and
    written once, and the ids read once per piece."""
    rows = p.batch * plan.blocks * plan.tile_rows
    written = p.batch * p.num_indices
    return (rows + written) * plan.aligned * p.itemsize + 4 * rows * plan.num_pieces
