"""How big the Triton normalize kernels' tiles are and how they become programs (the kernels
themselves are in `forward.py` and `backward.py` beside it): the config (`resolve_config`), the
checks that decline a problem or reject a config (`check`), the schedule (`schedule_of`: group
blocks, chunks, and the reduction splits that fill the GPU), the backward's partial rows
(`num_partials`) and a reduction pass's traffic for its cost estimate."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import (INTERPRETED_TILE, check_triton_config, is_positive_int,
                             is_power_of_2, next_power_of_2, split_reduction, tile_limit)
from kernels._pallas import pl
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["resolve_config", "backward_config", "check", "Schedule", "schedule_of",
           "sums_in_program", "num_partials", "reduction_traffic"]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_MAX_TILE = 4096  # elements per tile (per input): what 4-8 warps hold in registers comfortably.
# A whole row up to this long is one chunk for 16-bit and float32 data, held by 16 warps, so
# the backward reads x and dy once (no `_sums_kernel` pass). Compiled for sm_90 at 4096x8192:
# the backward takes 110 (bfloat16) and 120-128 (float32) of the 128 registers a thread has at 16
# warps, without spills; rows of 16384 in one chunk spilled 260 and 576 bytes. Longer rows
# are chunks of this many elements.
_MAX_ROW = 8192
# The backward's chunks of a row that one chunk would hold: at most this many elements, so a
# row of up to twice that is two chunks (`backward_config`). In one chunk a 16-warp program of
# the bfloat16 4096x8192 backward took 123 registers (sm_90 and sm_80), one CTA an SM: its next
# row's loads wait for this row's reductions and stores, so the SM's memory idles while it
# computes (the Triton forward, 62 registers, runs two). In two chunks of 4096, on 8 warps, it
# took 124 registers on sm_90 and 105 on sm_80, no spills, two CTAs an SM: one loads while the
# other computes, as in the forward (16 warps spilled 8 bytes on sm_80). Each program reads
# its row's other chunk for the sums (`sums_in_program`, mostly from L2), and the partial rows
# of dscale/doffset halve (one chunk a program).
_BACKWARD_MAX_CHUNK = 4096
# Groups of up to this many chunks get their per-group sums inside the backward's programs
# (`sums_in_program`), which re-read the group's other chunk in half-chunk tiles: rows up to
# 16384 in one pass. Compiled at 4096x16384 and 4096x12000 (sm_90 and sm_80): bfloat16 up to
# 127 registers, float32 128, no spills (float32 with a residual: `_chunked_float32_residual`).
_MAX_REREAD_CHUNKS = 2
# Normalize's override of the fast interpreter's tile budget (`_blocks.INTERPRETED_TILE`): its
# Triton tiles are XLA gathers there, and a gather of more elements at once runs slower per
# element on a CPU (measured: a 20000x64 standardization 7x faster in (4096, 64) tiles than in
# one).
_INTERPRETED_TILE = INTERPRETED_TILE // 16


def _or(value, default):
    return default if value is None else value


def resolve_config(p: Problem, config: NormalizeConfig | None) -> NormalizeConfig:
    """Power-of-2 tiles of at most _MAX_TILE elements (half that for float64).

    Rows: the whole group in one chunk when it fits (a single row of up to _MAX_ROW elements
    for 16-bit and float32 data, on 16 warps; longer rows in chunks of that size, or of
    _MAX_TILE for float32 with a residual), then as many groups as fit. Columns: 32 groups (a
    128-byte contiguous run per reduced element, coalesced) then as many reduced elements as
    fit. `num_partials` stays None unless given: `num_partials()` picks it.
    """
    config = config or NormalizeConfig()
    max_tile = tile_limit(_MAX_TILE, _INTERPRETED_TILE) // (
        2 if jnp.dtype(p.dtype).itemsize == 8 else 1)
    if p.rows:
        whole_row = next_power_of_2(p.reduced)
        row_limit = tile_limit(_MAX_ROW, _INTERPRETED_TILE)
        if jnp.dtype(p.dtype).itemsize == 8 or _chunked_float32_residual(p):
            row_limit = max_tile
        block_reduced = _or(config.block_reduced, min(whole_row, row_limit))
        block_groups = _or(config.block_groups, min(
            next_power_of_2(p.groups), max(1, max_tile // max(1, block_reduced))))
    else:
        block_groups = _or(config.block_groups, min(next_power_of_2(p.groups),
                                                    tile_limit(32, _INTERPRETED_TILE)))
        block_reduced = _or(config.block_reduced, min(
            next_power_of_2(p.reduced), max(1, max_tile // max(1, block_groups))))
    tile = block_groups * block_reduced if is_power_of_2(block_groups * block_reduced) else 0
    num_warps = _or(config.num_warps, 16 if tile >= 8192 else 8 if tile >= 4096
                    else 4 if tile >= 1024 else 1)
    return NormalizeConfig(block_groups, block_reduced, config.num_partials, num_warps,
                           _or(config.num_stages, 2))


def backward_config(p: Problem, config: NormalizeConfig | None) -> NormalizeConfig:
    """The backward's config: `resolve_config`'s, but a row of more than
    `_BACKWARD_MAX_CHUNK` elements that it holds in one chunk is two chunks (on the warps
    `resolve_config` gives such a tile), unless the caller chose `block_reduced`."""
    resolved = resolve_config(p, config)
    whole = p.rows and resolved.block_groups == 1 and resolved.block_reduced >= p.reduced
    if (config is not None and config.block_reduced is not None) or not whole or (
            resolved.block_reduced <= _BACKWARD_MAX_CHUNK):
        return resolved
    halved = dataclasses.replace(config or NormalizeConfig(),
                                 block_reduced=resolved.block_reduced // 2)
    return resolve_config(p, halved)


def _chunked_float32_residual(p: Problem) -> bool:
    """A float32 row longer than _MAX_ROW with a residual: its backward's 8192-element chunk
    also adds the sum's cotangent tile, and spilled 4-36 bytes (sm_90, sm_80) whether it
    re-read the other chunk or took the sums pass's, so its chunks are _MAX_TILE."""
    return p.has_residual and jnp.dtype(p.dtype) == jnp.float32 and p.reduced > _MAX_ROW


