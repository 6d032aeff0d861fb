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
from kernels._pallas.mosaic_gpu import (PIECE, TMA_MAX_BOX, TMA_SMEM_ALIGNMENT,
                                        aligned_columns, ctas_per_sm, smem_budget)
from kernels.gather.common import GatherConfig, Pieces, Problem, gather_bytes

__all__ = ["ForwardPlan", "BackwardPlan", "forward_plan", "backward_plan", "forward_seconds",
           "backward_seconds", "padding_bytes", "resolve_config", "check"]

# A TMA copy moves at most 256 elements along a dimension: a tile's rows, stored by one copy.
_MAX_TILE_ROWS = 256
# Bytes of one forward tile (a slot of its ring): a tile's ids' rows, or their piece. A CTA
# keeps `_FORWARD_SLOTS - 1` tiles loading while it stores one, 40 KiB in flight, and 4 such
# CTAs share an SM (160 KiB, `forward_seconds`): several times the ~23 KiB in flight an H100 SM
# needs to cover HBM's latency at `_targets.COPY_SHARE` of its bandwidth (Little's law,
# `_targets.MEMORY_LATENCY`). One-row tiles of an 8 KiB row spread 8192 ids over a wave of
# CTAs within 3% of even.
_TILE_BYTES = 8 * 1024
_FORWARD_SLOTS = 6
# Ids one forward CTA stages in shared memory (4 bytes each) before its first row copy: more
# ids than the target's resident CTAs take at this many make CTAs of their own (later waves).
_MAX_RUN_IDS = 2048
# Pieces of `PIECE` columns a backward CTA sums at once (a span: 4096 columns, 32 float32
# accumulators a thread, and as many for the row it adds). Wider rows are summed a span at a
# time, each span walking the block's ids again.
_SPAN_PIECES = 16
# Bytes of a backward CTA's ring of cotangent spans (at least 2 slots): all but one span load
# while it sums one, 24 KiB of 8 KiB spans, and 2 CTAs an SM keep 48 KiB in flight
# (`backward_seconds`) against the ~23 KiB an H100 SM needs to cover HBM's latency. A row's
# store is waited for only when its output slot is reused.
_RING_BYTES = 32 * 1024
# Slots (and barriers) a backward ring has at most: Mosaic GPU allocates up to 32 barriers
# per group; short rows keep 16 in flight.
_MAX_RING_SLOTS = 16
_PARTIAL_SLOTS = 2
# Table rows one backward CTA owns, about: the blocks are sized to fill whole waves.
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
    columns, one TMA copy a piece. The piece is the whole row where the row's bytes are a
    multiple of `TMA_SMEM_ALIGNMENT` (each row of a tile then starts at an address TMA can
    write): one copy an id. Otherwise it is `PIECE` columns, or a short row rounded up to that
    alignment (TMA zero-fills the columns past the row and drops them from the store). The ids
    come in tiles of `tile_rows`; CTA (b, group, run) gathers the rows of `run_tiles`
    consecutive tiles, pieces `group · pieces_per_group ...` of them, through a ring of `slots`
    (tile_rows, box) tiles in shared memory, after staging the run's ids in shared memory."""

    aligned: int
    box: int
    num_pieces: int
    tile_rows: int
    slots: int
    blocks: int  # tiles of ids per batch slice
    run_tiles: int  # tiles one CTA walks
    groups: int  # CTAs that share a tile's pieces
    batch: int
    itemsize: int

    @property
    def pieces_per_group(self) -> int:
        return pl.cdiv(self.num_pieces, self.groups)

    @property
    def runs(self) -> int:
        """CTAs along a batch slice's ids, per group."""
        return pl.cdiv(self.blocks, self.run_tiles)

    @property
    def programs(self) -> int:
        return self.batch * self.groups * self.runs

    @property
    def id_box(self) -> int:
        """Ids one TMA copy stages (whole 16 bytes of them)."""
        return min(TMA_MAX_BOX, aligned_columns(self.run_tiles * self.tile_rows, 4))

    @property
    def id_copies(self) -> int:
        return pl.cdiv(self.run_tiles * self.tile_rows, self.id_box)

    @property
    def in_bounds(self) -> bool:
        """Whether every piece lies inside its row (TMA then moves it as one linear copy)."""
        return self.aligned % self.box == 0

    @property
    def smem_bytes(self) -> int:
        return (self.slots * self.tile_rows * self.box * self.itemsize
                + 4 * self.id_copies * self.id_box)


