"""The scatter-add gradient of gather as Pallas kernels lowered through Mosaic GPU (sm_90a,
sm_100a) (the package's docstring has both kernels' loop nests).

Block schedule (deterministic scatter-add)
------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`: `order` lists the index
positions by target row, `row_starts` delimits each table row's segment) and bounds each
row's work as the Triton backward does (`common.Pieces`, `common.piece_table`): a row's first
`length` positions (about sqrt(m)) are its owner's, the rest are cut into pieces of `length`
positions. XLA also lists the owners' positions compacted (`_owner_walk`: `walk`, with
`walk_starts` per row), so that a block of table rows owns one contiguous range of it, as a
block of pieces owns one contiguous range of partial rows. A CTA owns whole rows: it sums a
span of `span_pieces` pieces of `PIECE` columns at a time (the whole row, up to
`_SPAN_PIECES` pieces), so it walks its ids once a span, and one span covers rows of up to
4096 columns. Both kernels sum contiguous ranges of positions through `_Ring`: slots of one
span in shared memory, a barrier each, `slots` spans in flight by TMA, each row's sum in
float32 registers.

    scatter_add_pieces (launched when some row may be hit more than `length` times),
    CTA (b, piece q of positions), for each span k:
        partials[b, q, k] = sum(g[b, order[s], k] for s in q's positions)
    scatter_add, CTA (b, block of tile_rows table rows), for each span k:
        for each row r of the block:
            if r is hit:
                acc = sum(g[b, walk[s], k] for s in walk_starts[r] .. walk_starts[r + 1])
                acc += sum(partials[b, q, k] for q in r's pieces)
                out slot <- acc;  TMA: out slot -> dx[b, r, k]         # 2 slots
            else:
                TMA: zero span -> dx[b, r, k]

A span of a row of whole pieces (`BackwardPlan.whole`) is one linear copy, loads and stores
alike; other rows move a piece a copy, TMA zero-filling the columns past the row on loads. A
piece's store is one run of GMEM, which Mosaic GPU copies linearly, clamped only at the
array's end, so the row's last piece stores only the row's `tail` columns and a span's pieces
past the row store nothing (a whole piece there would overwrite the next row's first
columns). Every table row is written once a span, zeros included, by the CTA that
owns it; dropped indices sort past the last row and are never read. No atomics: each output
element has one writer and a fixed summation order (the stable sort's), so every run gives the
same bits. No row costs its owner more than its first `length` positions and its pieces'
partial rows (about 2 sqrt(m) in all), whatever the ids.

Against the GPU (`config.backward_seconds`): at the bench's embedding (8192 ids into 32000 rows
of 4096 bfloat16) 1033 CTAs of 31 rows, 2 an SM, each with 3 spans of 8 KiB loading while it
sums one; the stores are not waited for, but for the slot they read. With XLA's launches that
sort the ids, the model's gradient takes under half the time of XLA's own in the H100 record.

Memory traffic (`_rows_cost`, `_pieces_cost`): each cotangent row read once (by its owner or
by one piece: an overlapping last span reads some columns twice, `moved_columns`), the pieces'
float32 partial rows written and read once, the table gradient written once, the positions and
segment starts once a span. Rows that are not a multiple of 16 bytes (TMA's
stride rule) are padded: a copy of the cotangent before the launches and of the gradient after
them, by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, load, mosaic_gpu_call, pad_to,
                                        piece_columns, row_layout, smem, store)
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, accumulator_dtype,
                                   piece_table)
from kernels.gather.mosaic_gpu.config import BackwardPlan, backward_plan

__all__ = ["scatter_add"]

_LAYOUT_ITEMSIZE = 4  # a span of float32 in registers: 2 values a thread a piece


class _Span:
    """Span `span` of the rows of a GMEM ref, (batch, rows, num_pieces, PIECE) where the rows
    are whole pieces (one linear copy a row), else (batch, rows, aligned) (a copy a piece: a
    load zero-fills past the row; a store stops at it)."""

    def __init__(self, plan: BackwardPlan, span, whole: bool):
        self.plan, self.whole = plan, whole
        self.first = plan.span_start(span)

    def load(self, source, batch, row, slot, barrier) -> None:
        """Row `row` of `source[batch]`'s span into `slot` (a (1, span_pieces, PIECE) ref)."""
        if self.whole:
            plgpu.copy_gmem_to_smem(
                source.at[batch, pl.ds(row, 1), pl.ds(self.first, self.plan.span_pieces)],
                slot, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            return
        for i in range(self.plan.span_pieces):
            plgpu.copy_gmem_to_smem(source.at[batch, pl.ds(row, 1),
                                              piece_columns(self.first + i)],
                                    slot.at[:, i], barrier)

    def store(self, slot, destination, batch, row) -> None:
        """`slot` (a (1, span_pieces, PIECE) ref) into row `row` of `destination[batch]`:
        each piece inside the row whole, the last its `BackwardPlan.tail` columns (a store is
        a linear copy that nothing clips at the row's end), none past the row."""
        if self.whole:
            plgpu.copy_smem_to_gmem(slot, destination.at[
                batch, pl.ds(row, 1), pl.ds(self.first, self.plan.span_pieces)])
            return
        last, tail = self.plan.num_pieces - 1, self.plan.tail
        for i in range(self.plan.span_pieces):
            piece = self.first + i

            @pl.when(piece < last)
            def _():
                plgpu.copy_smem_to_gmem(slot.at[:, i], destination.at[
                    batch, pl.ds(row, 1), piece_columns(piece)])

            @pl.when(piece == last)
            def _():
                plgpu.copy_smem_to_gmem(slot.at[:, i, pl.ds(0, tail)], destination.at[
                    batch, pl.ds(row, 1), pl.ds(last * PIECE, tail)])


class _Ring:
    """Positions [start, stop) of a walk, position s being row `row_of(s)` of `source[batch]`,
    its span moved into `slots` (depth, span_pieces, PIECE) of shared memory, a barrier each; a
    position's slot is (s - start) % depth, refilled with position s + depth once every thread
    has read it."""

    def __init__(self, source, row_of, batch, span: _Span, slots, barriers, start, stop):
        self.source, self.row_of, self.batch, self.span = source, row_of, batch, span
        self.slots, self.barriers, self.start, self.stop = slots, barriers, start, stop
        self.depth = slots.shape[0]
        self.layout = row_layout(span.plan.span_pieces, PIECE, _LAYOUT_ITEMSIZE)

    def _load(self, position) -> None:
        @pl.when(position < self.stop)
        def _():
            slot = (position - self.start) % self.depth
            self.span.load(self.source, self.batch, self.row_of(position),
                           self.slots.at[pl.ds(slot, 1)], self.barriers.at[slot])

    def prefetch(self) -> None:
        """Starts loading the first `depth` positions."""
        def load_one(position, carry):
            self._load(position)
            return carry

        jax.lax.fori_loop(self.start, self.start + self.depth, load_one, 0)

    def total(self, first, last, acc: jax.Array) -> jax.Array:
        """acc + the spans of positions [first, last), which must be the walk's next ones."""
        def add(position, acc):
            slot = (position - self.start) % self.depth
            plgpu.barrier_wait(self.barriers.at[slot])
            row = load(self.slots.at[slot], self.layout)
            plgpu.commit_smem()  # every thread has read the slot: it may be refilled
            self._load(position + self.depth)
            return acc + row.astype(acc.dtype)

        return jax.lax.fori_loop(first, last, add, acc)

    def zeros(self) -> jax.Array:
        return plgpu.layout_cast(jnp.zeros(self.slots.shape[1:], jnp.float32), self.layout)


def _ring_scratch(plan: BackwardPlan, dtype, slots: int, copies: int) -> list:
    """A `_Ring`'s slots and barriers."""
    return [smem((slots, plan.span_pieces, PIECE), dtype),
            plgpu.Barrier(num_arrivals=copies, num_barriers=slots)]


def _pieces_body(order_ref, bounds_ref, g_ref, partials_ref, slots, out, barriers,
                 plan: BackwardPlan) -> None:
    """One CTA of the pieces kernel: one piece of positions, every span of the row."""
    program = jax.lax.axis_index("pieces")
    batch, q = program // plan.pieces.count, program % plan.pieces.count
    start, stop = bounds_ref[q, 0], bounds_ref[q, 1]

    def sum_span(k, carry):
        ring = _Ring(g_ref, lambda s: order_ref[s], batch, _Span(plan, k, plan.whole), slots,
                     barriers, start, stop)
        ring.prefetch()
        # The last span's store is done: it has read `out`, and it may overlap this one's.
        plgpu.wait_smem_to_gmem(0)
        store(out.at[0], ring.total(start, stop, ring.zeros()))
        plgpu.commit_smem()
        _Span(plan, k, True).store(out, partials_ref, batch, q)
        return carry

    jax.lax.fori_loop(0, plan.spans, sum_span, 0)
    plgpu.wait_smem_to_gmem(0)


def _rows_body(*refs, p: Problem, plan: BackwardPlan) -> None:
    """One CTA of the scatter-add: `tile_rows` table rows, every span of them. Without pieces,
    it takes no partial rows and no ring for them."""
    if plan.pieces.count:
        (walk_ref, walk_starts_ref, row_pieces_ref, g_ref, partials_ref, dx_ref, slots, out,
         zero, barriers, partial_slots, partial_barriers) = refs
    else:
        walk_ref, walk_starts_ref, g_ref, dx_ref, slots, out, zero, barriers = refs
    program = jax.lax.axis_index("blocks")
    batch, block = program // plan.blocks, program % plan.blocks
    first_row = block * plan.tile_rows
    last_row = jnp.minimum(first_row + plan.tile_rows, p.n)
    layout = row_layout(plan.span_pieces, PIECE, _LAYOUT_ITEMSIZE)
    # Rows no id lands on (most of a vocabulary's) are stored from this span of zeros.
    store(zero.at[0], plgpu.layout_cast(jnp.zeros(zero.shape[1:], jnp.float32),
                                        layout).astype(zero.dtype))
    plgpu.commit_smem()

    def sum_span(k, carry):
        span = _Span(plan, k, plan.whole)
        owned = _Ring(g_ref, lambda s: walk_ref[s], batch, span, slots, barriers,
                      walk_starts_ref[first_row], walk_starts_ref[last_row])
        owned.prefetch()
        if plan.pieces.count:
            partials = _Ring(partials_ref, lambda s: s, batch, _Span(plan, k, True),
                             partial_slots, partial_barriers, row_pieces_ref[first_row],
                             row_pieces_ref[last_row])
            partials.prefetch()

        def sum_row(row, written):
            start, stop = walk_starts_ref[row], walk_starts_ref[row + 1]
            hit = start < stop  # a row with pieces has its first positions here too

            @pl.when(hit)
            def _():
                acc = owned.total(start, stop, owned.zeros())
                if plan.pieces.count:
                    acc = partials.total(row_pieces_ref[row], row_pieces_ref[row + 1], acc)
                slot = written % 2
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # its last store has read it
                store(out.at[slot], acc.astype(out.dtype))
                plgpu.commit_smem()
                span.store(out.at[pl.ds(slot, 1)], dx_ref, batch, row)

            @pl.when(jnp.logical_not(hit))
            def _():
                span.store(zero, dx_ref, batch, row)
            return written + hit.astype(jnp.int32)

        jax.lax.fori_loop(first_row, last_row, sum_row, 0)
        plgpu.wait_smem_to_gmem(0)  # the next span's stores may overlap this one's
        return carry

    jax.lax.fori_loop(0, plan.spans, sum_span, 0)


def _owner_walk(plan: ScatterPlan, n: int, length: int) -> tuple[jax.Array, jax.Array]:
    """(walk, walk_starts): the positions' cotangent rows (`order`) that row owners sum, each
    row's first `length`, compacted in sorted order, and where each row's begin (n + 1). With
    XLA, O(m + n), no loop."""
    hits = plan.row_starts[1:] - plan.row_starts[:-1]
    walk_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                   jnp.cumsum(jnp.minimum(hits, length), dtype=jnp.int32)])
    positions = jnp.arange(plan.order.shape[0], dtype=jnp.int32)
    row = jnp.minimum(plan.targets, n - 1)  # dropped positions (target n) are not kept
    rank = positions - plan.row_starts[row]
    kept = (plan.targets < n) & (rank < length)
    destination = jnp.where(kept, walk_starts[row] + rank, positions.shape[0])
    walk = jnp.zeros_like(plan.order).at[destination].set(plan.order, mode="drop")
    return walk, walk_starts


