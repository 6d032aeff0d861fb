"""Gather and its scatter-add gradient as Pallas kernels lowered through Mosaic (TPU).

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

Indices are staged from HBM into SMEM `_INDEX_BLOCK` (128) at a time, at offsets that are
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
grid = (batch, cdiv(m, 128)), both "parallel". Step (b, j) stages its 128 indices; for each,
it DMAs the (1, columns) int32 word-row holding the row into one of a ring of `_RING` (8) VMEM
buffers, started 8 indices ahead so 8 DMAs are in flight; shifts the row out of each word
(`_row_of_word`; bits move, so it is exact) or takes the fill value, and writes it into row j
of a (128, columns) int32 VMEM scratch. The rows of a last, partial word-row (n odd for 16-bit
tables) come from a copy of them zero-padded to a whole word-row, made by the wrapper, so no
DMA leaves the table (the backward does the same for the cotangent). The scratch is narrowed
into the (128, columns) output block, which the BlockSpec pipeline writes back (rows past m
dropped). Traffic: 2x (8-bit: 4x) each gathered row's bytes read, each output element written
once. On a CPU the word view is made by XLA in the wrapper (`_interpreted_word_rows`, the same
words); which half of a word holds the even row on a TPU is JAX's `Ref.bitcast` convention
(row 0 in the low bits), which no device here has confirmed.

Backward: deterministic scatter-add, one owner per table block
--------------------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`); the boundaries of the
segments of table-row blocks are scalar-prefetched into SMEM. grid = (batch, cdiv(n,
block_rows), columns // block_columns), all "parallel": step (b, r, c) owns the
(block_rows, block_columns) block of the table gradient, accumulated in a float32 VMEM scratch
zeroed at the start. It walks the sorted indices that land in its rows, staging their positions
and targets into SMEM 128 at a time from aligned offsets, and for each one DMAs the cotangent's
word-row holding row `g[b, position, column block]` into VMEM (a ring of `_RING` buffers, each
copy started 8 indices ahead, so 8 DMAs are in flight), shifts the row out, and adds it into
accumulator row
`target - first row`. Finally the block is cast and written once by the BlockSpec pipeline. Rows
past n in a ragged last block are never targeted and their writes are dropped. No atomics: one
owner per output block and a fixed summation order, so every run gives the same bits.

Memory traffic: the cotangent read once (twice for 16-bit cotangents: word-rows), the table
gradient written once; one DMA per index, 8 in flight (the ring drains at each 128-index
staging block). A step owns its rows' whole segments, so a row hit k times still costs its step
k DMAs (the Triton backward bounds this with pieces; not done here).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels import _targets
from kernels._blocks import LANES, sublanes
from kernels._pallas import mosaic_call, pl, pltpu
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, check_int, gather_bytes,
                                   normalize_row, scatter_bytes)

_SLAB_BYTES = 1 << 20        # target bytes of one forward DMA when the batch is split
_MAX_BLOCK_COLUMNS = 1024
_ACCUMULATOR_BYTES = 2 << 20  # float32 accumulator per backward step
_INDEX_BLOCK = 128            # indices staged into SMEM at once (1-D int32 tile: 128 words)
_RING = 8                     # row DMAs in flight in the word gather and the scatter-add
_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _ring_depth() -> int:
    """DMAs in flight: `_RING` on a TPU and in the "strict" interpreter; one in the fast
    interpreter, where a DMA is a copy made at once and a deeper ring only costs copies of it
    (`_targets.INTERPRETER`)."""
    return _targets.device_or_interpreter("tpu", _RING, 1)


def _default_block_columns(columns: int) -> int:
    if columns <= _MAX_BLOCK_COLUMNS or columns % LANES:
        return columns
    return max(c for c in range(LANES, _MAX_BLOCK_COLUMNS + 1, LANES) if columns % c == 0)


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    config = config or GatherConfig()
    slab_bytes = max(1, p.columns * p.itemsize)
    block_columns = config.block_columns or _default_block_columns(p.columns)
    rows_that_fit = max(1, _ACCUMULATOR_BYTES // (4 * block_columns))
    tile = sublanes(p.dtype)
    block_rows = config.block_rows or (
        p.n if p.n <= rows_that_fit else max(tile, rows_that_fit // tile * tile))
    return dataclasses.replace(
        config,
        block_indices=config.block_indices or _INDEX_BLOCK,
        block_batch=config.block_batch or max(1, _SLAB_BYTES // slab_bytes),
        block_columns=block_columns, block_rows=block_rows)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Declines 64-bit tables (TPUs have no 64-bit types); rejects blocks that break TPU
    tiling."""
    if p.itemsize == 8:
        raise NotImplementedError(f"{jnp.dtype(p.dtype).name} is not supported on TPU")
    if p.batch * p.num_indices * p.columns == 0:
        return  # an empty result: no kernel runs
    for field in ("block_indices", "block_columns", "block_batch", "block_rows"):
        check_int(config or GatherConfig(), field)
    config = resolve_config(p, config)
    if config.block_indices != _INDEX_BLOCK:
        raise ValueError(f"config.block_indices={config.block_indices} must be {_INDEX_BLOCK} "
                         "for mosaic: indices are staged into SMEM one 128-word tile at a time")
    if p.columns % config.block_columns:
        raise ValueError(f"config.block_columns={config.block_columns} must divide the row "
                         f"length {p.columns} for mosaic")
    if config.block_columns % LANES and config.block_columns != p.columns:
        raise ValueError(f"config.block_columns={config.block_columns} breaks TPU tiling for "
                         f"mosaic: it must be a multiple of {LANES} or equal the row length "
                         f"{p.columns}")
    tile = sublanes(p.dtype)
    if config.block_rows % tile and config.block_rows != p.n:
        raise ValueError(f"config.block_rows={config.block_rows} breaks TPU tiling for mosaic: "
                         f"it must be a multiple of {tile} for {jnp.dtype(p.dtype).name} or "
                         f"equal the table's {p.n} rows")


