"""How the Mosaic GPU normalize kernels' blocks are sized (the kernels are in `forward.py` and
`backward.py`):
the config (`resolve_config`) and the checks that decline a problem or reject a config
(`check`)."""

from __future__ import annotations

import jax.numpy as jnp

from kernels._blocks import is_positive_int
from kernels.normalize import common
from kernels.normalize.common import NormalizeConfig, Problem

__all__ = ["resolve_config", "check"]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# The longest row one CTA holds in registers. Compiled for sm_90a (ptxas, jax 0.12.0.1): a row
# of 4096 with the 4 warps along it takes 118 registers in float32 and 110 in bfloat16, no
# spills; 8 rows of 4096 at once spilled 540-612 bytes. The backward's one row of 4096 (x, dy
# and two accumulators) takes 234 registers in bfloat16 and 228 in float32 with a residual, no
# spills. Longer rows need the shared-memory path, not written yet.
_MAX_ROW = 4096
# Values of x one thread holds: rows per CTA are chosen so that a thread holds about this many
# (4 rows of 1024: 64-70 registers; 1 row of 4096: 110-118).
_VALUES_PER_THREAD = 32
# The backward holds x, dy and two column-sum accumulators per value: half as many (2 rows of
# 1024 in bfloat16 with a residual: 135 registers, sm_90a; 4 rows took 238).
_BACKWARD_VALUES_PER_THREAD = 16
_THREADS = 128  # one warpgroup
_MAX_BLOCK_ROWS = 16
# The most elements of x one CTA holds (a config's block_groups x row): 4 rows of 4096 took
# 229-239 registers without spills (sm_90a, ptxas); 8 rows of 4096 spilled 540-612 bytes.
_MAX_BLOCK_ELEMENTS = 4 * 4096


def resolve_config(p: Problem, config: NormalizeConfig | None,
                   backward: bool = False) -> NormalizeConfig:
    """`config` with its Mosaic GPU fields filled: `block_groups` rows per CTA (by default
    the most, up to 16, at `_VALUES_PER_THREAD` values of x per thread, or
    `_BACKWARD_VALUES_PER_THREAD` in the `backward`), `block_reduced` the whole row."""
    config = config or NormalizeConfig()
    values = _BACKWARD_VALUES_PER_THREAD if backward else _VALUES_PER_THREAD
    default = max(1, min(_MAX_BLOCK_ROWS, values * _THREADS // max(p.reduced, 1)))
    return NormalizeConfig(block_groups=config.block_groups or default,
                           block_reduced=p.reduced)


def check(p: Problem, config: NormalizeConfig | None) -> None:
    """Declines what the kernel does not take yet (the columns layout, rows that are not a
    multiple of 128 or longer than `_MAX_ROW`, float64); rejects a config it cannot run."""
    common.check_dtype(p, _DTYPES, device="Mosaic GPU")
    if not p.rows:
        raise NotImplementedError("the columns layout (normalized axes followed by others) has "
                                  "no Mosaic GPU kernel yet")
    if p.reduced % _THREADS or p.reduced > _MAX_ROW:
        raise NotImplementedError(f"rows of {p.reduced} elements: the Mosaic GPU kernel takes "
                                  f"multiples of {_THREADS} up to {_MAX_ROW} so far")
    config = config or NormalizeConfig()
    if config.block_groups is not None and not is_positive_int(config.block_groups):
        raise ValueError(f"config.block_groups must be a positive int, got "
                         f"{config.block_groups!r}")
    if (config.block_groups or 1) * p.reduced > _MAX_BLOCK_ELEMENTS:
        raise ValueError(f"config.block_groups={config.block_groups} rows of {p.reduced} are "
                         f"over the {_MAX_BLOCK_ELEMENTS} elements a CTA holds in registers")
    if config.block_reduced not in (None, p.reduced):
        raise ValueError(f"config.block_reduced: the Mosaic GPU kernel holds whole rows "
                         f"({p.reduced}), got {config.block_reduced!r}")
