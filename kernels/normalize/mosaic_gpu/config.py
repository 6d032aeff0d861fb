"""How the Mosaic GPU normalize kernels' blocks are sized (the kernels are in `forward.py` and
`backward.py`): the config (`resolve_config`), the plan of one call (`plan_of`: rows per block,
pieces, whether CTAs walk blocks held whole in shared memory, what else they stage, CTAs) and
the checks that decline a problem or reject a config (`check`)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import is_positive_int
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (PIECE, TMA_MAX_BOX, aligned_columns, ctas_per_sm,
                                        smem_budget)
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["Plan", "plan_of", "resolve_config", "check"]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Rows per block at most, a config's too: a pass carries float32 accumulators of (rows, PIECE),
# 2 values a thread per row each. 16 rows took up to 186 registers, no spills (the backward of
# 32x56x56x256 bfloat16 over axes (0, 1, 2), sm_90a, jax 0.12.0.1); twice that would spill.
_MAX_BLOCK_ROWS = 16
# Bytes of input rows a block is sized to (rows up to `_MAX_BLOCK_ROWS`): of whole rows where a
# CTA walks blocks (`Plan.resident`), copied while it computes on the block before
# (`BlockBuffers`); of one piece where rows stream. With one CTA per SM, each SM then has one
# to two blocks in flight, over the ~20 KiB an H100 SM needs to cover HBM's latency at full
# bandwidth (3.35 TB/s x ~800 ns over 132 SMs; an estimate, not measured).
_IN_FLIGHT_BYTES = 32 * 1024
# Rows of a piece one loop step computes (`Plan.unroll`): 8 rows give each thread 16 values
# per input, against 2 for a one-row block's piece. The backward of bfloat16 4096x8192 (sm_90a,
# jax 0.12.0.1) compiled its two pass loops to 164 and 277 PTX instructions a step of 8
# one-row pieces, no barriers (`auto_barriers=False`; Pallas' own put 48 in the second):
# about 1,800 a thread per row, some 1 µs of a warp scheduler's issue at 1.98 GHz, under the
# ~2.5 µs an SM's share of the bandwidth (`_targets.STREAMING_SHARE`) takes to move the row's
# 48 KiB, so one warpgroup an SM keeps up with its memory (an estimate, not measured).
_STEP_ROWS = 8


class Plan(NamedTuple):
    """One call of a Mosaic GPU normalize kernel on the rows view: `rows` rows of `reduced`
    elements (`aligned` in GMEM, padded to TMA's 16 bytes where `reduced` is not), in blocks
    of `block_rows`, each row `num_pieces` pieces of `PIECE` columns, over `programs` CTAs.
    `resident`: each CTA (one per SM) walks blocks, holding two whole blocks of the inputs in
    shared memory and computing on one while TMA fills the other with its next
    (`BlockBuffers`); else each CTA streams its block's pieces again in each pass
    (`StreamedRows`). The forward's `staged`: its outputs are staged whole and stored once a
    block, and scale/offset staged once a CTA (else the outputs leave through 2-slot rings and
    scale/offset are read from GMEM per piece). The backward's `accumulate`: its CTAs sum their
    blocks' dscale/doffset terms over the rows in shared memory, one partial row each (else
    each block writes its own); its programs are one per SM, or `config.num_partials`."""

    rows: int
    reduced: int
    aligned: int
    block_rows: int
    num_pieces: int
    resident: bool
    programs: int
    accumulate: bool = False
    staged: bool = False
    shared_bytes: int = 0  # the planned buffers of one CTA
    in_flight: int = 0  # bytes of input rows one CTA's copies have in flight at once

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM of the program's GPU runs at once: by their shared memory (with
        `PALLAS_SMEM`) and threads (registers: the compile report's `ctas_per_sm`), and by the
        grid."""
        return min(ctas_per_sm(self.shared_bytes),
                   pl.cdiv(self.programs, _targets.current("gpu").num_sms))

    @property
    def in_flight_per_sm(self) -> int:
        """Bytes of input rows an SM's CTAs have in flight when each has issued its copies:
        a walking CTA (`resident`) the next block as it starts computing on one, a streamed
        CTA the next piece."""
        return self.ctas_per_sm * self.in_flight

    @property
    def num_blocks(self) -> int:
        return pl.cdiv(self.rows, self.block_rows)

    @property
    def width(self) -> int:
        """Columns a block's pieces span (padded: TMA zero-fills them on loads)."""
        return self.num_pieces * PIECE

    @property
    def unroll(self) -> int:
        """Pieces one loop step computes: about `_STEP_ROWS` rows of a piece at once, so each
        thread has independent values to hide its shared-memory loads' latency (a power of 2
        that divides the row's pieces)."""
        unroll = 1
        while (2 * unroll * self.block_rows <= _STEP_ROWS
               and self.num_pieces % (2 * unroll) == 0):
            unroll *= 2
        return unroll


