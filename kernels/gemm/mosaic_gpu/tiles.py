"""What the Mosaic GPU matmul kernels share (Hopper's wgmma kernel in `hopper.py`,
Blackwell's tcgen05 kernel in `blackwell.py`): A's rows read at shifted offsets (`Shifts`),
the shared-memory tiles TMA fills, a work item's operand views (`item_of`), and the epilogue
applied to a column slice of the accumulator and stored by TMA (`epilogue_slice`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels.matmul.common import Problem, batch_index
from kernels.gemm.mosaic_gpu.config import Plan

__all__ = ["Shifts", "Terms", "ONE_TERM", "Item", "item_of", "transforms", "operand_spec",
           "shifted_spec", "epilogue_slice", "epilogue_scratch"]


class Shifts(NamedTuple):
    """A's rows read at offsets (a multiple of `config.TMA_ROWS` each, a Python or traced
    int32 from `shift`): per K step (`per_step`, the forward of conv2d: K step k reads the rows
    of its output tile shifted by `shift(k // steps_per_shift)`, its columns block
    k % steps_per_shift of the view) or per output batch (the weight gradient: batch b's A is
    the matrix starting `shift(b)` rows down). `max_shift`: the largest, which the caller's
    array holds past the last tile.

    Rows past M (the forward) or K (the weight gradient) are then the matrix's next rows, not
    TMA's zeros: the caller cuts the output rows past M off, and its B is zero past K (so an
    Inf or NaN in those rows of A would make NaN there). Per-step shifts take one K split and
    A as stored (M, K)."""

    shift: Callable[[jax.Array], jax.Array]
    max_shift: int
    per_step: bool
    steps_per_shift: int = 1


class Terms(NamedTuple):
    """The products a Blackwell kernel sums per K slice: `pairs`, (part of A, part of B) per
    term (`config.split_terms`: float32 and mixed products as bfloat16 parts; one term, (0, 0),
    for any other). Each operand's parts lie side by side along K once (its hi and lo, or
    itself), in segments of `blocks` K slices: the product's K slice r is slice r % `blocks`
    of segment r // `blocks` (the matmul: one segment, all of K; conv2d's forward: a tap row's
    width, a segment a tap row), whose part i starts (segment * parts + i) * `blocks` slices
    into the operand (`a_block`, `b_block`). A part is zero past the product's K, so every
    slice of a segment is whole."""

    pairs: tuple[tuple[int, int], ...]
    blocks: int

    @property
    def a_parts(self) -> int:
        return 1 + max(i for i, _ in self.pairs)

    @property
    def b_parts(self) -> int:
        return 1 + max(j for _, j in self.pairs)

    def a_block(self, k, part: int):
        return self._block(k, part, self.a_parts)

    def b_block(self, k, part: int):
        return self._block(k, part, self.b_parts)

    def _block(self, k, part: int, parts: int):
        return (k // self.blocks * parts + part) * self.blocks + k % self.blocks


ONE_TERM = ((0, 0),)


class Item(NamedTuple):
    """One work item of a persistent CTA: output tile (m_tile, n_tile) of output batch
    `out_index` (split-major: split · num_batches + batch), and the GMEM views of A and B its
    K steps read (A: the tile's rows over the split's K range, or with per-step shifts the
    rows its shifts reach over all of K; over all of K too where `item_of` is given split
    parts' `Terms`), whose K slice `k_first` is the item's first."""

    batch: Any
    out_index: Any
    m_tile: Any
    n_tile: Any
    a: Any
    b: Any
    k_first: Any = 0


def item_of(index, a_gmem, b_gmem, p: Problem, plan: Plan, shifts: Shifts | None,
            terms: Terms | None = None) -> Item:
    """Work item `index` of (split, batch, tile), the tiles of a batch in planar-snake order
    (bands of `plan.group` row tiles, so consecutive CTAs share B's panels in L2)."""
    block_m, block_n, block_k = plan.block_m, plan.block_n, plan.block_k
    m_tiles, n_tiles = pl.cdiv(p.m, block_m), pl.cdiv(p.n, block_n)
    per_split = plan.k_blocks_per_split(p)
    out_index, tile = index // (m_tiles * n_tiles), index % (m_tiles * n_tiles)
    split, batch = out_index // p.num_batches, out_index % p.num_batches
    m_tile, n_tile = plgpu.planar_snake(tile, (m_tiles, n_tiles), 0, min(plan.group, m_tiles))
    rows, cols = pl.ds(m_tile * block_m, block_m), pl.ds(n_tile * block_n, block_n)
    ks = pl.ds(split * per_split * block_k, per_split * block_k)
    a = a_gmem.at[batch_index(batch, p.out_batch, p.a_batch)]
    b = b_gmem.at[batch_index(batch, p.out_batch, p.b_batch)]
    a_ks = b_ks = ks
    k_first = 0
    if terms is not None:  # split parts: all of K (`Terms`)
        a_ks = pl.ds(0, a.shape[-2 if p.transpose_a else -1])
        b_ks = pl.ds(0, b.shape[-1 if p.transpose_b else -2])
        k_first = split * per_split
    if shifts is not None and shifts.per_step:  # the tile's rows and the shifts'
        if plan.splits != 1 or p.transpose_a:
            raise AssertionError("per-step shifts take one K split of A as stored (M, K)")
        a = a.at[pl.ds(m_tile * block_m, block_m + shifts.max_shift)]
    else:
        if shifts is not None:  # this batch's matrix
            a = a.at[pl.ds(shifts.shift(batch), a.shape[0] - shifts.max_shift)]
        a = a.at[a_ks, rows] if p.transpose_a else a.at[rows, a_ks]
    b = b.at[cols, b_ks] if p.transpose_b else b.at[b_ks, cols]
    return Item(batch, out_index, m_tile, n_tile, a, b, k_first)


def transforms(shape: tuple[int, int], dtype) -> tuple:
    """TMA's tiling and swizzle of a shared-memory tile, by the bytes of its minor dim."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def operand_spec(block: tuple[int, int], k_axis: int, dtype) -> plgpu.BlockSpec:
    """The pipeline's tile of an operand view: K step k is block k along `k_axis`."""
    index = (lambda k: (k, 0)) if k_axis == 0 else (lambda k: (0, k))
    return plgpu.BlockSpec(block, index, transforms=transforms(block, dtype))


def shifted_spec(block: tuple[int, int], shifts: Shifts, dtype) -> plgpu.BlockSpec:
    """K step k's tile of A's rows shifted as `shifts` says: rows at an element offset."""
    def index(k):
        return shifts.shift(k // shifts.steps_per_shift), k % shifts.steps_per_shift

    return plgpu.BlockSpec((pl.Element(block[0]), block[1]), index,
                           transforms=transforms(block, dtype))


def epilogue_slice(values, column: int, ctx: dict, p: Problem) -> None:
    """Bias, activation and residual on `values`, columns [column, column + width) of a
    tile's float32 accumulator in registers of `ctx["layout"]` (a Hopper consumer's rows, or
    Blackwell's whole tile of 128), written
    through shared-memory slot `ctx["slot"]` by TMA (and z beside it where saved). Hopper's
    consumers and Blackwell's epilogue warpgroup (`blackwell.py`) share it."""
    width = ctx["out_smem"].shape[-1]
    slot, rows, layout = ctx["slot"], ctx["rows"], ctx["layout"]
    cols = pl.ds(ctx["n_start"] + column, width)
    bias = residual = None
    if ctx["bias"] is not None:  # padded to whole tiles by the wrapper
        bias_row = ctx["batch"] if ctx["bias"].shape[0] > 1 else 0  # per batch, or shared
        vector = plgpu.load(ctx["bias"].at[bias_row, cols], layout=layout.reduce(0))
        bias = lax.broadcast_in_dim(vector.astype(jnp.float32), values.shape, [1])
    if ctx["residual"] is not None:
        plgpu.commit_smem()  # every thread has read the previous slice: the slot may refill
        plgpu.copy_gmem_to_smem(ctx["residual"].at[ctx["batch"], rows, cols],
                                ctx["res_smem"].at[slot], ctx["barrier"].at[slot])
        plgpu.barrier_wait(ctx["barrier"].at[slot])
        residual = plgpu.load(ctx["res_smem"].at[slot], layout=layout)
    y, z = _epilogue.on_accumulator(values, bias, residual, p.epilogue)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slice's stores have read
    outputs = [(ctx["out_smem"], ctx["out"], y)]
    if ctx["z"] is not None:
        outputs.append((ctx["z_smem"], ctx["z"], z))
    for smem, _, value in outputs:
        smem[slot] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for smem, gmem, _ in outputs:
        plgpu.copy_smem_to_gmem(smem.at[slot], gmem.at[ctx["out_index"], rows, cols])


def epilogue_scratch(slots: int, rows: int, width: int, out_gmem, z_gmem, residual) -> dict:
    """Shared memory of `epilogue_slice`: `slots` column slices of (rows, width) of the
    output, of z and of the residual, and the residual's barriers."""
    shape = (slots, rows, width)

    def slice_of(dtype):
        return plgpu.SMEM(shape, dtype, transforms=transforms(shape, dtype))

    scratch = dict(out_smem=slice_of(out_gmem.dtype))
    if z_gmem is not None:
        scratch["z_smem"] = slice_of(z_gmem.dtype)
    if residual is not None:
        scratch["res_smem"] = slice_of(residual.dtype)
        scratch["barrier"] = plgpu.Barrier(num_barriers=slots)
    return scratch
