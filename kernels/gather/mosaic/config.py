"""How big the Mosaic gather and scatter-add kernels' blocks are (the kernels themselves are in
`forward.py` and `backward.py` beside it): the indices staged per SMEM block and the staged
blocks held (`staged_blocks`), the DMA ring's depth on a TPU and in the fast interpreter
(`ring_depth`), the 32-bit forward's batch slabs, the backward's accumulator block
(`resolve_config`), and the checks that decline a problem or reject a config (`check`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import LANES, sublanes, tile_limit
from kernels.gather.common import GatherConfig, Problem, check_int

__all__ = ["INDEX_BLOCK", "staged_blocks", "ring_depth", "resolve_config", "check",
           "gather_vmem_bytes", "scatter_vmem_bytes"]

INDEX_BLOCK = 128             # indices staged into SMEM at once (1-D int32 tile: 128 words)
# Staged index blocks held in SMEM on a TPU: the one whose rows are being used, the next one
# (copies run up to a ring ahead), and the one after it, arriving while those two are in use.
_STAGED_BLOCKS = 3
# Bytes of row DMAs a ring keeps in flight, sized for v5e: HBM bandwidth times DMA latency is
# about 0.8 MB there (819 GB/s times ~1 us, an estimate); fewer leave the DMA engines idle.
_RING_BYTES = 1 << 20
# At least 8 copies in flight whatever the row width; at most 64, a DMA semaphore each. The
# ring may not be deeper than an index block (128): its copies run at most one staging block
# ahead of their use, which the 3 staging slots rely on.
_MIN_RING, _MAX_RING = 8, 64
_SLAB_BYTES = 1 << 20        # target bytes of one forward DMA when the batch is split
# The backward DMAs a cotangent row once per column block: 4096 columns (16 KiB word-rows) let
# a ring of 64 keep `_RING_BYTES` in flight.
_MAX_BLOCK_COLUMNS = 4096
# The fast interpreter's backward block (elements): larger ones interpret slower, not faster
# (20000x256 bfloat16 with 4096 ids, jax 0.10.2: 7 ms in blocks of 2048 rows, 20 ms in 16384).
_INTERPRETED_BLOCK = 1 << 19


def positions_per_iteration() -> int:
    """Ring positions one iteration of `ring.Ring`'s loops walks: one on a TPU and in the "strict"
    interpreter; four in the fast interpreter, where each while-loop iteration costs XLA:CPU
    more than the position's own work (20000x256 bfloat16 with 4096 ids, jax 0.10.2, fastest of
    100 calls: 2.9 ms at one, 2.1 ms at four; eight was no faster)."""
    return _targets.device_or_interpreter("tpu", 1, 4)


def staged_blocks() -> int:
    """Index blocks staged in SMEM at once (`_STAGED_BLOCKS` on a TPU and in the "strict"
    interpreter); four in the fast interpreter, where a power of two makes a position's slot a
    mask that XLA:CPU fuses into the row copy instead of a remainder it runs apart (20000x256
    bfloat16 with 4096 ids, jax 0.10.2: 0.39 against 0.33 us a position)."""
    return _targets.device_or_interpreter("tpu", _STAGED_BLOCKS, 4)


def ring_depth(columns: int) -> int:
    """Row DMAs in flight, each of a (1, columns) int32 word-row: as many as make
    `_RING_BYTES`, clamped to 8-64, on a TPU and in the "strict" interpreter; one in the fast
    interpreter, where a DMA is a copy made at once and a deeper ring only costs copies of it
    (`_targets.INTERPRETER`)."""
    depth = min(_MAX_RING, max(_MIN_RING, -(-_RING_BYTES // (4 * columns))))
    assert depth <= INDEX_BLOCK  # what `ring.Ring`'s staging allows
    return _targets.device_or_interpreter("tpu", depth, 1)


def _default_block_columns(columns: int) -> int:
    if columns <= _MAX_BLOCK_COLUMNS or columns % LANES:
        return columns
    return max(c for c in range(LANES, _MAX_BLOCK_COLUMNS + 1, LANES) if columns % c == 0)


def gather_vmem_bytes(p: Problem) -> int:
    """VMEM a forward step plans: none for 32-bit tables (HBM-to-HBM DMAs); else the (128,
    columns) int32 rows scratch, the double-buffered output block and the ring of word-rows."""
    if p.itemsize == 4:
        return 0
    return p.columns * (INDEX_BLOCK * (4 + 2 * p.itemsize) + ring_depth(p.columns) * 4)


def _scatter_row_bytes(p: Problem, block_columns: int) -> int:
    """A backward block row: its float32 accumulator row and double-buffered output rows."""
    return block_columns * (4 + 2 * p.itemsize)


def scatter_vmem_bytes(p: Problem, config: GatherConfig) -> int:
    """VMEM a backward step plans: its block's rows and the ring of cotangent word-rows."""
    return (config.block_rows * _scatter_row_bytes(p, config.block_columns)
            + ring_depth(config.block_columns) * config.block_columns * 4)


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """The backward's blocks: rows of up to 4096 columns (the whole row where its width is not
    a multiple of 128), as many as the target's
    `default_blocks_vmem` holds beside the ring (in the fast interpreter, `_INTERPRETED_BLOCK`
    elements)."""
    config = config or GatherConfig()
    slab_bytes = max(1, p.columns * p.itemsize)
    block_columns = config.block_columns or _default_block_columns(p.columns)
    ring_bytes = ring_depth(block_columns) * block_columns * 4
    rows_in_vmem = (_targets.current("tpu").default_blocks_vmem - ring_bytes) // (
        _scatter_row_bytes(p, block_columns))
    rows_that_fit = max(1, tile_limit(rows_in_vmem * block_columns, _INTERPRETED_BLOCK,
                                      platform="tpu") // block_columns)
    tile = sublanes(p.dtype)
    block_rows = config.block_rows or (
        p.n if p.n <= rows_that_fit else max(tile, rows_that_fit // tile * tile))
    return dataclasses.replace(
        config,
        block_indices=config.block_indices or INDEX_BLOCK,
        block_batch=config.block_batch or max(1, _SLAB_BYTES // slab_bytes),
        block_columns=block_columns, block_rows=block_rows)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Declines 64-bit tables (TPUs have no 64-bit types) and steps over the target's VMEM
    budget; rejects blocks that break TPU tiling."""
    if p.itemsize == 8:
        raise NotImplementedError(f"{jnp.dtype(p.dtype).name} is not supported on TPU")
    if p.batch * p.num_indices * p.columns == 0:
        return  # an empty result: no kernel runs
    for field in ("block_indices", "block_columns", "block_batch", "block_rows"):
        check_int(config or GatherConfig(), field)
    config = resolve_config(p, config)
    if config.block_indices != INDEX_BLOCK:
        raise ValueError(f"config.block_indices={config.block_indices} must be {INDEX_BLOCK} "
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
    target = _targets.current("tpu")
    for kernel, needed in (("gather", gather_vmem_bytes(p)),
                           ("scatter-add", scatter_vmem_bytes(p, config))):
        if needed > target.vmem_budget:
            raise NotImplementedError(
                f"the {kernel} kernel's step needs about {needed} bytes of VMEM for rows of "
                f"{p.columns} columns, over {target.name}'s budget of {target.vmem_budget}")