def _mapped_under_vmap(fn):
    """`fn(*arrays)` with a vmap rule that maps it over the batch with `lax.map`.

    Pallas cannot add a batch dim to a kernel whose operands stay in HBM (`memory_space=ANY`):
    under `vmap` the kernel runs once per batch element instead. Unbatched operands (a shared
    table) are closed over, not broadcast.
    """
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size

        def one(batched_slices):
            slices = iter(batched_slices)
            pairs = zip(args, in_batched, strict=True)
            return wrapped(*[next(slices) if batched else a for a, batched in pairs])

        return lax.map(one, [a for a, b in zip(args, in_batched, strict=True) if b]), True

    return wrapped


def _padded_to_blocks(vector: jax.Array) -> jax.Array:
    """`vector` padded to a multiple of the SMEM staging block, so staging copies from aligned
    offsets stay inside it (the padding is never used)."""
    padding = -vector.shape[0] % _INDEX_BLOCK
    return jnp.pad(vector, (0, padding)) if padding else vector


def _stage(hbm, block: jax.Array, smem) -> None:
    """Copies the 128-entry block `block` of an int32 vector in HBM into SMEM."""
    pltpu.sync_copy(hbm.at[pl.ds(pl.multiple_of(block * _INDEX_BLOCK, _INDEX_BLOCK),
                                 _INDEX_BLOCK)], smem)


def _rows_per_word(dtype) -> int:
    """Table rows that share each 32-bit word of a TPU tile: 1 for 32-bit data, 2 for 16-bit,
    4 for 8-bit (the packed layout stacks adjacent rows of a tile into one word)."""
    return 4 // jnp.dtype(dtype).itemsize


def _word_rows(ref, n: int, rows_per_word: int):
    """The (n // rows_per_word, columns) int32 view of the whole word-rows of the (n, columns)
    ref `ref`: a free reinterpretation of its packed tiles (`Ref.bitcast`), or `ref` itself
    where it is int32 (the view `_interpreted_word_rows` made, or 32-bit bits). None when
    n < rows_per_word."""
    whole = n // rows_per_word * rows_per_word
    if not whole:
        return None
    if ref.dtype == jnp.int32:
        return ref
    return (ref if whole == n else ref.at[pl.ds(0, whole)]).bitcast(jnp.int32)


