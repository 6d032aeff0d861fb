"""Gather and its scatter-add gradient as Pallas kernels lowered through Mosaic (TPU).

Both kernels work on the `(batch, n, columns)` view of the table (see common.py).

Forward block schedule: DMA row copies, HBM to HBM
--------------------------------------------------
The table, the output and a small `fill` block stay in HBM (`memory_space=pl.ANY`); nothing
passes through vector registers. grid = (cdiv(batch, block_batch), cdiv(m, block_indices)),
both "parallel". Step (i, j) copies its block_indices int32 indices from HBM into SMEM, then
for each index counts a negative one from the end, applies the mode with scalar arithmetic and
starts one DMA of the (block_batch, 1, columns) slab `x[batch block, row, :]` (for an
out-of-range index under "fill": of the `fill` block) to `out[batch block, position, :]`; then
it waits for all of them. Rows are in [0, n) before any DMA starts, so no read leaves the table.
The last batch and index blocks are shifted back to end at the array's edge instead of hanging
over it (they recopy a few rows with identical values), so every DMA has the same static shape
and stays inside both arrays. For axis=0 a slab is one table row (an embedding lookup); for the
last axis it is a strided column of block_batch elements.

Memory traffic: each gathered row read once, each output element written once, the indices
read once; block_indices DMAs are in flight per step.

Backward block schedule: deterministic scatter-add, one owner per table block
--------------------------------------------------------------------------------
The wrapper sorts the index vector with XLA (`common.scatter_plan`); the boundaries of the
segments of table-row blocks are scalar-prefetched into SMEM. grid = (batch, cdiv(n,
block_rows), columns // block_columns), all "parallel": step (b, r, c) owns the
(block_rows, block_columns) block of the table gradient, accumulated in a float32 VMEM scratch
zeroed at the start. It walks the sorted indices that land in its rows, copying their positions
and targets from HBM into SMEM 128 at a time (the chunk is shifted back at the end of the
arrays so the copy stays inside), and for each one DMAs the cotangent row `g[b, position,
column block]` into VMEM and adds it into accumulator row `target - first row`. Finally the
block is cast and written once by the BlockSpec pipeline. Rows past n in a ragged last block
are never targeted and their writes are dropped. No atomics: one owner per output block and a
fixed summation order, so every run gives the same bits.

Memory traffic: the cotangent read once, the table gradient written once; one DMA (one row of
block_columns) per index, waited for before the add.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import LANES, int32_loop, sublanes
from kernels._pallas import mosaic_call, pl, pltpu
from kernels.gather.common import (GatherConfig, Problem, ScatterPlan, check_int, gather_cost,
                                   normalize_row, scatter_cost)

_DEFAULT_BLOCK_INDICES = 64
_SLAB_BYTES = 1 << 20        # target bytes of one forward DMA when the batch is split
_MAX_BLOCK_COLUMNS = 1024
_ACCUMULATOR_BYTES = 2 << 20  # float32 accumulator per backward step
_INDEX_CHUNK = 128


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
        block_indices=config.block_indices or _DEFAULT_BLOCK_INDICES,
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


def _shifted_start(block: jax.Array, size: int, total: int) -> jax.Array:
    """Start of block `block` of `size`, moved back so the block ends inside [0, total)."""
    return jnp.minimum(block * size, total - size)


def _gather_kernel(indices_hbm, x_hbm, fill_hbm, out_hbm, indices_smem, sem, *, p: Problem,
                   block_batch: int, block_indices: int):
    first_batch = _shifted_start(pl.program_id(0), block_batch, p.batch)
    first_index = _shifted_start(pl.program_id(1), block_indices, p.num_indices)
    pltpu.sync_copy(indices_hbm.at[pl.ds(first_index, block_indices)], indices_smem)
    batches = pl.ds(first_batch, block_batch)

    def destination(j):
        return out_hbm.at[batches, pl.ds(first_index + j, 1), :]

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

    # int32 bounds: under x64 Python ints would make the TPU index arithmetic 64-bit.
    int32_loop(block_indices, start, 0)
    int32_loop(block_indices, wait, 0)


def gather(x: jax.Array, indices: jax.Array, p: Problem, *, config: GatherConfig | None,
           interpret: bool) -> jax.Array:
    """`x` viewed (batch, n, columns), int32 `indices` (m,) -> (batch, m, columns)."""
    config = resolve_config(p, config)
    block_batch = min(config.block_batch, p.batch)
    block_indices = min(config.block_indices, p.num_indices)
    fill = jnp.full((block_batch, 1, p.columns), p.fill_value, x.dtype)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(pl.cdiv(p.batch, block_batch), pl.cdiv(p.num_indices, block_indices)),
        in_specs=[hbm, hbm, hbm],
        out_specs=hbm,
        scratch_shapes=[pltpu.SMEM((block_indices,), jnp.int32), pltpu.SemaphoreType.DMA(())],
    )
    kernel = functools.partial(_gather_kernel, p=p, block_batch=block_batch,
                               block_indices=block_indices)
    call = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.num_indices, p.columns), x.dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel"),
        interpret=interpret,
        cost_estimate=gather_cost(p),
        name="gather_mosaic",
    )
    return _mapped_under_vmap(call)(indices, x, fill)


def _scatter_add_kernel(block_starts_smem, order_hbm, targets_hbm, g_hbm, out_ref, acc_ref,
                        g_row_vmem, order_smem, targets_smem, *, p: Problem,
                        block_rows: int, block_columns: int, chunk: int):
    batch, row_block = pl.program_id(0), pl.program_id(1)
    columns = pl.ds(pl.program_id(2) * block_columns, block_columns)
    first_row = row_block * block_rows
    start, stop = block_starts_smem[row_block], block_starts_smem[row_block + 1]
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def add(j, carry):
        source, target = order_smem[j], targets_smem[j]
        pltpu.sync_copy(g_hbm.at[batch, pl.ds(source, 1), columns], g_row_vmem)
        local = pl.ds(target - first_row, 1)
        acc_ref[local, :] = acc_ref[local, :] + g_row_vmem[...].astype(jnp.float32)
        return carry

    def add_chunk(k, carry):
        chunk_start = start + k * chunk
        loaded = jnp.minimum(chunk_start, p.num_indices - chunk)  # stay inside the arrays
        pltpu.sync_copy(order_hbm.at[pl.ds(loaded, chunk)], order_smem)
        pltpu.sync_copy(targets_hbm.at[pl.ds(loaded, chunk)], targets_smem)
        lax.fori_loop(chunk_start - loaded, jnp.minimum(stop - loaded, chunk), add, 0)
        return carry

    lax.fori_loop(jnp.int32(0), pl.cdiv(stop - start, jnp.int32(chunk)), add_chunk, 0)
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def scatter_add(g: jax.Array, plan: ScatterPlan, p: Problem, *, config: GatherConfig | None,
                interpret: bool) -> jax.Array:
    """Cotangent `g` (batch, m, columns) summed into a zero (batch, n, columns) table."""
    config = resolve_config(p, config)
    block_rows, block_columns = config.block_rows, config.block_columns
    num_row_blocks = pl.cdiv(p.n, block_rows)
    bounds = jnp.minimum(jnp.arange(num_row_blocks + 1, dtype=jnp.int32) * block_rows, p.n)
    block_starts = plan.row_starts[bounds]
    chunk = min(_INDEX_CHUNK, p.num_indices)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(p.batch, num_row_blocks, p.columns // block_columns),
        in_specs=[hbm, hbm, hbm],
        out_specs=pl.BlockSpec((None, block_rows, block_columns),
                               lambda b, r, c, starts: (b, r, c)),
        scratch_shapes=[pltpu.VMEM((block_rows, block_columns), jnp.float32),
                        pltpu.VMEM((1, block_columns), g.dtype),
                        pltpu.SMEM((chunk,), jnp.int32), pltpu.SMEM((chunk,), jnp.int32)],
    )
    kernel = functools.partial(_scatter_add_kernel, p=p, block_rows=block_rows,
                               block_columns=block_columns, chunk=chunk)
    call = mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.batch, p.n, p.columns), g.dtype),
        grid_spec=grid_spec,
        dimension_semantics=("parallel", "parallel", "parallel"),
        interpret=interpret,
        cost_estimate=scatter_cost(p),
        name="scatter_add_mosaic",
    )
    return _mapped_under_vmap(call)(block_starts, plan.order, plan.targets, g)
