"""How the Mosaic GPU gather and scatter-add kernels' blocks are sized (the kernels are in
`forward.py` and `backward.py` beside it): the plan of one call (`plan_of`: rows per tile,
slots in flight, pieces, CTAs), the config it fills (`resolve_config`) and the checks that
decline a problem or reject a config (`check`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from kernels._blocks import is_positive_int
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import PIECE, aligned_columns, smem_budget
from kernels.gather.common import GatherConfig, Problem

__all__ = ["Plan", "plan_of", "resolve_config", "check"]

# A TMA copy moves at most 256 elements along a dimension: a tile's rows, stored by one copy.
_MAX_TILE_ROWS = 256
# Bytes of one forward tile (its rows' piece): a slot of the ring. A CTA keeps up to
# `_FORWARD_SLOTS - 1` tiles loading while it stores one, 48 KiB in flight; several CTAs share
# an SM (64 KiB each at most), well over the ~20 KiB an H100 SM needs in flight to cover
# HBM's latency at full bandwidth (3.35 TB/s x ~800 ns over 132 SMs; an estimate, not
# measured).
_TILE_BYTES = 16 * 1024
_FORWARD_SLOTS = 4
# The backward's cotangent row pieces in flight per CTA (a slot and a barrier each): 16 x 512
# bytes of bfloat16 per CTA, and an SM holds up to 16 of its CTAs (128 threads each).
_RING_ROWS = 16
# Table rows one backward CTA owns: its (rows, PIECE) gradient tile, stored by one TMA copy.
_BLOCK_ROWS = 32


class Plan(NamedTuple):
    """One call on the `(batch, n, columns)` view, its rows `aligned` in GMEM (padded to
    TMA's 16 bytes where `columns` is not), each row `num_pieces` pieces of `PIECE` columns.
    Forward: tiles of `tile_rows` gathered rows, `slots` of them in shared memory (a ring over
    the pieces). Backward: `tile_rows` table rows per CTA, `slots` cotangent rows in flight."""

    aligned: int
    num_pieces: int
    tile_rows: int
    slots: int
    blocks: int  # tiles per batch slice (forward: of indices; backward: of table rows)
    programs: int  # CTAs: one per batch slice and tile (backward: and piece)


def _tile_bytes(p: Problem) -> int:
    return PIECE * p.itemsize


def plan_of(p: Problem, config: GatherConfig | None, backward: bool = False) -> Plan:
    """The forward's plan (or the `backward`'s) for a problem `check` accepted: tiles of
    `config.block_indices` gathered rows (default `_TILE_BYTES` of them) with up to
    `_FORWARD_SLOTS` in shared memory; or `config.block_rows` table rows per backward CTA
    (default `_BLOCK_ROWS`) and `_RING_ROWS` cotangent rows in flight."""
    config = config or GatherConfig()
    aligned = aligned_columns(max(p.columns, 1), p.itemsize)
    num_pieces = pl.cdiv(aligned, PIECE)
    row_bytes = _tile_bytes(p)
    if backward:
        rows = config.block_rows or min(_BLOCK_ROWS, max(p.n, 1))
        blocks = pl.cdiv(max(p.n, 1), rows)
        return Plan(aligned, num_pieces, rows, _RING_ROWS, blocks, p.batch * blocks * num_pieces)
    rows = config.block_indices or min(_TILE_BYTES // row_bytes, max(p.num_indices, 1))
    fits = smem_budget(whole=config.block_indices is not None) // (rows * row_bytes)
    slots = min(_FORWARD_SLOTS, num_pieces, fits)
    blocks = pl.cdiv(max(p.num_indices, 1), rows)
    return Plan(aligned, num_pieces, rows, slots, blocks, p.batch * blocks)


def resolve_config(p: Problem, config: GatherConfig | None) -> GatherConfig:
    """`config` with the fields Mosaic GPU takes filled from the plans: `block_indices` the
    forward's rows per tile, `block_rows` the backward's table rows per CTA."""
    return dataclasses.replace(config or GatherConfig(),
                               block_indices=plan_of(p, config).tile_rows,
                               block_rows=plan_of(p, config, backward=True).tile_rows)


def check(p: Problem, config: GatherConfig | None) -> None:
    """Declines 64-bit tables; rejects tiles TMA cannot store in one copy, or that the
    target's shared memory does not hold."""
    if p.itemsize == 8:
        raise NotImplementedError(f"{jnp.dtype(p.dtype).name} tables are not supported on "
                                  "Mosaic GPU")
    if p.batch * p.num_indices * p.columns == 0:
        return  # an empty result: no kernel runs
    config = config or GatherConfig()
    for field in ("block_indices", "block_rows"):
        value = getattr(config, field)
        if value is not None and not (is_positive_int(value) and value <= _MAX_TILE_ROWS):
            raise ValueError(f"config.{field} must be an int in [1, {_MAX_TILE_ROWS}] (rows one "
                             f"TMA copy stores), got {value!r}")
    if plan_of(p, config).slots < 1:
        raise ValueError(f"config.block_indices={config.block_indices}: a tile of "
                         f"{config.block_indices} rows of {PIECE} {jnp.dtype(p.dtype).name} is "
                         f"over the {smem_budget(whole=True)} bytes of shared memory a CTA plans")
    backward = plan_of(p, config, backward=True)
    needed = (backward.tile_rows + backward.slots) * _tile_bytes(p)
    if needed > smem_budget(whole=True):
        raise ValueError(f"config.block_rows={config.block_rows}: {needed} bytes of shared "
                         f"memory, over the {smem_budget(whole=True)} a CTA plans")