class BackwardPlan(NamedTuple):
    """The scatter-add of one call: rows of `aligned` columns, `num_pieces` pieces of `PIECE`
    columns, summed a span of `span_pieces` pieces at a time (the whole row unless it is wider
    than `_SPAN_PIECES` pieces). CTA (b, block) owns `tile_rows` table rows, whole, with `slots`
    cotangent spans in flight; a row's positions past its first `pieces.length` are summed by
    the pieces kernel, one CTA per (b, piece of positions). Where the row is whole pieces
    (`whole`), a span is one linear copy and the spans' starts are clamped inside the row (the
    last may overlap the one before: the same sums written twice); else each piece is a copy of
    its own, TMA zero-filling the columns past the row on loads, the row's last piece storing
    only its `tail` columns."""

    aligned: int
    num_pieces: int
    span_pieces: int
    tile_rows: int
    slots: int
    blocks: int  # table-row blocks per batch slice
    batch: int
    itemsize: int
    pieces: Pieces

    @property
    def spans(self) -> int:
        return pl.cdiv(self.num_pieces, self.span_pieces)

    @property
    def whole(self) -> bool:
        return self.aligned % PIECE == 0

    @property
    def programs(self) -> int:
        return self.batch * self.blocks

    @property
    def partial_slots(self) -> int:
        return _PARTIAL_SLOTS

    @property
    def copies_per_span(self) -> int:
        """TMA copies of one row's span: one where rows are whole pieces, else one a piece."""
        return 1 if self.whole else self.span_pieces

    @property
    def partial_pieces(self) -> int:
        """Pieces of a float32 partial row: every span inside it, so that each is one copy."""
        return self.num_pieces if self.whole else self.spans * self.span_pieces

    def span_start(self, span):
        """The first piece of span `span` (traced or not)."""
        if self.whole:
            return jnp.minimum(span * self.span_pieces, self.num_pieces - self.span_pieces)
        return span * self.span_pieces

    @property
    def moved_columns(self) -> int:
        """Columns of a row its spans move together (an overlapping last span moves some twice;
        columns past a ragged row are zero-filled, not moved)."""
        return self.spans * self.span_pieces * PIECE if self.whole else self.aligned

    @property
    def tail(self) -> int:
        """Columns of the row's last piece. A piece's store is one row, which Mosaic GPU
        issues as a linear copy clamped only at the array's end (`stored_shape`): a whole
        piece past the row's `aligned` columns would overwrite the next row's first ones."""
        return self.aligned - (self.num_pieces - 1) * PIECE

    @property
    def smem_bytes(self) -> int:
        """Its ring of cotangent spans, the ring of the pieces' float32 partial spans (if any),
        two output spans and a zero span."""
        span = self.span_pieces * PIECE
        partials = 4 * _PARTIAL_SLOTS if self.pieces.count else 0
        return span * (self.itemsize * (self.slots + 3) + partials)


def _aligned(p: Problem) -> int:
    return aligned_columns(max(p.columns, 1), p.itemsize)