def _word_operands(x: jax.Array, interpret: bool | str) -> tuple[jax.Array, jax.Array]:
    """`x` (batch, n, columns) and its last, partial word-row zero-padded to whole
    (`_tail_group`), as the word kernels take them (`_interpreted_word_rows`)."""
    tail = _tail_group(x, _rows_per_word(x.dtype))
    return _interpreted_word_rows(x, interpret), _interpreted_word_rows(tail, interpret)


def _interpreted_word_rows(x: jax.Array, interpret: bool | str) -> jax.Array:
    """`x` (batch, n, columns) viewed as `_word_rows` does, made by XLA where the kernel is
    interpreted, else `x` itself for the kernel to view. The simulator cannot follow a bitcast
    ref through a DMA, and XLA's constant folding gets the interpreter's bitcast of a constant
    table wrong (both jax 0.10-0.12): so words are built with shifts, exact and layout-free."""
    rows_per_word = _rows_per_word(x.dtype)
    batch, n, columns = x.shape
    whole = n // rows_per_word * rows_per_word
    if not interpret or not whole or x.dtype == jnp.int32:
        return x
    bits = 32 // rows_per_word
    rows = lax.bitcast_convert_type(x[:, :whole], _UNSIGNED[x.dtype.itemsize])
    rows = rows.astype(jnp.uint32).reshape(batch, whole // rows_per_word, rows_per_word, columns)
    words = functools.reduce(jnp.bitwise_or, (rows[:, :, r] << (bits * r)
                                              for r in range(rows_per_word)))
    return lax.bitcast_convert_type(words, jnp.int32)


def _row_of_word(words: jax.Array, offset: jax.Array, rows_per_word: int) -> jax.Array:
    """Row `offset` of an int32 word-row whose words each hold `rows_per_word` rows (row 0 in
    the low bits), sign-extended: shifted to the word's top, then arithmetically back."""
    if rows_per_word == 1:
        return words
    bits = 32 // rows_per_word
    return (words << (bits * (rows_per_word - 1 - offset))) >> (bits * (rows_per_word - 1))


def _start_row_copy(words_hbm, tail_hbm, row: jax.Array, n: int, rows_per_word: int, vmem,
                    sem) -> None:
    """Starts the DMA of the word-row holding row `row` of an (n, columns) table into the
    (1, columns) int32 `vmem`. `words_hbm` is the table's whole word-rows (`_word_rows`);
    the last, partial one (n not a multiple of rows_per_word) comes from `tail_hbm`, a copy of
    its rows zero-padded to a whole word-row, so no read leaves the table."""
    word_row, whole = row // rows_per_word, n // rows_per_word

    def start(source):
        pltpu.make_async_copy(source, vmem, sem).start()

    if whole * rows_per_word == n:
        start(words_hbm.at[pl.ds(word_row, 1)])
        return
    if whole:
        pl.when(word_row < whole)(lambda: start(words_hbm.at[pl.ds(word_row, 1)]))
    pl.when(word_row >= whole)(lambda: start(tail_hbm))


def _ring_of_row_copies(buffers, sems, tail_hbm, lo, hi, start_copy, use) -> None:
    """For j in [lo, hi): `use(j, buffer)` once the copy that `start_copy(j, buffer, sem)`
    started has landed in its buffer, one of a ring of `buffers.shape[0]` (`_RING`) with a
    semaphore each: copies are started that many positions ahead, so that many DMAs are in
    flight instead of one at a time."""
    depth = buffers.shape[0]

    def prologue(j, carry):
        start_copy(j, buffers.at[j % depth], sems.at[j % depth])
        return carry

    def wait_and_use(j):
        slot = j % depth
        # Every row copy has a buffer's shape, so any same-shaped descriptor (the tail's)
        # waits for the one on this slot's semaphore.
        pltpu.make_async_copy(tail_hbm, buffers.at[slot], sems.at[slot]).wait()
        use(j, buffers.at[slot])
        return slot

    def step(j, carry):
        slot = wait_and_use(j)
        start_copy(j + depth, buffers.at[slot], sems.at[slot])  # its row has been read
        return carry

    def drain(j, carry):
        wait_and_use(j)
        return carry

    # Three loops rather than one with a branch: a branch around a DMA into the ring makes
    # the interpreter copy the whole ring at every step.
    lax.fori_loop(lo, jnp.minimum(lo + depth, hi), prologue, 0)
    lax.fori_loop(lo, hi - depth, step, 0)
    lax.fori_loop(jnp.maximum(lo, hi - depth), hi, drain, 0)


def _tail_group(x: jax.Array, rows: int) -> jax.Array:
    """(batch, rows, columns): the rows of `x` (batch, n, columns) past its last whole group of
    `rows`, zero-padded to a whole group (a copy of fewer than `rows` rows)."""
    whole = x.shape[1] // rows * rows
    tail = x[:, whole:, :]
    return jnp.pad(tail, ((0, 0), (0, rows - tail.shape[1]), (0, 0)))


def _valid_positions(block: jax.Array, p: Problem) -> jax.Array:
    return jnp.minimum(_INDEX_BLOCK, p.num_indices - block * _INDEX_BLOCK)


def _slab_gather_kernel(indices_hbm, x_hbm, fill_hbm, out_hbm, indices_smem, sem, *,
                        p: Problem, block_batch: int):
    first_batch = jnp.minimum(pl.program_id(0) * block_batch, p.batch - block_batch)
    block = pl.program_id(1)
    _stage(indices_hbm, block, indices_smem)
    batches = pl.ds(first_batch, block_batch)
    count = _valid_positions(block, p)

    def destination(j):
        return out_hbm.at[batches, pl.ds(block * _INDEX_BLOCK + j, 1), :]

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
                        rows_vmem, sems, *, p: Problem):
    batch, block = pl.program_id(0), pl.program_id(1)
    _stage(indices_hbm, block, indices_smem)
    fill = int(np.asarray(p.fill_value).view(_BITS[p.itemsize]))
    per_word = _rows_per_word(p.dtype)
    words = _word_rows(x_hbm.at[batch], p.n, per_word)
    tail = _word_rows(tail_hbm.at[batch], per_word, per_word)

    def row_of(j):
        return normalize_row(indices_smem[j], p.n, p.mode)

    def start_copy(j, buffer, sem):
        _start_row_copy(words, tail, row_of(j)[0], p.n, per_word, buffer, sem)

    def gather_one(j, buffer):
        row, in_range = row_of(j)
        value = _row_of_word(buffer[...], row % per_word, per_word)
        if p.mode == "fill":
            value = jnp.where(in_range, value, fill)
        rows_vmem[pl.ds(j, 1), :] = value

    _ring_of_row_copies(words_vmem, sems, tail, jnp.int32(0), _valid_positions(block, p),
                        start_copy, gather_one)
    out_ref[...] = rows_vmem[...].astype(out_ref.dtype)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool | str) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    config = resolve_config(p, config)
    bits = x.dtype if x.dtype == _BITS[p.itemsize] else _BITS[p.itemsize]
    num_blocks = pl.cdiv(p.num_indices, _INDEX_BLOCK)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = jax.ShapeDtypeStruct((p.batch, p.num_indices, p.columns), bits)
    if p.itemsize == 4:
        block_batch = min(config.block_batch, p.batch)
        fill = jnp.full((block_batch, 1, p.columns), p.fill_value, x.dtype)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(pl.cdiv(p.batch, block_batch), num_blocks),
            in_specs=[hbm, hbm, hbm], out_specs=hbm,
            scratch_shapes=[pltpu.SMEM((_INDEX_BLOCK,), jnp.int32),
                            pltpu.SemaphoreType.DMA(())])
        kernel = functools.partial(_slab_gather_kernel, p=p, block_batch=block_batch)
        operands = tuple(lax.bitcast_convert_type(a, bits) for a in (x, fill))
        dma_bytes = gather_bytes(p)  # the kernel copies rows into the output itself
    else:
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(p.batch, num_blocks), in_specs=[hbm, hbm, hbm],
            out_specs=pl.BlockSpec((None, _INDEX_BLOCK, p.columns), lambda b, j: (b, j, 0)),
            scratch_shapes=[pltpu.SMEM((_INDEX_BLOCK,), jnp.int32),
                            pltpu.VMEM((_ring_depth(), 1, p.columns), jnp.int32),
                            pltpu.VMEM((_INDEX_BLOCK, p.columns), jnp.int32),
                            pltpu.SemaphoreType.DMA((_RING,))])
        kernel = functools.partial(_word_gather_kernel, p=p)
        operands = _word_operands(x, interpret)
        # The word-rows (rows_per_word times the gathered rows' bytes) and the indices.
        dma_bytes = (_rows_per_word(p.dtype) * math.prod(out_shape.shape) * p.itemsize
                     + 4 * p.num_indices)
    call = mosaic_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel"),
        interpret=interpret,
        unpipelined_bytes=dma_bytes,
        name="gather_mosaic",
    )
    out = _mapped_under_vmap(call)(_padded_to_blocks(indices), *operands)
    return lax.bitcast_convert_type(out, x.dtype)


