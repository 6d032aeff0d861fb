"""Mosaic GPU kernel calls (jax >= 0.12, `kernels.registry`'s `mosaic_gpu` entry): the launch
(`mosaic_gpu_call`), the register layout of a block of rows (`row_layout`), and plain GMEM
loads and stores. Imported only by Mosaic GPU kernels, which the registry imports only where
the installed jax has the backend.

One CTA is one warpgroup (4 warps of 32 threads) under Warpgroup lowering semantics: the kernel
body is array code for the whole warpgroup, and a grid point is a CTA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.mosaic.gpu import TiledLayout
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["WARPS", "LANES", "mosaic_gpu_call", "row_layout", "load", "store", "per_row",
           "per_column"]

WARPS, LANES = 4, 32  # one warpgroup per CTA


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


def mosaic_gpu_call(body: Callable[..., None], *, out_shape: Sequence[jax.ShapeDtypeStruct],
                    grid: tuple[int, ...], grid_names: tuple[str, ...], interpret: bool | str,
                    name: str) -> Callable[..., Any]:
    """`plgpu.kernel(body, ...)`, one warpgroup per CTA, launched as `name`. `interpret` (the
    dispatch's mode): False compiles; True and "strict" run Mosaic GPU's interpreter on the
    device's schedule, "strict" with its race detector (Pallas' HLO interpreter cannot run
    `plgpu.kernel`)."""
    params = (plgpu.InterpretGPUParams(detect_races=interpret == "strict") if interpret
              else None)
    body.__name__ = name  # the launch's name in jaxprs, HLO and the compile reports
    return plgpu.kernel(
        body, out_type=tuple(out_shape), grid=grid, grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=params)
