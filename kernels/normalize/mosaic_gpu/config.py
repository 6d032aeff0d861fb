"""How the Mosaic GPU normalize kernels' blocks are sized (the kernels are in `forward.py` and
`backward.py`): the config (`resolve_config`), the plan of one call (`plan_of`: rows per CTA,
pieces, whether a block stays in shared memory, CTAs) and the checks that decline a problem or
reject a config (`check`)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import is_positive_int
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import PIECE, aligned_columns, smem_budget
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["Plan", "plan_of", "resolve_config", "check"]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Bytes of input rows one CTA moves per block: two CTAs per SM keep up to 128 KiB in flight,
# well over the ~20 KiB an H100 SM needs to cover HBM's latency at full bandwidth (3.35 TB/s x
# ~800 ns over 132 SMs; an estimate, not measured), while a CTA computes on one block and its
# neighbour waits on the next. Fewer, larger blocks also run faster in Mosaic GPU's interpreter,
# whose cost is per operation: 33 CTAs of 4 rows of 4096 float32 took about half the time of
# 66 CTAs of 2 (this CPU, jax 0.12.0.1).
_BLOCK_BYTES = 64 * 1024
# Rows per CTA at most, a config's too: a pass carries float32 accumulators of (rows, PIECE),
# 2 values a thread per row each. 16 rows took up to 127 registers, no spills (the forward of
# 129x1000 bfloat16, sm_90a, jax 0.12.0.1); twice that would spill.
_MAX_BLOCK_ROWS = 16
# A resident block has one barrier per piece, and Mosaic GPU takes at most 32 barriers in one
# allocation ("Only up to 32 barriers per group supported", compiling a 16384-column float32
# row for sm_90a, jax 0.12.0.1): rows of more pieces are streamed.
_MAX_RESIDENT_PIECES = 32


class Plan(NamedTuple):
    """One call of a Mosaic GPU normalize kernel on the rows view: `rows` rows of `reduced`
    elements (`aligned` in GMEM, padded to TMA's 16 bytes where `reduced` is not), in blocks
    of `block_rows`, each row `num_pieces` pieces of `PIECE` columns. `resident`: a block's
    pieces stay in shared memory for every pass (else each pass streams them again).
    `programs`: CTAs; the backward's walk the blocks and `accumulate` their dscale/doffset
    terms in shared memory (else each CTA writes its block's terms as partial rows): two waves
    of the target's SMs, or `config.num_partials`."""

    rows: int
    reduced: int
    aligned: int
    block_rows: int
    num_pieces: int
    resident: bool
    programs: int
    accumulate: bool = False

    @property
    def num_blocks(self) -> int:
        return pl.cdiv(self.rows, self.block_rows)

    @property
    def width(self) -> int:
        """Columns a block's pieces span (padded: TMA zero-fills them on loads)."""
        return self.num_pieces * PIECE

    @property
    def slots(self) -> int:
        return self.num_pieces if self.resident else 2


def _aligned(p: Problem) -> int:
    return aligned_columns(p.reduced, min(jnp.dtype(p.dtype).itemsize, p.y_dtype.itemsize))


def plan_of(p: Problem, config: NormalizeConfig | None, backward: bool = False,
            has_gsum: bool = False) -> Plan:
    """The plan of the forward (or the `backward`, `has_gsum`: it reads the sum's cotangent)
    for a problem `check` accepted. Preferred first: the block resident in shared memory (read
    from GMEM once; not where the row is longer than `config.block_reduced` or than
    `_MAX_RESIDENT_PIECES`), and the backward's dscale/doffset terms summed in the CTA. Rows
    per CTA: `config.block_groups`, else `_BLOCK_BYTES` of what the CTA holds of its input rows
    (at most `_MAX_BLOCK_ROWS`), fewer where the shared memory budget asks."""
    config = config or NormalizeConfig()
    rows, n = max(p.outer * p.groups, 1), max(p.reduced, 1)  # size zero: planned, never run
    num_pieces = pl.cdiv(n, PIECE)
    item = jnp.dtype(p.dtype).itemsize
    if backward:  # x and the sum's cotangent in x's dtype, dy in y's
        input_bytes = item * (1 + has_gsum) + p.y_dtype.itemsize
        accumulator_bytes = 4 * (p.has_scale + p.has_offset)
    else:
        input_bytes = item * (1 + p.has_residual)
        accumulator_bytes = 0
    width, budget = num_pieces * PIECE, smem_budget(whole=bool(config.block_groups))
    may_stay = n <= (config.block_reduced or n) and num_pieces <= _MAX_RESIDENT_PIECES

    def smem(block_rows, resident, accumulate):
        """Bytes of the staged inputs, the output rings and the summed terms."""
        inputs = width if resident else 2 * PIECE
        rings = 2 * PIECE * (item if backward else p.y_dtype.itemsize + item * p.has_residual)
        return block_rows * (inputs * input_bytes + rings
                             + accumulate * width * accumulator_bytes)

    accumulates = bool(accumulator_bytes)
    for resident, accumulate in ((True, accumulates), (False, accumulates), (True, False),
                                 (False, False)):
        if resident and not may_stay:
            continue
        held = (width if resident else 2 * PIECE) * input_bytes
        block_rows = min(config.block_groups or max(
            1, min(_MAX_BLOCK_ROWS, _BLOCK_BYTES // held)), rows)
        while not config.block_groups and block_rows > 1 and (
                smem(block_rows, resident, accumulate) > budget):
            block_rows -= 1
        if smem(block_rows, resident, accumulate) <= budget:
            break
    else:
        raise ValueError(f"config.block_groups={block_rows}: blocks of {block_rows} rows of "
                         f"{n} are over the {budget} bytes of shared memory a CTA plans")
    num_blocks = pl.cdiv(rows, block_rows)
    wanted = config.num_partials or _targets.current("gpu").min_programs
    programs = min(num_blocks, wanted) if accumulate else num_blocks
    return Plan(rows, n, _aligned(p), block_rows, num_pieces, resident, programs, accumulate)


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
