"""Gather and its scatter-add gradient as Pallas kernels lowered through Mosaic (TPU).

Each kernel's loop nest, per grid step (blocks and the DMA ring: `mosaic_config.py`; 16-bit
and 8-bit rows as 32-bit word-rows: `mosaic_words.py`):

    gather, 32-bit tables, step (batch block, index block j):
        stage indices[j] into SMEM                            # 128 at a time
        for k in range(128): start DMA x[batch block, mode(index k)] -> out[batch block, k]
        wait for all of them
    gather, 16/8-bit tables, step (range r, b, k), in order within (r, b), on index block
    j = r * blocks_per_range + k:
        if k == 0: fill the ring                              # `depth` DMAs in flight
        for i in range(128):
            words = wait for the word-row holding row mode(index i) in its ring slot
            rows[i] = row_of_word(words, row % rows_per_word)
            start the DMA of position i + depth's word-row    # the last `depth`: block j + 1
        out[b, j] = rows                                      # written by the pipeline
    scatter_add, step (b, row block r, column block c):
        acc = 0                                               # float32, in VMEM
        fill the ring                                         # `depth` DMAs in flight
        for i in the sorted positions whose target row is in r:
            acc[target[i] - first row of r] += row_of_word(wait for g[b, order[i], c]'s
                                                           word-row)
            start the DMA of position i + depth's word-row
        dx[b, r, c] = acc                                     # written by the pipeline

The ring (`_Ring`; its depth from `mosaic_config.ring_depth`): `depth` buffers of one word-row
each, with a semaphore each, as many as hold 1 MiB, between 8 and 64: at least 1 MiB in
flight for rows of 4096 columns and more, 64 copies of narrower ones (256 KiB at 1024
columns). Indices are staged into SMEM 128 at a time into `staged_blocks()` slots (3 on a
TPU), the next block arriving while one is used, so the ring fills once per sequence of
positions and drains once at its end, not at each staging block.

Both kernels work on the `(batch, n, columns)` view of the table (see common.py), bit-cast in
the wrapper to the signed integer of the table's width (a free view): the kernels copy bits,
never arithmetic values, so NaN payloads and -0.0 survive.

What the TPU's memory layout allows (checked with the real compiler, `kernels.compile`): a
32-bit table row is one contiguous run of each (8, 128) memory tile, so a DMA can move a single
row at any offset. 16-bit and 8-bit tables pack 2 or 4 adjacent rows into each 32-bit word of a
tile, so a DMA cannot start at any row; but viewed as int32 (`Ref.bitcast`, free: the same
tiles) such a table is (n / 2 or n / 4, columns) "word-rows", each a single 32-bit row that a
DMA can move at any offset. The row wanted is then shifted out of each word in registers:
2x (4x) the row's bytes moved, where moving a whole packed tile would cost 16x (32x).

Indices are staged from HBM into SMEM `INDEX_BLOCK` (128) at a time, at offsets that are
multiples of 128 (1-D int32 arrays are tiled by 128 words); the wrapper pads the index vector to
a multiple of 128 so every staging copy stays inside it, and no step uses a padded entry.

Forward, 32-bit tables: row DMAs, HBM to HBM
---------------------------------------------
The table, the output and a small `fill` block stay in HBM (`memory_space=pl.ANY`).
grid = (cdiv(batch, block_batch), cdiv(m, 128)), both "parallel". Step (i, j) stages its 128
indices, then for each of its (at most 128) positions counts a negative index from the end,
applies the mode with scalar arithmetic and starts one DMA of the (block_batch, 1, columns) slab
`x[batch block, row, :]` (for an out-of-range index under "fill": of the `fill` block) to
`out[batch block, position, :]`; then waits for all of them: up to 128 DMAs in flight. The last
batch block is shifted back to end at the array's edge (it recopies identical values), so
every DMA has one static shape. Rows are in [0, n) before any DMA starts, so no read leaves the
table. Traffic: each gathered row read once, each output element written once.

Forward, 16-bit and 8-bit tables: word-row DMAs into VMEM
---------------------------------------------------------
grid = (ranges, batch, blocks_per_range): the cdiv(m, 128) index blocks in ranges of
consecutive blocks, at most one per TensorCore (`core_ranges`: 2 on a megacore v4, else 1; a
short last range's extra steps repeat its last block and do nothing), the first two axes
"parallel", the last "arbitrary", so one core runs a range's steps in order and its ring runs
across them. A range's first step fills the ring: stages its index block (and starts staging
the next), starts the word-row DMAs of its first `depth` positions. Step (r, b, k) then, for
each of its 128 positions, waits for the (1, columns) int32 word-row holding its row in its
ring slot, shifts the row out of each word (`row_of_word`; bits move, so it is exact) or takes
the fill value, writes it into its row of a (128, columns) int32 VMEM scratch, and starts the
copy `depth` positions ahead into the slot just read. For the last `depth` positions of a step
that copy's index lies in the next index block, whose staging the previous step (or the fill)
started and this step waits for before its first such copy. The rows of a last, partial
word-row (n odd for 16-bit tables) come from a copy of them zero-padded to a whole word-row,
made by the wrapper, so no DMA leaves the table (the backward does the same for the cotangent).
The scratch is narrowed into the (128, columns) output block, which the BlockSpec pipeline
writes back (rows past m dropped). Traffic: 2x (8-bit: 4x) each gathered row's bytes read, each
output element written once. On a CPU the word view is made by XLA in the wrapper
(`interpreted_word_rows`, the same words); which half of a word holds the even row on a TPU is
JAX's `Ref.bitcast` convention (row 0 in the low bits), which no device here has confirmed.

Backward: deterministic scatter-add, one owner per table block
--------------------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`); the boundaries of the
segments of table-row blocks are scalar-prefetched into SMEM. grid = (batch, cdiv(n,
block_rows), columns // block_columns), all "parallel": step (b, r, c) owns the
(block_rows, block_columns) block of the table gradient, accumulated in a float32 VMEM scratch
zeroed at the start. It walks the sorted positions [start, stop) whose targets land in its
rows through the ring (staging their positions and targets 128 at a time from aligned
offsets): for each, it waits for the cotangent's word-row holding `g[b, position, column
block]`, shifts the row out, adds it into accumulator row `target - first row`, and starts the
copy `depth` positions ahead. Finally the block is cast and written once by the BlockSpec
pipeline. Rows past n in a ragged last block are never targeted and their writes are dropped.
No atomics: one owner per output block and a fixed summation order, so every run gives the
same bits. Column blocks are up to 4096 wide, or the whole row where its width is not a
multiple of 128 (one DMA per row and column block).

Memory traffic: the cotangent read once (twice for 16-bit cotangents: word-rows), the table
gradient written once; one DMA per index and column block, `depth` in flight, the ring filled
and drained once per step. A step owns its rows' whole segments, so a row hit k times still
costs its step k DMAs (the Triton backward bounds this with pieces; not done here).

Not measured: nothing here has run on a TPU. The ring depth is design (HBM bandwidth times DMA
latency); the ring and its 3-slot staging are compiled with libtpu for v5e, v6e and v4 and
checked in TPU interpret mode, whose DMAs complete when waited on, so it cannot show timing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels._blocks import LANES, core_ranges, range_block
from kernels._pallas import mapped_under_vmap, mosaic_call, pl, pltpu, vmem_limit
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, gather_bytes,
                                   normalize_row, scatter_bytes)
from kernels.gather.mosaic_config import (INDEX_BLOCK, check, gather_vmem_bytes,
                                          positions_per_iteration, resolve_config, ring_depth,
                                          scatter_vmem_bytes, staged_blocks)
from kernels.gather.mosaic_words import (BITS, row_of_word, rows_per_word_of, start_row_copy,
                                         word_operands, word_rows)

__all__ = ["gather", "scatter_add", "check", "resolve_config"]


def _padded_to_blocks(vector: jax.Array) -> jax.Array:
    """`vector` padded to a multiple of the SMEM staging block, so staging copies from aligned
    offsets stay inside it (the padding is never used)."""
    padding = -vector.shape[0] % INDEX_BLOCK
    return jnp.pad(vector, (0, padding)) if padding else vector


def _index_block(block: jax.Array, start: jax.Array | None = None):
    """The slice of 128-entry index block `block` (aligned: a 1-D int32 tile is 128 words),
    starting at `start` (a multiple of 128; default: the block's own offset)."""
    start = block * INDEX_BLOCK if start is None else start
    return pl.ds(pl.multiple_of(start, INDEX_BLOCK), INDEX_BLOCK)


def _stage(hbm, block: jax.Array, smem) -> None:
    """Copies the 128-entry block `block` of an int32 vector in HBM into SMEM."""
    pltpu.sync_copy(hbm.at[_index_block(block)], smem)


def _staged_scratch() -> Any:
    """SMEM for one vector `_Ring` stages: `staged_blocks()` blocks of 128 int32."""
    return pltpu.SMEM((staged_blocks() * INDEX_BLOCK,), jnp.int32)


def _staged_value(smem, j: jax.Array) -> jax.Array:
    """Position `j`'s entry of a vector staged by `_Ring` (block b in SMEM slot b % slots; a
    mask where the slots are a power of two)."""
    size = smem.shape[0]
    return smem[j & (size - 1) if size & (size - 1) == 0 else j % size]


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Row DMAs for the positions [first, end) of a sequence, `depth` of them in flight, each
    into its own buffer with its own semaphore: position j + depth's copy starts as soon as
    position j's row has been used. The index vectors the copies read are staged into SMEM a
    128-entry block at a time, the next block while this one is used (`staged_blocks()` slots),
    so the ring fills once at the sequence's start (`fill`) and drains once at its end, not at
    every staging block; `run` walks the positions of one block.

    Preconditions: `depth` <= 128 (`ring_depth`: a copy runs at most one staging block ahead
    of its use, which 3 slots suffice for); `fill(first)` with first < end, then `run` over
    contiguous, ascending ranges [lo, hi), each inside one 128-position block, up to `end`.

    `staged`: (HBM vector, SMEM scratch of `_staged_scratch()`) pairs, read through
    `_staged_value`. `start_copy(j, buffer, sem)` starts position j's row copy; `use(j,
    buffer)` reads it once landed. `wait_like`: an HBM ref of a buffer's shape, whose
    descriptor waits for any row copy on a semaphore (every copy has that shape).
    `staging_sem`: one semaphore, since at most one block's staging is in flight."""

    buffers: Any
    sems: Any
    staging_sem: Any
    wait_like: Any
    staged: tuple[tuple[Any, Any], ...]
    end: jax.Array
    start_copy: Callable[..., None]
    use: Callable[..., None]

    def __post_init__(self):
        assert self.depth <= INDEX_BLOCK, self.depth

    @property
    def depth(self) -> int:
        return self.buffers.shape[0]

    def _staging(self, block: jax.Array) -> list[Any]:
        slots = self.staged[0][1].shape[0] // INDEX_BLOCK
        slot = _index_block(block, block % slots * INDEX_BLOCK)
        return [pltpu.make_async_copy(hbm.at[_index_block(block)], smem.at[slot],
                                      self.staging_sem)
                for hbm, smem in self.staged]

    def _start_staging(self, block: jax.Array) -> None:
        for copy in self._staging(block):
            copy.start()

    def _wait_staging(self, block: jax.Array) -> None:
        for copy in self._staging(block):
            copy.wait()

    def _start(self, j: jax.Array) -> None:
        slot = j % self.depth
        self.start_copy(j, self.buffers.at[slot], self.sems.at[slot])

    def _wait_and_use(self, j: jax.Array) -> None:
        slot = j % self.depth
        pltpu.make_async_copy(self.wait_like, self.buffers.at[slot], self.sems.at[slot]).wait()
        self.use(j, self.buffers.at[slot])

    def fill(self, first: jax.Array) -> None:
        """Stages `first`'s block (and the next block, when first + depth crosses into it
        and it is below `end`), starts the copies of [first, first + depth), and starts
        staging the block after them if it is below `end`. The first one or two stagings are
        waited for here: a scatter-add step with short segments pays their SMEM round trips."""
        block = first // INDEX_BLOCK
        self._start_staging(block)
        self._wait_staging(block)
        next_start = (block + 1) * INDEX_BLOCK
        spans_two = jnp.logical_and(first + self.depth > next_start, next_start < self.end)

        @pl.when(spans_two)
        def _():
            self._start_staging(block + 1)
            self._wait_staging(block + 1)

        following = block + 1 + spans_two.astype(jnp.int32)
        pl.when(following * INDEX_BLOCK < self.end)(lambda: self._start_staging(following))

        def start(j, carry):
            self._start(j)
            return carry

        lax.fori_loop(first, jnp.minimum(first + self.depth, self.end), start, 0)

    def run(self, lo: jax.Array, hi: jax.Array) -> None:
        """Uses positions [lo, hi) of one staged block, starting the copy `depth` positions
        ahead after each use while there is one. The use of position `cross_at` starts the
        first copy whose index lies in the next block: before it, that block's staging is
        waited for and the one after it started (its slot held the block before this one,
        all used)."""
        block = lo // INDEX_BLOCK
        cross_at = (block + 1) * INDEX_BLOCK - self.depth
        drain_from = jnp.clip(self.end - self.depth, lo, hi)
        next_block_from = jnp.clip(cross_at, lo, drain_from)

        def step(j, carry):
            self._wait_and_use(j)
            self._start(j + self.depth)  # into the buffer just used
            return carry

        def drain(j, carry):
            self._wait_and_use(j)
            return carry

        # Loops rather than one with branches: a branch around a DMA into the ring makes the
        # interpreter copy the whole ring at every position.
        self._walk(lo, next_block_from, step)

        @pl.when(jnp.logical_and(cross_at >= lo, cross_at < drain_from))
        def _():
            self._wait_staging(block + 1)
            pl.when((block + 2) * INDEX_BLOCK < self.end)(
                lambda: self._start_staging(block + 2))

        self._walk(next_block_from, drain_from, step)
        self._walk(drain_from, hi, drain)

    def _walk(self, lo: jax.Array, hi: jax.Array, body: Callable[..., Any]) -> None:
        """`body(j, carry)` for j in [lo, hi), in order, `positions_per_iteration` positions to a
        loop iteration (the rest in a loop of one)."""
        per, start = positions_per_iteration(), lo
        if per > 1:
            def positions(i, carry):
                for k in range(per):
                    body(lo + i * per + k, carry)
                return carry

            whole = jnp.maximum(hi - lo, 0) // per
            lax.fori_loop(jnp.int32(0), whole, positions, 0)
            start = lo + whole * per
        lax.fori_loop(start, hi, body, 0)


def _valid_positions(block: jax.Array, p: Problem) -> jax.Array:
    return jnp.minimum(INDEX_BLOCK, p.num_indices - block * INDEX_BLOCK)


def _slab_gather_kernel(indices_hbm, x_hbm, fill_hbm, out_hbm, indices_smem, sem, *,
                        p: Problem, block_batch: int):
    first_batch = jnp.minimum(pl.program_id(0) * block_batch, p.batch - block_batch)
    block = pl.program_id(1)
    _stage(indices_hbm, block, indices_smem)
    batches = pl.ds(first_batch, block_batch)
    count = _valid_positions(block, p)

    def destination(j):
        return out_hbm.at[batches, pl.ds(block * INDEX_BLOCK + j, 1), :]

    def start(j, carry):
        row, in_range = normalize_row(indices_smem[j], p.n, p.mode)
        copy_row = pltpu.make_async_copy(x_hbm.at[batches, pl.ds(row, 1), :], destination(j),
                                         sem)
        if p.mode != "fill":
            copy_row.start()
            return carry

        @pl.when(in_range)
        def _():
            copy_row.start()

        @pl.when(jnp.logical_not(in_range))
        def _():
            pltpu.make_async_copy(fill_hbm, destination(j), sem).start()

        return carry

    def wait(j, carry):
        # Every copy has the same shape, so any same-shaped descriptor waits for one of them.
        pltpu.make_async_copy(fill_hbm, destination(j), sem).wait()
        return carry

    lax.fori_loop(jnp.int32(0), count, start, 0)
    lax.fori_loop(jnp.int32(0), count, wait, 0)


def _word_gather_kernel(indices_hbm, x_hbm, tail_hbm, out_ref, indices_smem, words_vmem,
                        rows_vmem, sems, staging_sem, *, p: Problem, blocks_per_range: int):
    index_range, batch, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo = (index_range * blocks_per_range + step) * INDEX_BLOCK
    end = jnp.minimum(p.num_indices, (index_range + 1) * blocks_per_range * INDEX_BLOCK)
    fill = int(np.asarray(p.fill_value).view(BITS[p.itemsize]))
    per_word = rows_per_word_of(p.dtype)
    words = word_rows(x_hbm.at[batch], p.n, per_word)
    tail = word_rows(tail_hbm.at[batch], per_word, per_word)

    def row_of(j):
        return normalize_row(_staged_value(indices_smem, j), p.n, p.mode)

    def start_copy(j, buffer, sem):
        start_row_copy(words, tail, row_of(j)[0], p.n, per_word, buffer, sem)

    def gather_one(j, buffer):
        row, in_range = row_of(j)
        value = row_of_word(buffer[...], row % per_word, per_word)
        if p.mode == "fill":
            value = jnp.where(in_range, value, fill)
        rows_vmem[pl.ds(j - lo, 1), :] = value

    ring = _Ring(words_vmem, sems, staging_sem, tail, ((indices_hbm, indices_smem),), end,
                 start_copy, gather_one)
    pl.when(step == 0)(lambda: ring.fill(lo))

    @pl.when(lo < end)  # else a short last range's extra step: its block stays as written
    def _():
        ring.run(lo, jnp.minimum(lo + INDEX_BLOCK, end))
        out_ref[...] = rows_vmem[...].astype(out_ref.dtype)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    config = resolve_config(p, config)
    bits = x.dtype if x.dtype == BITS[p.itemsize] else BITS[p.itemsize]
    num_blocks = pl.cdiv(p.num_indices, INDEX_BLOCK)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = jax.ShapeDtypeStruct((p.batch, p.num_indices, p.columns), bits)
    if p.itemsize == 4:
        block_batch = min(config.block_batch, p.batch)
        fill = jnp.full((block_batch, 1, p.columns), p.fill_value, x.dtype)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(pl.cdiv(p.batch, block_batch), num_blocks),
            in_specs=[hbm, hbm, hbm], out_specs=hbm,
            scratch_shapes=[pltpu.SMEM((INDEX_BLOCK,), jnp.int32),
                            pltpu.SemaphoreType.DMA(())])
        semantics = ("parallel", "parallel")
        kernel = functools.partial(_slab_gather_kernel, p=p, block_batch=block_batch)
        operands = tuple(lax.bitcast_convert_type(a, bits) for a in (x, fill))
        dma_bytes = gather_bytes(p)  # the kernel copies rows into the output itself
    else:
        num_ranges, blocks_per_range = core_ranges(num_blocks)
        depth = ring_depth(p.columns)

        def out_index(r, b, k):
            return b, range_block(r, k, blocks_per_range, num_blocks), 0

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(num_ranges, p.batch, blocks_per_range),
            in_specs=[hbm, hbm, hbm],
            out_specs=pl.BlockSpec((None, INDEX_BLOCK, p.columns), out_index),
            scratch_shapes=[_staged_scratch(), pltpu.VMEM((depth, 1, p.columns), jnp.int32),
                            pltpu.VMEM((INDEX_BLOCK, p.columns), jnp.int32),
                            pltpu.SemaphoreType.DMA((depth,)), pltpu.SemaphoreType.DMA(())])
        semantics = ("parallel", "parallel", "arbitrary")  # a range's steps share its ring
        kernel = functools.partial(_word_gather_kernel, p=p, blocks_per_range=blocks_per_range)
        operands = word_operands(x, interpret)
        # The word-rows (rows_per_word times the gathered rows' bytes) and the indices.
        dma_bytes = (rows_per_word_of(p.dtype) * math.prod(out_shape.shape) * p.itemsize
                     + 4 * p.num_indices)
    call = mosaic_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        dimension_semantics=semantics,
        interpret=interpret,
        unpipelined_bytes=dma_bytes,
        vmem_limit_bytes=vmem_limit(gather_vmem_bytes(p)),
        name="gather_mosaic",
    )
    out = mapped_under_vmap(call)(_padded_to_blocks(indices), *operands)
    return lax.bitcast_convert_type(out, x.dtype)


def _scatter_add_kernel(block_starts_smem, order_hbm, targets_hbm, g_hbm, g_tail_hbm, out_ref,
                        acc_ref, words_vmem, order_smem, targets_smem, sems, staging_sem, *,
                        p: Problem, block_rows: int, block_columns: int):
    batch, row_block = pl.program_id(0), pl.program_id(1)
    columns = (slice(None) if block_columns == p.columns else
               pl.ds(pl.multiple_of(pl.program_id(2) * block_columns, LANES), block_columns))
    first_row = row_block * block_rows
    start, stop = block_starts_smem[row_block], block_starts_smem[row_block + 1]
    per_word = rows_per_word_of(p.dtype)
    g = word_rows(g_hbm.at[batch], p.num_indices, per_word)
    g = None if g is None else g.at[:, columns]
    g_tail = word_rows(g_tail_hbm.at[batch], per_word, per_word).at[:, columns]
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def start_copy(j, buffer, sem):
        start_row_copy(g, g_tail, _staged_value(order_smem, j), p.num_indices, per_word, buffer,
                       sem)

    def add(j, buffer):
        local = pl.ds(_staged_value(targets_smem, j) - first_row, 1)
        offset = _staged_value(order_smem, j) % per_word
        bits = row_of_word(buffer[...], offset, per_word)
        row = lax.bitcast_convert_type(bits.astype(BITS[p.itemsize]), p.dtype)
        acc_ref[local, :] = acc_ref[local, :] + row.astype(jnp.float32)

    ring = _Ring(words_vmem, sems, staging_sem, g_tail,
                 ((order_hbm, order_smem), (targets_hbm, targets_smem)), stop, start_copy, add)

    def add_block(block, carry):
        first = block * INDEX_BLOCK
        ring.run(jnp.maximum(start, first), jnp.minimum(stop, first + INDEX_BLOCK))
        return carry

    pl.when(start < stop)(lambda: ring.fill(start))
    # The aligned 128-index blocks that overlap [start, stop).
    lax.fori_loop(start // INDEX_BLOCK, pl.cdiv(stop, jnp.int32(INDEX_BLOCK)), add_block, 0)
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    block_rows, block_columns = config.block_rows, config.block_columns
    num_row_blocks = pl.cdiv(p.n, block_rows)
    depth = ring_depth(block_columns)
    bounds = jnp.minimum(jnp.arange(num_row_blocks + 1, dtype=jnp.int32) * block_rows, p.n)
    block_starts = plan.row_starts[bounds]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(p.batch, num_row_blocks, p.columns // block_columns),
        in_specs=[hbm, hbm, hbm, hbm],
        out_specs=pl.BlockSpec((None, block_rows, block_columns),
                               lambda b, r, c, starts: (b, r, c)),
        scratch_shapes=[pltpu.VMEM((block_rows, block_columns), jnp.float32),
                        pltpu.VMEM((depth, 1, block_columns), jnp.int32),
                        _staged_scratch(), _staged_scratch(),
                        pltpu.SemaphoreType.DMA((depth,)), pltpu.SemaphoreType.DMA(())],
    )
    kernel = functools.partial(_scatter_add_kernel, p=p, block_rows=block_rows,
                               block_columns=block_columns)
    call = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel"),
        interpret=interpret,
        vmem_limit_bytes=vmem_limit(scatter_vmem_bytes(p, config)),
        flops=p.batch * p.num_indices * p.columns,
        # The cotangent's word-rows, order and targets by the kernel's DMAs; the table
        # gradient by the pipeline.
        unpipelined_bytes=(scatter_bytes(p) - p.batch * p.n * p.columns * p.itemsize
                           + (rows_per_word_of(p.dtype) - 1) * math.prod(g.shape) * p.itemsize),
        name="scatter_add_mosaic",
    )
    return mapped_under_vmap(call)(block_starts, _padded_to_blocks(plan.order),
                                    _padded_to_blocks(plan.targets),
                                    *word_operands(g, interpret))
