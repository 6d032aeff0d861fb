"""normalize's forward as a Pallas kernel lowered through Mosaic GPU (sm_90a, sm_100a): the
rows layout, each row whole in registers.

Block schedule
--------------
The view `(outer, groups, reduced)` is taken as `rows = outer * groups` rows of `reduced`
elements. Grid `(ceil(rows / block_rows),)`, one CTA (one warpgroup, 128 threads) per block of
`block_rows` rows (`config.block_groups`, `config.resolve_config`). A CTA loads its block of x
(and of residual) from GMEM straight into registers (`_pallas.mosaic_gpu.row_layout`: the 4
warps along the row, each warp's 32 lanes in vectors of 16 bytes of the wider of x's and y's
dtypes), so x is read once and y
written once; no shared memory but the 2 KiB Pallas reserves for the cross-warp reductions of
the statistics. The last CTA of a ragged grid runs the same body traced for its
`rows % block_rows` rows (Mosaic GPU's loads take no mask).

One CTA computes, in float32: the sum x + residual (written rounded to x's dtype), the mean
(RMS: none), the mean squared deviation, 1/std = rsqrt(var + epsilon), and
y = (x - mean) * 1/std * scale + offset, written in y's dtype; mean and 1/std are written per
row (float32). Traffic: x (and residual) read once, y (and the sum) written once, scale and
offset read once per CTA, 8 bytes of statistics per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import (load, mosaic_gpu_call, per_column, per_row, row_layout,
                                        store)
from kernels.normalize.common import NormalizeConfig, Problem
from kernels.normalize.mosaic_gpu.config import resolve_config

__all__ = ["forward"]


def _normalize_block(refs: dict, first, count: int, p: Problem) -> None:
    """Rows [first, first + count) of the block: the body of one CTA."""
    row = p.reduced
    rows, shape = pl.ds(first, count), (count, row)
    # One layout for every block of the CTA, so no value changes registers: its vectors are
    # 16 bytes of the widest of x and y (bfloat16 x, float32 y: 4 elements).
    layout = row_layout(count, row, max(jnp.dtype(p.dtype).itemsize, p.y_dtype.itemsize))
    x = load(refs["x"].at[rows], layout).astype(jnp.float32)
    if "residual" in refs:
        x = x + load(refs["residual"].at[rows], layout).astype(jnp.float32)
        refs["sum"][rows] = x.astype(refs["sum"].dtype)

    if p.subtract_mean:
        mean = jnp.mean(x, axis=1)
        store(refs["mean"].at[rows], mean)
        x = x - per_row(mean, shape)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1) + p.epsilon)
    store(refs["rstd"].at[rows], rstd)
    y = x * per_row(rstd, shape)
    if "scale" in refs:
        y = y * per_column(load(refs["scale"]), shape)
    if "offset" in refs:
        y = y + per_column(load(refs["offset"]), shape)
    refs["y"][rows] = y.astype(refs["y"].dtype)


def forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
            offset: jax.Array | None, p: Problem, *, config: NormalizeConfig | None,
            interpret: bool | str):
    """(y, x + residual or None, mean, rstd) for the view-shaped `x` (and `residual`) of a
    problem that `check` accepted."""
    block_rows = resolve_config(p, config).block_groups
    num_rows, row = p.outer * p.groups, p.reduced
    block_rows = min(block_rows, num_rows)
    inputs = {"x": x.reshape(num_rows, row)}
    if residual is not None:
        inputs["residual"] = residual.reshape(num_rows, row)
    for name, param in (("scale", scale), ("offset", offset)):
        if param is not None:
            inputs[name] = param.reshape(row).astype(jnp.float32)
    outputs = {"y": jax.ShapeDtypeStruct((num_rows, row), p.y_dtype)}
    if residual is not None:
        outputs["sum"] = jax.ShapeDtypeStruct((num_rows, row), p.dtype)
    if p.subtract_mean:
        outputs["mean"] = jax.ShapeDtypeStruct((num_rows,), jnp.float32)
    outputs["rstd"] = jax.ShapeDtypeStruct((num_rows,), jnp.float32)
    num_blocks, tail = pl.cdiv(num_rows, block_rows), num_rows % block_rows

    def body(*refs):
        named = dict(zip([*inputs, *outputs], refs))
        block = jax.lax.axis_index("rows")
        if not tail:
            _normalize_block(named, block * block_rows, block_rows, p)
            return

        @pl.when(block < num_blocks - 1)
        def _():
            _normalize_block(named, block * block_rows, block_rows, p)

        @pl.when(block == num_blocks - 1)
        def _():
            _normalize_block(named, (num_blocks - 1) * block_rows, tail, p)

    results = dict(zip(outputs, mosaic_gpu_call(
        body, out_shape=list(outputs.values()), grid=(num_blocks,), grid_names=("rows",),
        interpret=interpret, name="normalize_forward_mosaic_gpu")(*inputs.values())))
    mean = results.get("mean")
    if mean is None:  # RMS: no mean subtracted
        mean = jnp.zeros((num_rows,), jnp.float32)
    summed = results.get("sum")
    return (results["y"].reshape(p.view_shape),
            None if summed is None else summed.reshape(p.view_shape),
            mean.reshape(p.stats_shape), results["rstd"].reshape(p.stats_shape))
