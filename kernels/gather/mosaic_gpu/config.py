"""How the Mosaic GPU gather and scatter-add kernels' blocks are sized (the kernels are in
`forward.py` and `backward.py` beside it): each kernel's plan for one call (`forward_plan`,
`backward_plan`: rows per tile, copies in flight, pieces, CTAs), the config they fill
(`resolve_config`) and the checks that decline a problem or reject a config (`check`)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import is_positive_int, next_power_of_2
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import PIECE, TMA_SMEM_ALIGNMENT, aligned_columns, smem_budget
from kernels.gather.common import GatherConfig, Pieces, Problem, gather_bytes

__all__ = ["ForwardPlan", "BackwardPlan", "forward_plan", "backward_plan", "backward_smem",
           "padding_bytes", "resolve_config", "check"]

# A TMA copy moves at most 256 elements along a dimension: a tile's rows, stored by one copy.
_MAX_TILE_ROWS = 256
# Bytes of one forward tile (the tile's rows' piece): a slot of its ring. A CTA keeps up to
# `_FORWARD_SLOTS - 1` tiles loading while it stores one, 48 KiB in flight, and 3 such CTAs fit
# an SM: well over the ~20 KiB an H100 SM needs in flight to cover HBM's latency at full
# bandwidth (3.35 TB/s x ~800 ns over 132 SMs; an estimate, not measured).
_TILE_BYTES = 16 * 1024
_FORWARD_SLOTS = 4
# The backward's rows in flight per CTA (a slot and a barrier each): 16 pieces of 512 bytes of
# bfloat16 (8 KiB), and shared memory holds about 8 such CTAs per SM (64 KiB in flight).
_RING_ROWS = 16
# Table rows one backward CTA owns: its (rows, PIECE) gradient tile, stored by one TMA copy.
_BLOCK_ROWS = 32
# A backward row owner sums at most this many of its row's positions itself (or about sqrt(m),
# if more): the rest are cut into pieces summed by CTAs of their own (`Pieces`), so no CTA's
# walk grows with how often one id repeats.
_MIN_PIECE_LENGTH = 64
# Rows that are not a multiple of 16 bytes are padded, a copy of the whole table; where that
# copy moves more than this many times the bytes of the gather itself, and more than
# `_SMALL_PADDING_BYTES`, the kernel declines (design: XLA's gather reads the rows in place,
# and a last-axis gather of long rows would copy the table 4-16 times over). A smaller copy
# takes about a launch's time on an H100 (1 MiB at 3.35 TB/s: 0.3 us).
_MAX_PADDING = 8
_SMALL_PADDING_BYTES = 1 << 20


class ForwardPlan(NamedTuple):
    """The gather of one call on the `(batch, n, columns)` view: rows of `aligned` columns in
    GMEM (padded to TMA's 16 bytes where `columns` is not), each `num_pieces` pieces of `box`
    columns (one TMA copy: `PIECE`, or where the row is shorter, the row rounded up to
    `TMA_SMEM_ALIGNMENT` bytes, so that each row of a tile starts at an address TMA can write;
    TMA zero-fills the columns past the row and drops them from the store). CTA (b, tile,
    group) gathers `tile_rows` indices' pieces `group · pieces_per_group ...`, through a ring of
    `slots` (tile_rows, box) tiles in shared memory."""

    aligned: int
    box: int
    num_pieces: int
    tile_rows: int
    slots: int
    blocks: int  # index tiles per batch slice
    groups: int  # CTAs that share a tile's pieces
    programs: int

    @property
    def pieces_per_group(self) -> int:
        return pl.cdiv(self.num_pieces, self.groups)


class BackwardPlan(NamedTuple):
    """The scatter-add of one call: rows of `aligned` columns, `num_pieces` pieces of `PIECE`
    columns; CTA (b, block, piece) owns `tile_rows` table rows of one piece, with `slots`
    cotangent rows in flight; a row's positions past its first `pieces.length` are summed by
    the pieces kernel, one CTA per (b, piece of positions, piece of columns)."""

    aligned: int
    num_pieces: int
    tile_rows: int
    slots: int
    blocks: int  # table-row blocks per batch slice
    programs: int
    pieces: Pieces


def _aligned(p: Problem) -> int:
    return aligned_columns(max(p.columns, 1), p.itemsize)


def forward_plan(p: Problem, config: GatherConfig | None) -> ForwardPlan:
    """Tiles of `config.block_indices` ids (default: `_TILE_BYTES` of their pieces, at most
    `_MAX_TILE_ROWS`), `config.block_columns` columns per CTA (default: the whole row, or split
    into groups of pieces where the ids' tiles alone are fewer than two waves of the target's
    SMs), and up to `_FORWARD_SLOTS` tiles in shared memory."""
    config = config or GatherConfig()
    aligned, m = _aligned(p), max(p.num_indices, 1)
    box = min(PIECE, aligned_columns(aligned, p.itemsize, TMA_SMEM_ALIGNMENT))
    num_pieces = pl.cdiv(aligned, box)
    piece_bytes = box * p.itemsize
    rows = min(config.block_indices or min(_MAX_TILE_ROWS, _TILE_BYTES // piece_bytes), m)
    blocks = pl.cdiv(m, rows)
    if config.block_columns:
        per_group = min(pl.cdiv(config.block_columns, box), num_pieces)
    else:
        tiles = p.batch * blocks
        wanted = pl.cdiv(_targets.current("gpu").min_programs, tiles)
        per_group = pl.cdiv(num_pieces, min(num_pieces, wanted))
    groups = pl.cdiv(num_pieces, per_group)
    fits = smem_budget(whole=config.block_indices is not None) // (rows * piece_bytes)
    slots = min(_FORWARD_SLOTS, per_group, fits)
    return ForwardPlan(aligned, box, num_pieces, rows, slots, blocks, groups,
                       p.batch * blocks * groups)


def backward_plan(p: Problem, config: GatherConfig | None) -> BackwardPlan:
    """Blocks of `config.block_rows` table rows (default `_BLOCK_ROWS`), `_RING_ROWS`
    cotangent rows in flight, and pieces of about sqrt(m) positions (at least
    `_MIN_PIECE_LENGTH`): a row owner's walk is at most that long, and so is the sum of its
    pieces' partial rows, whatever the ids."""
    config = config or GatherConfig()
    aligned, n = _aligned(p), max(p.n, 1)
    num_pieces = pl.cdiv(aligned, PIECE)
    rows = min(config.block_rows or _BLOCK_ROWS, n)
    blocks = pl.cdiv(n, rows)
    length = max(_MIN_PIECE_LENGTH, next_power_of_2(math.isqrt(p.num_indices)))
    pieces = Pieces(length, max(p.num_indices - 1, 0) // length)
    return BackwardPlan(aligned, num_pieces, rows, _RING_ROWS, blocks,
                        p.batch * blocks * num_pieces, pieces)


def backward_smem(p: Problem, plan: BackwardPlan) -> int:
    """Shared memory of a backward CTA: its ring of cotangent rows, the ring of its pieces'
    float32 partial rows (if any) and its gradient tile."""
    partials = 4 * plan.slots if plan.pieces.count else 0
    return PIECE * (p.itemsize * (plan.slots + plan.tile_rows) + partials)


def padding_bytes(p: Problem) -> int:
    """The bytes a padding copy of the table moves: the table read, the padded one written
    (0 where rows need no padding)."""
    aligned = _aligned(p)
    return 0 if aligned == p.columns else p.batch * p.n * (p.columns + aligned) * p.itemsize


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """`config` with the fields Mosaic GPU takes filled from the plans: `block_indices` the
    forward's ids per tile, `block_columns` the columns one forward CTA walks, `block_rows`
    the backward's table rows per CTA."""
    forward = forward_plan(p, config)
    return dataclasses.replace(config or GatherConfig(), block_indices=forward.tile_rows,
                               block_columns=forward.pieces_per_group * forward.box,
                               block_rows=backward_plan(p, config).tile_rows)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Declines 64-bit tables, and rows whose padding copy would move over `_MAX_PADDING`
    times the gather's bytes (and over `_SMALL_PADDING_BYTES`); rejects tiles TMA cannot
    store in one copy, or that the target's shared memory does not hold. Fields of other
    implementations' configs are ignored."""
    if p.itemsize == 8:
        raise NotImplementedError(f"{jnp.dtype(p.dtype).name} tables are not supported on "
                                  "Mosaic GPU")
    config = config or GatherConfig()
    for field, limit in (("block_indices", _MAX_TILE_ROWS), ("block_rows", _MAX_TILE_ROWS),
                         ("block_columns", None)):
        value = getattr(config, field)
        if value is not None and not (is_positive_int(value) and value <= (limit or value)):
            raise ValueError(f"config.{field} must be a positive int" + (
                f" in [1, {limit}] (rows one TMA copy stores)" if limit else "") +
                f", got {value!r}")
    if p.batch * p.num_indices * p.columns == 0:
        return  # an empty result: no kernel runs
    if padding_bytes(p) > max(_SMALL_PADDING_BYTES, _MAX_PADDING * gather_bytes(p)):
        raise NotImplementedError(
            f"rows of {p.columns} {jnp.dtype(p.dtype).name} are not a multiple of 16 bytes "
            f"(TMA's stride rule), and padding the {p.n}-row table would move "
            f"{padding_bytes(p) / gather_bytes(p):.0f}x the bytes the gather moves")
    forward = forward_plan(p, config)
    if forward.slots < 1:
        raise ValueError(f"config.block_indices={config.block_indices}: a tile of "
                         f"{forward.tile_rows} rows of {forward.box} {jnp.dtype(p.dtype).name} "
                         f"is over the {smem_budget(whole=True)} bytes of shared memory a CTA "
                         "plans")
    backward = backward_plan(p, config)
    if jnp.issubdtype(p.dtype, jnp.inexact) and (
            backward_smem(p, backward) > smem_budget(whole=True)):
        raise ValueError(f"config.block_rows={config.block_rows}: "
                         f"{backward_smem(p, backward)} bytes of shared memory, over the "
                         f"{smem_budget(whole=True)} a CTA plans")