def _aligned(p: Problem) -> int:
    return aligned_columns(p.reduced, min(jnp.dtype(p.dtype).itemsize, p.y_dtype.itemsize))


def plan_of(p: Problem, config: NormalizeConfig | None, backward: bool = False,
            has_gsum: bool = False) -> Plan:
    """The plan of the forward (or the `backward`, `has_gsum`: it reads the sum's cotangent)
    for a problem `check` accepted: `_forward_plan` or `_backward_plan`."""
    config = config or NormalizeConfig()
    rows, n = max(p.outer * p.groups, 1), max(p.reduced, 1)  # size zero: planned, never run
    num_pieces = pl.cdiv(n, PIECE)
    may_stay = n <= (config.block_reduced or n)
    rows_view = (rows, n, _aligned(p))  # a Plan's first fields
    if backward:
        return _backward_plan(p, config, has_gsum, rows_view, num_pieces, may_stay)
    return _forward_plan(p, config, rows_view, num_pieces, may_stay)


def _fitting_rows(config: NormalizeConfig, wanted: int, rows: int, smem, budget: int) -> int:
    """`config.block_groups`, else `wanted` rows (at most `_MAX_BLOCK_ROWS`, the problem's),
    fewer while `smem(block_rows)` is over `budget`; 0 where the caller's rows or one row do
    not fit."""
    block_rows = min(config.block_groups or max(1, min(_MAX_BLOCK_ROWS, wanted)), rows)
    while not config.block_groups and block_rows > 1 and smem(block_rows) > budget:
        block_rows -= 1
    return block_rows if smem(block_rows) <= budget else 0