def check(p: Problem, config: NormalizeConfig | None) -> None:
    """Declines dtypes other than float16/bfloat16/float32/float64; rejects a config Triton
    cannot compile."""
    common.check_dtype(p, _DTYPES)
    if p.size == 0:
        return  # nothing to launch: the wrapper returns the empty result itself
    config = resolve_config(p, config)
    check_triton_config(config, ("block_reduced", "block_groups"), min_block=1)
    if config.num_partials is not None and not is_positive_int(config.num_partials):
        raise ValueError(f"config.num_partials must be a positive int, got "
                         f"{config.num_partials!r}")


class Schedule(NamedTuple):
    """How a problem's tiles become programs (see "Programs vs the GPU" above)."""

    num_blocks: int  # group blocks per slab
    num_chunks: int  # chunks per group
    splits: int  # reduction programs per group block; 1 = the forward runs fused
    per_split: int  # chunks each reduction program folds (the last split may have fewer)


def schedule_of(p: Problem, config: NormalizeConfig) -> Schedule:
    """Splits only when the group blocks would not give every SM one program: a fused pass
    reads x once from HBM, the two phases twice, so one wave of fused programs wins."""
    num_blocks = pl.cdiv(p.groups, config.block_groups)
    num_chunks = pl.cdiv(p.reduced, config.block_reduced)
    split = split_reduction(p.outer * num_blocks, num_chunks)
    return Schedule(num_blocks, num_chunks, split.splits, split.per_split)


def sums_in_program(schedule: Schedule) -> bool:
    """Whether the backward's programs compute a group's two sums themselves (one chunk, or up
    to _MAX_REREAD_CHUNKS re-read), or take them from a `_sums_kernel` pass. A program reading
    the other chunk of a group finds it mostly in L2: the backward's grid puts the chunk first,
    so the programs of a block's chunks run side by side and each reads the chunk the other is
    reading (an estimate; not measured on a GPU). x and dy then come from HBM once, where the
    sums pass reads them a second time."""
    return schedule.num_chunks <= _MAX_REREAD_CHUNKS


def num_partials(p: Problem, config: NormalizeConfig, schedule: Schedule) -> int:
    """Backward programs per slab and chunk (= partial dscale/doffset rows per slab): enough
    for two waves with the slabs and chunks, or `config.num_partials`, at most one per block."""
    wanted = pl.cdiv(_targets.current("gpu").min_programs, p.outer * schedule.num_chunks)
    return min(schedule.num_blocks, _or(config.num_partials, wanted))


def reduction_traffic(p: Problem, arrays: int, flops_per_element: int, schedule: Schedule):
    """(flops, bytes) of a reduction pass: `arrays` view-sized reads and two per-split
    outputs."""
    item, stat = jnp.dtype(p.dtype).itemsize, jnp.dtype(p.stat_dtype).itemsize
    return (flops_per_element * p.size,
            arrays * p.size * item + 2 * p.outer * p.groups * schedule.splits * stat)
