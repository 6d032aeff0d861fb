"""How big the Triton gather and scatter-add kernels' blocks are, and what their work is bounded
by (the kernels themselves are in `forward.py` and `backward.py` beside it): the forward's
config (`resolve_config`) and the checks that decline a problem or reject a config (`check`);
the backward's rows schedule (`rows_schedule`: the device's, and the fast interpreter's), its
pieces (`pieces`: how a hot row's work is cut so no program's loop grows with the ids) and the
longest loop they leave (`longest_loop`); and the bytes the pieces launch moves."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from kernels import _targets
from kernels._blocks import (check_triton_config, next_power_of_2, require_int32_offsets,
                             tile_limit)
from kernels._pallas import pl
from kernels.gather.common import GatherConfig, Pieces, Problem, check_int

__all__ = ["resolve_config", "check", "segment_rows", "RowsSchedule", "rows_schedule",
           "pieces", "longest_loop", "pieces_bytes"]

_MAX_BLOCK_INDICES = 64
_MAX_BLOCK_COLUMNS = 512


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """Power-of-2 blocks: up to 64 indices by up to 512 columns (a 64 KiB float32 tile)."""
    config = config or GatherConfig()
    block_columns = config.block_columns or min(tile_limit(_MAX_BLOCK_COLUMNS),
                                                next_power_of_2(p.columns))
    # Short rows (the last-axis gather): take more indices per program instead.
    block_indices = config.block_indices or min(
        max(_MAX_BLOCK_INDICES, tile_limit(_MAX_BLOCK_INDICES * 64) // block_columns),
        next_power_of_2(max(p.num_indices, 1)))
    num_warps = config.num_warps or (8 if block_indices * block_columns >= 16384 else 4)
    return dataclasses.replace(config, block_indices=block_indices, block_columns=block_columns,
                               num_warps=num_warps, num_stages=config.num_stages or 2)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Takes every dtype; declines tables and outputs past int32 offsets; rejects a config
    that Triton cannot compile."""
    require_int32_offsets(x=p.batch * p.n * p.columns, output=p.batch * p.num_indices * p.columns)
    for field in ("block_indices", "block_columns", "num_warps", "num_stages"):
        check_int(config or GatherConfig(), field)
    # No dot here, so blocks of any power of 2 (1 included: a last-axis gather's rows).
    check_triton_config(resolve_config(p, config), ("block_indices", "block_columns"),
                        min_block=1)


_BLOCK_ROWS = 8  # table rows per backward program
# ... in the fast interpreter, all side by side (`rows_schedule`). Not more: from 128 on, XLA's
# compile of a sharded program holding the kernel (jax 0.12, Auto axes) ran for minutes.
_INTERPRETED_BLOCK_ROWS = 64
_SEGMENT_TILE = 4096  # elements of the (segment_rows, block_columns) cotangent tile per step
_MIN_PIECE_STEPS = 8  # a piece is at least this many load steps


def segment_rows(block_columns: int) -> int:
    return max(1, _SEGMENT_TILE // block_columns)


class RowsSchedule(NamedTuple):
    """How a backward rows program walks its table rows: `block_rows` rows per program,
    `rows_at_once` of them side by side, each summing its segment `rows_per_step` positions
    per load step; `blocked_output`: the program's rows are its own (block_rows,
    block_columns) output block, written once by the pipeline, not stores into the table."""

    block_rows: int
    rows_at_once: int
    rows_per_step: int
    blocked_output: bool


def rows_schedule(block_columns: int) -> RowsSchedule:
    """On a GPU (and in "strict"): one row at a time, a (segment_rows, block_columns) tile per
    step, so a row's loads are independent and in flight together, each row stored by a
    masked pointer store. In the fast interpreter, whose cost is per loop step and per
    scattered element: `_INTERPRETED_BLOCK_ROWS` rows side by side, one position each per step
    (as many steps as the longest segment), written as one output block; a pointer store into
    the table interprets as an element-wise scatter, which cost 90% of the backward there
    (`_targets.INTERPRETER`)."""
    return _targets.device_or_interpreter(
        "gpu", RowsSchedule(_BLOCK_ROWS, 1, segment_rows(block_columns), False),
        RowsSchedule(_INTERPRETED_BLOCK_ROWS, _INTERPRETED_BLOCK_ROWS, 1, True))


def pieces(p: Problem, block_columns: int) -> Pieces:
    """Pieces of about sqrt(m) positions (whole load steps, at least `_MIN_PIECE_STEPS`): a row
    owner's two loops, over its first piece and then over its other pieces' partial sums, take
    about sqrt(m)/segment_rows steps each, whatever the ids. Up to 64 ids at 512 columns there
    are no pieces (the owner's loop is short anyway)."""
    rows_per_step = segment_rows(block_columns)
    steps = max(_MIN_PIECE_STEPS,
                next_power_of_2(max(1, math.isqrt(p.num_indices) // rows_per_step)))
    length = rows_per_step * steps
    return Pieces(length, max(p.num_indices - 1, 0) // length)


def longest_loop(p: Problem, config: GatherConfig | None = None) -> int:
    """The most load steps any backward program runs for one table row, whatever the ids (the
    first piece of a row hit by every index, then the partial sums of all the pieces)."""
    block_columns = resolve_config(p, config).block_columns
    rows_per_step, (length, count) = segment_rows(block_columns), pieces(p, block_columns)
    return pl.cdiv(length, rows_per_step) + pl.cdiv(count, rows_per_step)


def pieces_bytes(p: Problem, partial_bytes: int) -> int:
    """At most every cotangent row read once (those past their row's first piece), the
    partials written once."""
    cotangent_bytes = p.batch * p.num_indices * p.columns * p.itemsize
    return cotangent_bytes + 4 * p.num_indices + partial_bytes