def _sum_pieces(g, plan: ScatterPlan, bounds, p: Problem, schedule: BackwardPlan,
                interpret) -> jax.Array:
    """The pieces' float32 partial rows, (batch, count, partial_pieces, PIECE)."""
    slots, barriers = _ring_scratch(schedule, g.dtype, schedule.slots, schedule.copies_per_span)
    dtype = accumulator_dtype(p.dtype)
    shape = (p.batch, schedule.pieces.count, schedule.partial_pieces, PIECE)
    return mosaic_gpu_call(
        functools.partial(_pieces_body, plan=schedule),
        out_shape=[jax.ShapeDtypeStruct(shape, dtype)],
        grid=(p.batch * schedule.pieces.count,), grid_names=("pieces",),
        interpret=interpret, name="scatter_add_pieces_mosaic_gpu",
        scratch=[slots, smem((1, schedule.span_pieces, PIECE), dtype), barriers],
        flops_and_bytes=_pieces_cost(p, schedule))(plan.order, bounds, g)[0]


def _rows_view(a: jax.Array, plan: BackwardPlan) -> jax.Array:
    """(batch, rows, aligned) as `_Span` takes it: whole pieces, or as it is."""
    return a.reshape(*a.shape[:2], plan.num_pieces, PIECE) if plan.whole else a


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    schedule = backward_plan(p, config)
    g = _rows_view(pad_to(g, schedule.aligned), schedule)
    span = (1, schedule.span_pieces, PIECE)
    scratch = [smem((schedule.slots, *span[1:]), g.dtype), smem((2, *span[1:]), g.dtype),
               smem(span, g.dtype),
               plgpu.Barrier(num_arrivals=schedule.copies_per_span, num_barriers=schedule.slots)]
    if schedule.pieces.count:
        table = piece_table(plan, p, schedule.pieces)
        partials = _sum_pieces(g, plan, table.bounds, p, schedule, interpret)
        operands = [*_owner_walk(plan, p.n, schedule.pieces.length), table.row_pieces, g,
                    partials]
        scratch += _ring_scratch(schedule, partials.dtype, schedule.partial_slots, 1)
    else:  # every position is its row owner's
        operands = [plan.order, plan.row_starts, g]
    dx = mosaic_gpu_call(
        functools.partial(_rows_body, p=p, plan=schedule),
        out_shape=[jax.ShapeDtypeStruct((p.batch, p.n, *g.shape[2:]), g.dtype)],
        grid=(schedule.programs,), grid_names=("blocks",), interpret=interpret,
        name="scatter_add_mosaic_gpu", scratch=scratch,
        flops_and_bytes=_rows_cost(p, schedule))(*operands)[0]
    return dx.reshape(p.batch, p.n, -1)[..., :p.columns]


# Each cotangent row is read once, by its row's owner or by one piece, which the ids decide:
# the rows kernel's figure counts them all, the pieces kernel's only its partial rows, so that
# the two sum to what both move.


def _pieces_cost(p: Problem, plan: BackwardPlan) -> tuple[int, int]:
    """The partial rows written once, the pieces' bounds once."""
    partials = p.batch * plan.pieces.count
    return 0, partials * (plan.partial_pieces * PIECE * 4 + 8)


def _rows_cost(p: Problem, plan: BackwardPlan) -> tuple[int, int]:
    """One add per cotangent element; every cotangent row read once and the table gradient
    written once (their spans' `moved_columns`), the partial rows read once (every piece of
    their spans); the positions and the segment starts once a span."""
    rows, partials = p.batch * p.num_indices, p.batch * plan.pieces.count
    index_bytes = 4 * p.batch * plan.spans * (p.num_indices + 2 * (p.n + 1))
    moved = plan.moved_columns
    partial_columns = moved if plan.whole else plan.partial_pieces * PIECE
    return rows * plan.aligned, ((rows + p.batch * p.n) * moved * p.itemsize
                                 + partials * partial_columns * 4 + index_bytes)