def _scatter_add_kernel(block_starts_smem, order_hbm, targets_hbm, g_hbm, g_tail_hbm, out_ref,
                        acc_ref, words_vmem, order_smem, targets_smem, sems, *, p: Problem,
                        block_rows: int, block_columns: int):
    batch, row_block = pl.program_id(0), pl.program_id(1)
    columns = (slice(None) if block_columns == p.columns else
               pl.ds(pl.multiple_of(pl.program_id(2) * block_columns, LANES), block_columns))
    first_row = row_block * block_rows
    start, stop = block_starts_smem[row_block], block_starts_smem[row_block + 1]
    per_word = _rows_per_word(p.dtype)
    g = _word_rows(g_hbm.at[batch], p.num_indices, per_word)
    g = None if g is None else g.at[:, columns]
    g_tail = _word_rows(g_tail_hbm.at[batch], per_word, per_word).at[:, columns]
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def start_copy(j, buffer, sem):
        _start_row_copy(g, g_tail, order_smem[j], p.num_indices, per_word, buffer, sem)

    def add(j, buffer):
        local = pl.ds(targets_smem[j] - first_row, 1)
        bits = _row_of_word(buffer[...], order_smem[j] % per_word, per_word)
        row = lax.bitcast_convert_type(bits.astype(_BITS[p.itemsize]), p.dtype)
        acc_ref[local, :] = acc_ref[local, :] + row.astype(jnp.float32)

    def add_block(block, carry):
        _stage(order_hbm, block, order_smem)
        _stage(targets_hbm, block, targets_smem)
        first = block * _INDEX_BLOCK
        _ring_of_row_copies(words_vmem, sems, g_tail, jnp.maximum(start - first, 0),
                            jnp.minimum(stop - first, _INDEX_BLOCK), start_copy, add)
        return carry

    # The aligned 128-index blocks that overlap [start, stop).
    lax.fori_loop(start // _INDEX_BLOCK, pl.cdiv(stop, jnp.int32(_INDEX_BLOCK)), add_block, 0)
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool | str) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    block_rows, block_columns = config.block_rows, config.block_columns
    num_row_blocks = pl.cdiv(p.n, block_rows)
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
                        pltpu.VMEM((_ring_depth(), 1, block_columns), jnp.int32),
                        pltpu.SMEM((_INDEX_BLOCK,), jnp.int32),
                        pltpu.SMEM((_INDEX_BLOCK,), jnp.int32),
                        pltpu.SemaphoreType.DMA((_RING,))],
    )
    kernel = functools.partial(_scatter_add_kernel, p=p, block_rows=block_rows,
                               block_columns=block_columns)
    call = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel"),
        interpret=interpret,
        flops=p.batch * p.num_indices * p.columns,
        # The cotangent's word-rows, order and targets by the kernel's DMAs; the table
        # gradient by the pipeline.
        unpipelined_bytes=(scatter_bytes(p) - p.batch * p.n * p.columns * p.itemsize
                           + (_rows_per_word(p.dtype) - 1) * math.prod(g.shape) * p.itemsize),
        name="scatter_add_mosaic",
    )
    return _mapped_under_vmap(call)(block_starts, _padded_to_blocks(plan.order),
                                    _padded_to_blocks(plan.targets),
                                    *_word_operands(g, interpret))
