"""Mosaic GPU kernel calls (jax >= 0.12, `kernels.registry`'s `mosaic_gpu` entry): the launch
(`mosaic_gpu_call`), the register layout of a block of rows (`row_layout`), plain GMEM loads
and stores, and blocks of rows moved by TMA in pieces (`BlockBuffers`, `StreamedRows`,
`RowWriter`, `BlockWriter`). Imported only by Mosaic GPU kernels, which the registry imports
only where the installed jax has the backend.

One CTA is one warpgroup (4 warps of 32 threads) under Warpgroup lowering semantics: the kernel
body is array code for the whole warpgroup, and a grid point is a CTA.

Rows by TMA
-----------
A block of `block_rows` rows is moved in pieces of `PIECE` columns (one TMA box each: a copy
moves at most 256 elements along a dimension), each piece a dense (block_rows, PIECE) tile in
shared memory. TMA zero-fills what it reads past the array's edges, so a ragged last block of
rows and a row that is not a multiple of `PIECE` need no mask on their loads (a reduction
still masks the padding where zeros would bias it). A store drops what falls past each edge
only where it is a tensor copy: a window that is one run of GMEM is copied linearly, and its
output is allocated in whole windows (`stored_shape`). A GMEM row must be a multiple of 16
bytes (TMA's stride rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import TiledLayout
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _targets
from kernels._blocks import round_up

__all__ = ["WARPS", "LANES", "TMA_MAX_BOX", "PIECE", "TMA_ALIGNMENT", "TMA_SMEM_ALIGNMENT",
           "PALLAS_SMEM", "RESERVED_SMEM", "UNTILED", "smem_budget", "ctas_per_sm",
           "aligned_columns",
           "stored_shape", "pad_to", "mosaic_gpu_call", "row_layout", "load", "store", "per_row",
           "per_column", "smem", "piece_columns", "StreamedRows", "RowWriter", "BlockBuffers",
           "BlockWriter"]

WARPS, LANES = 4, 32  # one warpgroup per CTA
TMA_MAX_BOX = 256  # elements one TMA copy moves along a dimension at most (Mosaic GPU's limit)
PIECE = TMA_MAX_BOX  # columns of a row one TMA copy moves
TMA_ALIGNMENT = 16  # bytes: TMA needs every GMEM stride but the last a multiple of 16 bytes
# Bytes: a TMA copy's shared-memory address must be a multiple of this. Nothing checks it before
# the device: Mosaic GPU's compiler and interpreter both took the gather's rows at 16-byte
# offsets, and an H100 raised CUDA_ERROR_MISALIGNED_ADDRESS on them (2026-11-26).
TMA_SMEM_ALIGNMENT = 128
# Shared memory a CTA holds beyond a kernel's planned buffers: Pallas' 2 KiB cross-warp
# reduction scratch and up to 32 barriers of 8 bytes (`PALLAS_SMEM`), and the 1 KiB the
# hardware reserves per CTA.
PALLAS_SMEM = 2048 + 32 * 8
RESERVED_SMEM = PALLAS_SMEM + _targets.CTA_SHARED_RESERVE


def smem_budget(whole: bool = False) -> int:
    """Shared memory one CTA may plan on the program's GPU: by default half of it, so two CTAs
    share an SM; `whole`: all of it (a caller's blocks, as a TPU config may plan all of VMEM)."""
    limit = _targets.current("gpu").shared_memory
    return (limit if whole else limit // 2) - RESERVED_SMEM


def ctas_per_sm(shared_bytes: int) -> int:
    """CTAs of one warpgroup planning `shared_bytes` of shared memory that an SM of the
    program's GPU holds at once (with `PALLAS_SMEM`; `Target.ctas_per_sm` adds the hardware's
    reserve). Their registers are well within: the compile report's `ctas_per_sm` checks."""
    return _targets.current("gpu").ctas_per_sm(WARPS * LANES, 0, shared_bytes + PALLAS_SMEM)


def aligned_columns(columns: int, itemsize: int, alignment: int = TMA_ALIGNMENT) -> int:
    """`columns` rounded up to a multiple of `alignment` bytes: by default a GMEM row TMA can
    address; with `TMA_SMEM_ALIGNMENT`, a shared-memory row TMA can write."""
    return round_up(columns, alignment // itemsize)


def stored_shape(shape: tuple[int, ...], window: tuple[int, int]) -> tuple[int, ...]:
    """The shape to allocate for a GMEM output of `shape` (..., rows, columns) that TMA stores
    in `window`s of (rows, columns): `shape` itself, or where Mosaic GPU would store a ragged
    window past the rows it belongs to, padded to whole windows (the caller slices the result).

    Why: Mosaic GPU (jax 0.12.0.1) stores an unswizzled window that is one run of GMEM (a
    single row, or whole rows) by a linear bulk copy (`cp.async.bulk`), clamped only at the
    array's end, where TMA's tensor copy drops what falls outside each dimension (a swizzled
    window, as the matmul's epilogue stores, is always a tensor copy). A ragged such window
    overwrites the rows after it: on an H100 (2026-11-26) a gather of one id per batch slice
    and a scatter-add's one-row partial sums lost their neighbours' rows, which its
    interpreter wrote correctly. Rows past the last are harmless where nothing follows them
    (one matrix)."""
    *outer, rows, columns = shape
    block_rows, block_columns = window
    if block_rows > 1 and block_columns != columns:  # a tensor copy
        return tuple(shape)
    if math.prod(outer) > 1:
        rows = round_up(rows, block_rows)
    return (*outer, rows, round_up(columns, block_columns))


def pad_to(a: jax.Array, *sizes: int) -> jax.Array:
    """`a` with its last `len(sizes)` dims padded with zeros to `sizes` (rows TMA can address,
    `aligned_columns`; whole TMA tiles): a copy by XLA, where they are not that long already."""
    pads = [size - dim for size, dim in zip(sizes, a.shape[a.ndim - len(sizes):])]
    if not any(pads):
        return a
    return jnp.pad(a, [(0, 0)] * (a.ndim - len(sizes)) + [(0, pad) for pad in pads])


def row_layout(block_rows: int, row: int, itemsize: int, warps_along_row: int = WARPS) -> Any:
    """The registers of a (block_rows, row) block: the 4 warps split the rows
    (WARPS // warps_along_row ways) and the row (warps_along_row ways); a warp's 32 lanes split
    its part of the row in vectors of up to 16 bytes, so each load is one coalesced sweep.
    Needs block_rows % (WARPS // warps_along_row) == 0 and row % (warps_along_row * 32) == 0."""
    warps_along_rows = WARPS // warps_along_row
    vector = 16 // itemsize
    while vector > 1 and row % (warps_along_row * LANES * vector):
        vector //= 2
    if block_rows % warps_along_rows or row % (warps_along_row * LANES * vector):
        raise ValueError(f"row_layout: {block_rows} rows of {row} do not split over "
                         f"{warps_along_rows}x{warps_along_row} warps")
    rows_per_warp = block_rows // warps_along_rows
    tiling = plgpu.Tiling(((block_rows, row), (rows_per_warp, row // warps_along_row),
                           (rows_per_warp, LANES * vector), (1, vector)))
    # Mosaic GPU's compiler accepts only canonical layouts (no size-1 tiled dims), which its
    # interpreter never checks: build it unchecked and canonicalize it.
    layout = TiledLayout(tiling, warp_dims=(-8, -7), lane_dims=(-3,), vector_dim=-1,
                         _check_canonical=False).canonicalize()
    return plgpu.Layout.TILED(layout.tiling, warp_dims=layout.warp_dims,
                              lane_dims=layout.lane_dims, vector_dim=layout.vector_dim)


def load(ref: Any, layout: Any = None) -> jax.Array:
    """A GMEM block into registers, by plain loads (a block of a few statistics is less than
    whole 32-byte sectors a warp, which the optimized transfer planner rejects)."""
    return plgpu.load(ref, layout=layout, optimized=False)


def store(ref: Any, value: jax.Array) -> None:
    plgpu.store(ref, value, optimized=False)


def per_row(value: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """One value per row of a (rows, columns) block, broadcast along the rows (Mosaic GPU
    takes broadcasts only as `broadcast_in_dim`, not by numpy's rules)."""
    return jax.lax.broadcast_in_dim(value, shape, (0,))


def per_column(value: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """One value per column of a (rows, columns) block, broadcast down the columns."""
    return jax.lax.broadcast_in_dim(value, shape, (1,))


# Shared-memory tiles of dense row-major rows: untiled, so their TMA copies take a GMEM row of
# any multiple of 16 bytes (Mosaic GPU's layout inference would otherwise tile them in 128-byte
# columns where a block has several rows, and demand rows of such multiples). For buffers no
# wgmma reads.
UNTILED = (plgpu.TilingTransform((1,)),)


def smem(shape: tuple[int, ...], dtype: Any) -> Any:
    """A shared-memory scratch buffer of dense row-major tiles (`UNTILED`)."""
    return plgpu.SMEM(shape, dtype, transforms=UNTILED)


def piece_columns(piece: jax.Array, width: int = PIECE) -> Any:
    """Columns [piece·width, (piece + 1)·width), for a traced `piece` (jax checks a static
    slice against the array's edge; TMA zero-fills reads past it, and a store past it needs
    `stored_shape`)."""
    return pl.ds(piece * width, width)


def _read_slot(buffers: dict, slot: jax.Array, layout: Any) -> dict:
    """Slot `slot` of each staged array (name -> a (slots, block_rows, PIECE) ref), in float32
    registers."""
    return {name: plgpu.load(ref.at[slot], layout=layout, optimized=False).astype(jnp.float32)
            for name, ref in buffers.items()}


class StreamedRows:
    """A block of rows of the GMEM arrays `gmem` (name -> ref), streamed piece by piece by TMA
    through a 2-slot ring in `smem` (name -> a (2, block_rows, PIECE) scratch ref) into
    registers, for rows too long to stay in shared memory: each read copies its piece again,
    the next one in flight while this one is read, so a kernel making several passes reads the
    rows from GMEM (mostly L2) once per pass. `barriers`: 2 barriers of len(gmem) arrivals."""

    def __init__(self, gmem: dict, smem: dict, barriers: Any, block_rows: int, num_pieces: int):
        self.gmem, self.smem, self.barriers = gmem, smem, barriers
        self.block_rows, self.num_pieces = block_rows, num_pieces

    def _copy(self, first, piece, slot) -> None:
        rows = pl.ds(first, self.block_rows)
        for name, ref in self.gmem.items():
            plgpu.copy_gmem_to_smem(ref.at[rows, piece_columns(piece)], self.smem[name].at[slot],
                                    self.barriers.at[slot])

    def start(self, first: jax.Array) -> None:
        """Starts copying the first piece of the block of rows from `first` (the reads of the
        previous block, if any, must be done: this waits for every thread's)."""
        plgpu.commit_smem()
        self._copy(first, jnp.int32(0), 0)

    def read(self, first: jax.Array, step: jax.Array, total_steps: int, layout: Any) -> dict:
        """The block's next piece of each array in float32 registers. `step`: this read's place
        among the block's `total_steps` reads, in order (pass · num_pieces + piece)."""
        slot = step % 2
        plgpu.commit_smem()  # every thread has read the other slot: it may be refilled

        # pl.when, not the copy's predicate: Mosaic GPU's interpreter (jax 0.12.0.1) takes a
        # predicate operand for a transform of the barrier and fails.
        @pl.when(step + 1 < total_steps)
        def _():
            self._copy(first, (step + 1) % self.num_pieces, 1 - slot)

        plgpu.barrier_wait(self.barriers.at[slot])
        return _read_slot(self.smem, slot, layout)


class RowWriter:
    """Writes pieces of a block of rows to the GMEM arrays `gmem` through a ring of 2 SMEM
    slots per array (`smem`: name -> (2, block_rows, PIECE)), one TMA store per piece."""

    def __init__(self, gmem: dict, smem: dict, block_rows: int):
        self.gmem, self.smem, self.block_rows = gmem, smem, block_rows

    def write(self, first: jax.Array, piece: jax.Array, values: dict) -> None:
        """Piece `piece` of the rows from `first`; a block's pieces are written in order, from
        0 (so a slot alternates within a block, and `start` separates blocks)."""
        slot = piece % 2
        # The stores issued two pieces ago, from this slot, have read it (this waits for the
        # whole warpgroup).
        plgpu.wait_smem_to_gmem(len(values), wait_read_only=True)
        for name, value in values.items():
            store(self.smem[name].at[slot], value.astype(self.smem[name].dtype))
        plgpu.commit_smem()
        for name in values:
            plgpu.copy_smem_to_gmem(self.smem[name].at[slot], self.gmem[name].at[
                pl.ds(first, self.block_rows), piece_columns(piece)])

    @staticmethod
    def start() -> None:
        """Before a CTA's next block: its stores have read both slots (the last piece of a
        block and the first of the next can share a slot)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def flush(self, first: jax.Array) -> None:
        """After a block's last piece (each was stored as it was written)."""

    @staticmethod
    def finish() -> None:
        """Waits for every store (SMEM is freed when the kernel ends)."""
        plgpu.wait_smem_to_gmem(0)


class BlockBuffers:
    """Blocks of rows of the GMEM arrays `gmem` (name -> ref) in two whole-block buffers in
    shared memory (`smem`: name -> a (2·num_pieces, block_rows, PIECE) scratch ref; buffer b's
    pieces are slots b·num_pieces + piece), one barrier each (`barriers`: 2 of
    num_pieces·len(gmem) arrivals). A CTA walking blocks reads one buffer while TMA fills the
    other with its next block, so a whole block's copies are in flight while it computes, and
    it waits once per block, not per piece."""

    def __init__(self, gmem: dict, smem: dict, barriers: Any, block_rows: int, num_pieces: int):
        self.gmem, self.smem, self.barriers = gmem, smem, barriers
        self.block_rows, self.num_pieces = block_rows, num_pieces

    def start(self, first: jax.Array, buffer: jax.Array) -> None:
        """Starts copying the block of rows from `first` into `buffer`, whose previous block
        every thread must have read (this waits for them all)."""
        plgpu.commit_smem()
        rows = pl.ds(first, self.block_rows)

        def copy(piece, carry):
            for name, ref in self.gmem.items():
                plgpu.copy_gmem_to_smem(ref.at[rows, piece_columns(piece)],
                                        self.smem[name].at[buffer * self.num_pieces + piece],
                                        self.barriers.at[buffer])
            return carry

        jax.lax.fori_loop(0, self.num_pieces, copy, 0)

    def wait(self, buffer: jax.Array) -> None:
        plgpu.barrier_wait(self.barriers.at[buffer])

    def read(self, buffer: jax.Array, piece: jax.Array, layout: Any) -> dict:
        """Piece `piece` of each array of the block in `buffer`, in float32 registers."""
        slot = buffer * self.num_pieces + piece
        return _read_slot(self.smem, slot, layout)


class BlockWriter(RowWriter):
    """Writes a block of rows to the GMEM arrays `gmem` from a whole block staged in shared
    memory (`smem`: name -> (num_pieces, block_rows, PIECE)): pieces are stored to it as they
    are computed (no barrier), then `flush` issues every piece's TMA store at once. `start`
    before a block's first piece, as `RowWriter`'s."""

    def __init__(self, gmem: dict, smem: dict, block_rows: int, num_pieces: int):
        super().__init__(gmem, smem, block_rows)
        self.num_pieces = num_pieces

    def write(self, first: jax.Array, piece: jax.Array, values: dict) -> None:
        for name, value in values.items():
            store(self.smem[name].at[piece], value.astype(self.smem[name].dtype))

    def flush(self, first: jax.Array) -> None:
        """Stores the staged block to the rows from `first` (every thread's pieces: this waits
        for them all)."""
        plgpu.commit_smem()
        rows = pl.ds(first, self.block_rows)

        def copy(piece, carry):
            for name, ref in self.smem.items():
                plgpu.copy_smem_to_gmem(ref.at[piece], self.gmem[name].at[
                    rows, piece_columns(piece)])
            return carry

        jax.lax.fori_loop(0, self.num_pieces, copy, 0)


def mosaic_gpu_call(body: Callable[..., None], *, out_shape: Sequence[jax.ShapeDtypeStruct],
                    grid: tuple[int, ...], grid_names: tuple[str, ...], interpret: bool | str,
                    name: str, scratch: Sequence[Any] = (),
                    flops_and_bytes: tuple[int, int] = (0, 0),
                    transcendentals: int = 0,
                    warpgroups: int | None = None,
                    auto_barriers: bool = True) -> Callable[..., Any]:
    """`plgpu.kernel(body, ...)`, one warpgroup per CTA (or `warpgroups` of them, the axis
    "wg": a warp-specialized kernel), launched as `name`. `interpret` (the dispatch's mode):
    False compiles; True and "strict" run Mosaic GPU's interpreter on the device's schedule,
    "strict" with its race detector (Pallas' HLO interpreter cannot run `plgpu.kernel`). Its
    cost estimate states `flops_and_bytes` (the bytes its TMA copies and loads move, re-reads
    included, as `triton_call`'s) and `transcendentals`. `auto_barriers=False`: Pallas puts
    no warpgroup barrier before and after each shared-memory store (two per store, where a
    streaming kernel stores a piece at a time), for a kernel whose every handoff of shared
    memory between threads already passes a barrier of its own (`plgpu.commit_smem`,
    `plgpu.wait_smem_to_gmem`, a TMA barrier) and whose threads read-modify-write only
    the elements they own (`CompilerParams.unsafe_no_auto_barriers`)."""
    params = (plgpu.InterpretGPUParams(detect_races=interpret == "strict") if interpret
              else None)
    body.__name__ = name  # the launch's name in jaxprs, HLO and the compile reports
    return plgpu.kernel(
        body, out_type=tuple(out_shape), grid=grid, grid_names=grid_names,
        scratch_types=tuple(scratch), num_threads=warpgroups,
        thread_name=None if warpgroups is None else "wg",
        cost_estimate=pl.CostEstimate(flops=flops_and_bytes[0], bytes_accessed=flops_and_bytes[1],
                                      transcendentals=transcendentals),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            unsafe_no_auto_barriers=not auto_barriers),
        interpret=params)