def _forward_plan(p: Problem, config: NormalizeConfig, rows_view: tuple[int, int, int],
                  num_pieces: int, may_stay: bool) -> Plan:
    """Blocks of `config.block_groups` rows, else of `_IN_FLIGHT_BYTES` of input rows.
    Preferred first: one CTA per SM walking blocks, two whole blocks of the inputs in shared
    memory (`Plan.resident`; not where a row is longer than `config.block_reduced`), y (and
    the sum) staged whole and scale/offset staged once (`Plan.staged`); then the outputs
    through rings and scale/offset from GMEM. Else one block per CTA, its pieces streamed in
    each pass, two CTAs an SM (half its shared memory each)."""
    rows, item = rows_view[0], jnp.dtype(p.dtype).itemsize
    input_bytes = item * (1 + p.has_residual)
    output_bytes = p.y_dtype.itemsize + item * p.has_residual  # y, and the sum in x's dtype
    width = num_pieces * PIECE
    params = 4 * width * (p.has_scale + p.has_offset)
    rings = 2 * PIECE * output_bytes
    for resident, staged in ((True, True), (True, False), (False, False)):
        # Staged rows move as one TMA copy of (num_pieces, PIECE): two blocks that fit already
        # hold fewer pieces than that, but the copy's rule is stated where it applies.
        if resident and not may_stay or staged and num_pieces > TMA_MAX_BOX:
            continue
        held = 2 * (width if resident else PIECE) * input_bytes  # two blocks, or a 2-piece ring
        wanted = pl.cdiv(_IN_FLIGHT_BYTES, held // 2)
        outputs = width * output_bytes if staged else rings
        budget = smem_budget(whole=resident or bool(config.block_groups))
        block_rows = _fitting_rows(config, wanted, rows,
                                   lambda r: r * (held + outputs) + staged * params, budget)
        if block_rows:
            break
    else:
        raise ValueError(f"config.block_groups={config.block_groups}: blocks of that many rows "
                         f"of {p.reduced} are over the {budget} bytes of shared memory a CTA "
                         f"plans")
    num_blocks = pl.cdiv(rows, block_rows)
    programs = min(num_blocks, _targets.current("gpu").num_sms) if resident else num_blocks
    return Plan(*rows_view, block_rows, num_pieces, resident, programs, staged=staged,
                shared_bytes=block_rows * (held + outputs) + staged * params,
                in_flight=block_rows * held // 2)


def _backward_plan(p: Problem, config: NormalizeConfig, has_gsum: bool,
                   rows_view: tuple[int, int, int], num_pieces: int, may_stay: bool) -> Plan:
    """One CTA per SM (all its shared memory) walking blocks of `config.block_groups` rows,
    else of `_IN_FLIGHT_BYTES` of input rows. Preferred first: two whole blocks in shared
    memory (`Plan.resident`; not where a row is longer than `config.block_reduced`); dx staged
    whole; scale staged once; and the dscale/doffset terms summed over the CTA's rows in
    shared memory (`Plan.accumulate`). Else blocks stream their pieces through 2-slot rings,
    and where the summed terms do not fit, each block writes its own."""
    rows, item = rows_view[0], jnp.dtype(p.dtype).itemsize
    input_bytes = item * (1 + has_gsum) + p.y_dtype.itemsize  # x, dsum in x's dtype; dy in y's
    width, budget = num_pieces * PIECE, smem_budget(whole=True)
    params = 4 * width * p.has_scale
    terms = 4 * width * (p.has_scale + p.has_offset)
    # A summed row (and scale) moves as one TMA copy of (num_pieces, PIECE).
    sums = num_pieces <= TMA_MAX_BOX
    for resident, accumulate in ((True, True), (False, True), (False, False)):
        if resident and not may_stay or accumulate and not sums:
            continue

        def smem(block_rows, resident=resident, accumulate=accumulate):
            if resident:  # two blocks of inputs and dx's whole block
                held = block_rows * width * (2 * input_bytes + item)
            else:  # 2-slot rings of each input and of dx
                held = block_rows * 2 * PIECE * (input_bytes + item)
            return held + accumulate * (params + terms)  # scale staged beside the terms

        wanted = pl.cdiv(_IN_FLIGHT_BYTES, (width if resident else PIECE) * input_bytes)
        block_rows = _fitting_rows(config, wanted, rows, smem, budget)
        if block_rows:
            break
    else:
        raise ValueError(f"config.block_groups={config.block_groups}: the backward's blocks of "
                         f"that many rows of {p.reduced} are over the {budget} bytes of shared "
                         f"memory a CTA plans")
    num_blocks = pl.cdiv(rows, block_rows)
    wanted = config.num_partials or _targets.current("gpu").num_sms
    programs = num_blocks if terms and not accumulate else min(num_blocks, wanted)
    in_flight = block_rows * (width if resident else PIECE) * input_bytes
    return Plan(*rows_view, block_rows, num_pieces, resident, programs,
                accumulate and terms > 0, shared_bytes=smem(block_rows), in_flight=in_flight)


def resolve_config(p: Problem, config: NormalizeConfig | None) -> NormalizeConfig:
    """`config` with its Mosaic GPU fields filled from the forward's plan (`plan_of`):
    `block_groups` its rows per CTA, `block_reduced` the columns of a row it holds in shared
    memory (the row, or one piece where it streams). What the defaults chose, not a config to
    pass back: a caller's `block_groups` plans all of a CTA's shared memory, and the backward
    plans its own rows."""
    plan = plan_of(p, config)
    return NormalizeConfig(block_groups=plan.block_rows,
                           block_reduced=p.reduced if plan.resident else PIECE)


def check(p: Problem, config: NormalizeConfig | None) -> None:
    """Declines float64 (and other dtypes Mosaic GPU's kernels do not take); rejects a config
    it cannot run."""
    common.check_dtype(p, _DTYPES, device="Mosaic GPU")
    config = config or NormalizeConfig()
    if config.block_groups is not None and not (is_positive_int(config.block_groups)
                                                and config.block_groups <= _MAX_BLOCK_ROWS):
        raise ValueError(f"config.block_groups must be an int in [1, {_MAX_BLOCK_ROWS}] (the "
                         f"rows a CTA's registers hold without spills), got "
                         f"{config.block_groups!r}")
    for field in ("block_reduced", "num_partials"):
        value = getattr(config, field)
        if value is not None and not is_positive_int(value):
            raise ValueError(f"config.{field} must be a positive int, got {value!r}")
    plan_of(p, config)
    plan_of(p, config, backward=True, has_gsum=p.has_residual)