def forward_plan(p: Problem, config: GatherConfig | None) -> ForwardPlan:
    """Whole rows where two of them fit half an SM's shared memory and `config.block_columns`
    asks for no fewer columns, else pieces. Tiles of up to `_TILE_BYTES` of their ids' pieces
    (at most `_MAX_TILE_ROWS` ids); runs of `config.block_indices` ids (rounded up to whole
    tiles) or, by default, of as many tiles as spread them evenly over one wave of the CTAs the
    target's SMs hold (at most `_MAX_RUN_IDS` ids); `config.block_columns` columns per CTA
    (default: the whole row, or split into groups of pieces where the ids' tiles alone are
    fewer than two waves of the target's SMs); up to `_FORWARD_SLOTS` tiles in shared
    memory."""
    config = config or GatherConfig()
    aligned, m = _aligned(p), max(p.num_indices, 1)
    row_bytes = aligned * p.itemsize
    if (row_bytes % TMA_SMEM_ALIGNMENT == 0 and 2 * row_bytes <= smem_budget() // 2
            and (config.block_columns or aligned) >= aligned):
        box = aligned
    else:
        box = min(PIECE, aligned_columns(aligned, p.itemsize, TMA_SMEM_ALIGNMENT))
    num_pieces, piece_bytes = pl.cdiv(aligned, box), box * p.itemsize
    tile_limit = max(1, min(_MAX_TILE_ROWS, _TILE_BYTES // piece_bytes))
    run_tiles = pl.cdiv(min(config.block_indices or 1, m), tile_limit)
    rows = (pl.cdiv(min(config.block_indices, m), run_tiles) if config.block_indices
            else min(tile_limit, m))
    blocks = pl.cdiv(m, rows)
    target = _targets.current("gpu")
    if config.block_columns:
        per_group = min(pl.cdiv(config.block_columns, box), num_pieces)
    else:
        wanted = pl.cdiv(target.min_programs, p.batch * blocks)
        per_group = pl.cdiv(num_pieces, min(num_pieces, wanted))
    groups = pl.cdiv(num_pieces, per_group)
    plan = ForwardPlan(aligned, box, num_pieces, rows, _FORWARD_SLOTS, blocks, run_tiles,
                       groups, p.batch, p.itemsize)
    if not config.block_indices:
        # The most CTAs an SM holds with the runs they would take (a run's ids are staged in
        # shared memory, so fewer CTAs an SM, longer runs, more shared memory each).
        for ctas in range(ctas_per_sm(plan.smem_bytes), 0, -1):
            run_tiles = min(pl.cdiv(p.batch * groups * blocks, target.num_sms * ctas),
                            max(1, _MAX_RUN_IDS // rows), blocks)
            if ctas_per_sm(plan._replace(run_tiles=run_tiles).smem_bytes) >= ctas:
                break
        plan = plan._replace(run_tiles=run_tiles)
    fits = (smem_budget(whole=True) - plan._replace(slots=0).smem_bytes) // (rows * piece_bytes)
    return plan._replace(slots=min(_FORWARD_SLOTS, fits,
                                   plan.run_tiles * plan.pieces_per_group))


def backward_plan(p: Problem, config: GatherConfig | None) -> BackwardPlan:
    """Spans of up to `_SPAN_PIECES` pieces, equal where the row takes several; blocks of
    `config.block_rows` table rows (default: about `_BLOCK_ROWS`, sized so that the blocks fill
    whole waves of the CTAs the target's SMs hold); `_RING_BYTES` of cotangent spans in flight;
    and pieces of about sqrt(m) positions (at least `_MIN_PIECE_LENGTH`): a row owner's walk is
    at most that long, and so is the sum of its pieces' partial rows, whatever the ids."""
    config = config or GatherConfig()
    aligned, n = _aligned(p), max(p.n, 1)
    num_pieces = pl.cdiv(aligned, PIECE)
    span_pieces = pl.cdiv(num_pieces, pl.cdiv(num_pieces, _SPAN_PIECES))
    slots = max(2, min(_MAX_RING_SLOTS, _RING_BYTES // (span_pieces * PIECE * p.itemsize)))
    length = max(_MIN_PIECE_LENGTH, next_power_of_2(math.isqrt(p.num_indices)))
    pieces = Pieces(length, max(p.num_indices - 1, 0) // length)
    plan = BackwardPlan(aligned, num_pieces, span_pieces, min(config.block_rows or _BLOCK_ROWS, n),
                        slots, 1, p.batch, p.itemsize, pieces)
    if not config.block_rows:
        resident = _targets.current("gpu").num_sms * ctas_per_sm(plan.smem_bytes)
        waves = pl.cdiv(p.batch * n, resident * _BLOCK_ROWS)
        plan = plan._replace(tile_rows=pl.cdiv(n, pl.cdiv(resident * waves, p.batch)))
    return plan._replace(blocks=pl.cdiv(n, plan.tile_rows))


def forward_seconds(plan: ForwardPlan) -> float:
    """The forward's design time on the program's GPU (`Target.copy_seconds`): each CTA reads
    and writes its run's rows (whole runs, the last too), `slots - 1` tiles in flight."""
    tile = plan.tile_rows * plan.box * plan.itemsize
    return _targets.current("gpu").copy_seconds(
        plan.programs, ctas_per_sm(plan.smem_bytes),
        2 * plan.run_tiles * plan.pieces_per_group * tile, max(1, plan.slots - 1) * tile)


def backward_seconds(p: Problem, plan: BackwardPlan, sorting_launches: int) -> float:
    """The gradient's design time on the program's GPU, for ids spread evenly (no row hit more
    than `pieces.length` times): XLA's `sorting_launches` that sort the ids and the pieces
    kernel (finding no pieces) at `_targets.SMALL_LAUNCH_SECONDS` each, and the scatter-add
    as a copy (`Target.copy_seconds`): each CTA writes its rows and reads its share of the
    cotangent rows, a span at a time, its ring of spans in flight (a store is waited for only
    by the slot it read, and at the end of a span)."""
    target = _targets.current("gpu")
    hits = p.num_indices * plan.tile_rows / max(p.n, 1)
    span = plan.span_pieces * PIECE * plan.itemsize
    rows = target.copy_seconds(plan.programs, ctas_per_sm(plan.smem_bytes),
                               int((plan.tile_rows + hits) * plan.moved_columns * plan.itemsize),
                               (plan.slots - 1) * span)
    launches = sorting_launches + (1 if plan.pieces.count else 0)
    return launches * _targets.SMALL_LAUNCH_SECONDS + rows


def padding_bytes(p: Problem) -> int:
    """The bytes a padding copy of the table moves: the table read, the padded one written
    (0 where rows need no padding)."""
    aligned = _aligned(p)
    return 0 if aligned == p.columns else p.batch * p.n * (p.columns + aligned) * p.itemsize


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """`config` with the fields Mosaic GPU takes filled from the plans: `block_indices` the ids
    one forward CTA gathers, `block_columns` the columns it walks, `block_rows` the backward's
    table rows per CTA."""
    forward = forward_plan(p, config)
    return dataclasses.replace(config or GatherConfig(),
                               block_indices=forward.run_tiles * forward.tile_rows,
                               block_columns=forward.pieces_per_group * forward.box,
                               block_rows=backward_plan(p, config).tile_rows)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Declines 64-bit tables, and rows whose padding copy would move over `_MAX_PADDING`
    times the gather's bytes (and over `_SMALL_PADDING_BYTES`); rejects runs of ids over
    `_MAX_RUN_IDS`. Fields of other implementations' configs are ignored."""
    if p.itemsize == 8:
        raise NotImplementedError(f"{jnp.dtype(p.dtype).name} tables are not supported on "
                                  "Mosaic GPU")
    config = config or GatherConfig()
    for field, limit, why in (("block_indices", _MAX_RUN_IDS, "ids a CTA stages"),
                              ("block_rows", None, None), ("block_columns", None, None)):
        value = getattr(config, field)
        if value is not None and not (is_positive_int(value) and value <= (limit or value)):
            raise ValueError(f"config.{field} must be a positive int" + (
                f" in [1, {limit}] ({why})" if limit else "") + f", got {value!r}")
    if p.batch * p.num_indices * p.columns == 0:
        return  # an empty result: no kernel runs
    if padding_bytes(p) > max(_SMALL_PADDING_BYTES, _MAX_PADDING * gather_bytes(p)):
        raise NotImplementedError(
            f"rows of {p.columns} {jnp.dtype(p.dtype).name} are not a multiple of 16 bytes "
            f"(TMA's stride rule), and padding the {p.n}-row table would move "
            f"{padding_bytes(p) / gather_bytes(p):.0f}x the bytes the gather moves")

