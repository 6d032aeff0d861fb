"""Gather as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a): the forward (the
package's docstring has both kernels' loop nests).

Block schedule
--------------
The ids come in tiles of `tile_rows`, a tile holding up to `_TILE_BYTES` of their rows (or of
a piece of them). Grid `(batch · groups · runs,)`: one CTA (one warpgroup) per batch slice b,
group of `pieces_per_group` pieces of the rows, and run of `run_tiles` consecutive tiles
(`config.forward_plan`: runs sized so that the CTAs fill one wave of the SMs evenly; one group,
the whole row, unless the tiles alone are fewer than two waves of the SMs). A piece is the
whole row where the row's bytes are a multiple of `TMA_SMEM_ALIGNMENT`, else `PIECE` columns
(or a short row rounded up to that alignment). The CTA stages its run's ids in shared memory
(a TMA copy of up to 256 of them each), then walks steps (tile, piece) through a ring of
`slots` (tile_rows, box) tiles, each with a barrier of tile_rows arrivals:

    TMA ids[run] -> shared memory; wait
    start loading the first slots - 1 steps
    for step (tile t, piece k) of the run:
        wait until step - 1's store has read its slot, then start loading step
        step + slots - 1 into it:
            for i in range(tile_rows):
                row = mode(ids[t, i])                         # clamp / wrap; "fill": in range?
                TMA: x[b, row, piece] (or the fill row) -> slot[i]
        wait for step's slot;  TMA: slot -> out[b, tile t, piece k]

A gather copies bits: rows move GMEM to shared memory to GMEM by TMA and never pass through
registers, so NaN payloads and -0.0 survive, and up to `slots - 1` tiles load while one is
stored. A whole row (or any piece inside the row: `ForwardPlan.in_bounds`) is promised in
bounds, so Mosaic GPU moves it by one linear copy (`cp.async.bulk`, no 256-element box limit);
a piece past the row's end is a tensor copy, which zero-fills. Every copy arrives on its slot's
barrier: an out-of-range row under "fill" copies a one-row array of the fill value (built by
XLA). Each row is in [0, n) before its copy, so every read is inside the table whatever the
ids; the run's ids past the last id are staged as zeros (row 0), and the store of a ragged last
tile runs past the output's rows, which TMA drops (or, where Mosaic GPU stores it as one run of
GMEM, into the padding of `stored_shape`).

Against the GPU (`config.forward_seconds`, the design model of `_targets.Target.copy_seconds`):
at the bench's embedding (8192 ids of 4096 bfloat16: 8 KiB rows, one copy an id) each CTA runs
16 one-row tiles through 6 slots of 8 KiB, 4 CTAs an SM hold 160 KiB in flight (about 7 times
what covers HBM's latency at `_targets.COPY_SHARE`), and 512 CTAs spread the ids over one wave
of the H100's 132 SMs within 3% of even: about 47 us, 85% of its bandwidth.

Memory traffic: each gathered row read once and written once, each run's ids once (`_cost`).
Rows that are not a multiple of 16 bytes (TMA's stride rule) are padded: a copy of the whole
table before the launch and of the output after it, by XLA (`config.check` declines where that
copy would move over `_MAX_PADDING` times the gathered rows: a last-axis gather of long rows,
say).
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


def _gather_run(indices_ref, x_ref, fill_ref, out_ref, tiles, ids, barriers, ids_barrier,
                p: Problem, plan: ForwardPlan) -> None:
    """The body of one CTA."""
    program = jax.lax.axis_index("runs")
    run, line = program % plan.runs, program // plan.runs
    group, batch = line % plan.groups, line // plan.groups
    first_tile = run * plan.run_tiles
    first_id = first_tile * plan.tile_rows
    first_piece = group * plan.pieces_per_group
    num_pieces = jnp.minimum(plan.pieces_per_group, plan.num_pieces - first_piece)
    num_steps = jnp.minimum(plan.run_tiles, plan.blocks - first_tile) * num_pieces
    # The run's ids, before any row copy needs one (zeros past the last id: row 0, whose
    # positions the stores drop).
    for k in range(plan.id_copies):
        plgpu.copy_gmem_to_smem(indices_ref.at[pl.ds(first_id + k * plan.id_box, plan.id_box)],
                                ids.at[pl.ds(k * plan.id_box, plan.id_box)], ids_barrier)
    plgpu.barrier_wait(ids_barrier)
    oob_mode = plgpu.OOBFillMode.PROMISE_IN_BOUNDS if plan.in_bounds else None

    def tile_and_columns(step):
        tile, piece = step // num_pieces, step % num_pieces
        return tile, piece_columns(first_piece + piece, plan.box)

    def load_step(step, slot):
        tile, columns = tile_and_columns(step)

        def copy_row(i, carry):
            row, in_range = row_of_index(ids[tile * plan.tile_rows + i], p.n, p.mode)
            destination = tiles.at[slot, pl.ds(i, 1)]
            source = x_ref.at[batch, pl.ds(row, 1), columns]
            if fill_ref is None:
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot],
                                        oob_mode=oob_mode)
                return carry

            @pl.when(in_range)
            def _():
                plgpu.copy_gmem_to_smem(source, destination, barriers.at[slot],
                                        oob_mode=oob_mode)

            @pl.when(jnp.logical_not(in_range))
            def _():
                plgpu.copy_gmem_to_smem(fill_ref.at[:, columns], destination,
                                        barriers.at[slot], oob_mode=oob_mode)
            return carry

        jax.lax.fori_loop(0, plan.tile_rows, copy_row, 0)

    for step in range(plan.slots - 1):
        @pl.when(step < num_steps)
        def _():
            load_step(step, step)

    def store_step(step, carry):
        ahead = step + plan.slots - 1

        @pl.when(ahead < num_steps)
        def _():
            # Its slot was stored from at step - 1 (or never): that store has read it. (Not
            # after step's own store: with one slot, `ahead` is `step`.)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load_step(ahead, ahead % plan.slots)

        slot = step % plan.slots
        tile, columns = tile_and_columns(step)
        plgpu.barrier_wait(barriers.at[slot])
        first = first_id + tile * plan.tile_rows
        plgpu.copy_smem_to_gmem(tiles.at[slot],
                                out_ref.at[batch, pl.ds(first, plan.tile_rows), columns])
        return carry

    jax.lax.fori_loop(0, num_steps, store_step, 0)
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
        grid=(plan.programs,), grid_names=("runs",), interpret=interpret,
        name="gather_mosaic_gpu",
        scratch=[smem((plan.slots, plan.tile_rows, plan.box), x.dtype),
                 plgpu.SMEM((plan.id_copies * plan.id_box,), jnp.int32),  # read by scalars
                 plgpu.Barrier(num_arrivals=plan.tile_rows, num_barriers=plan.slots),
                 plgpu.Barrier(num_arrivals=plan.id_copies)],
        flops_and_bytes=(0, _cost(p, plan)))(*operands)[0]
    return out[:, :p.num_indices, :p.columns]


def _body(*refs, p: Problem, plan: ForwardPlan, has_fill: bool) -> None:
    indices_ref, x_ref, *rest = refs
    fill_ref = rest.pop(0) if has_fill else None
    _gather_run(indices_ref, x_ref, fill_ref, *rest, p=p, plan=plan)


def _cost(p: Problem, plan: ForwardPlan) -> int:
    """Each gathered row's pieces read once (the last tile's positions past the ids read row 0)
    and written once, and each CTA's run of ids staged once."""
    rows = p.batch * plan.blocks * plan.tile_rows
    written = p.batch * p.num_indices
    ids = plan.programs * plan.id_copies * plan.id_box
    return (rows + written) * plan.aligned * p.itemsize + 4 * ids
