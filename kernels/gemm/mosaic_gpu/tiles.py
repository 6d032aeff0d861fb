"""What the Mosaic GPU GEMM kernels share (Hopper's wgmma kernel in `hopper.py`,
Blackwell's tcgen05 kernel in `blackwell.py`): operands read as matrices or as the pixels of
NHWC images (`Pixels`, `PixelSums`), the shared-memory tiles TMA fills and the copies of a K
step into them (`load_step`), a work item's operand views (`item_of`), and the epilogue
applied to a column slice of the accumulator and stored by TMA (`epilogue_slice`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import _epilogue
from kernels._pallas import pl
from kernels.matmul.common import Problem, batch_index
from kernels.gemm.mosaic_gpu.config import SWIZZLE, TMA_ROWS, WG_ROWS, Plan

__all__ = ["Pixels", "PixelSums", "Terms", "ONE_TERM", "Item", "item_of", "window",
           "transforms", "slots", "slot_views",
           "boxed_operands", "k_slices", "loads_per_step", "load_step",
           "epilogue_slice", "epilogue_scratch", "epilogue_width", "check_stored_columns",
           "output_views"]


class Pixels(NamedTuple):
    """A's rows as the output pixels of NHWC images, each K step's A tile read from the input
    image in place (conv2d's implicit GEMM, `kernels.conv2d.mosaic_gpu`): the GEMM's M walks
    pieces of output rows and its K each tap's channels, and the output is stored in NHWC.

    The input is a 5-D view (N, H, W / stride_w, planes, channels): plane
    ((column % stride_w) · groups + group) · parts + part holds the channels of one group's
    part (`parts`: Blackwell's split bfloat16 parts, else 1) at input columns of that phase,
    so a strided tap's pixels are one contiguous box. The output is (N, OH, OW, groups, O/G),
    the group the output batch.

    A piece is `piece` output pixels of one output row (OW rounded up to TMA's 8 rows, at most
    a warpgroup's 64: `WG_ROWS`); a slot's rows are halves of 64 rows, each holding
    `pieces_per_half` pieces (rows past them are never stored), and piece q of the grid is
    pixels [c, c + piece) of output row r of image n, (n, r) = divmod(q // pieces_per_row,
    OH), c = (q % pieces_per_row) · piece. A product's K slice s is tap s // blocks (kh, kw
    row-major) and channel block s % blocks of it (with parts, A's slice (tap, part, block)
    as `Terms` lays parts out). Its box for piece q is the view's [n, r·stride_h +
    kh·dilation_h + origin_h, c + w // stride_w : + piece, plane of phase w % stride_w, block_k
    channels], w = kw·dilation_w + origin_w:
    `origin` is minus the padding, so the padding is TMA's zeros (a negative start, or past
    the edge), as are rows past the last image and channels past a group's. Columns past OW
    are computed from real or zero pixels and dropped by TMA's store.

    `swizzled_boxes`: the boxes land in a swizzle-only view of the slot (`slots`), the
    same bytes as the tiled view the MMA reads: Mosaic GPU's layout inference wants a box's
    start along a tiled dim to be a multiple of the tile, which a tap's column is not. The
    interpreter keeps a `RefUnion`'s views apart and takes a negative start from the end, so
    there x is padded at the top and left by XLA (`origin` 0) and the boxes land in the tiled
    view; the compiled path is proved by compiling (`kernels.conv2d.mosaic_gpu`'s docstring)."""

    out_hw: tuple[int, int]
    piece: int
    kernel_hw: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    origin: tuple[int, int]
    groups: int
    parts: int
    blocks: int  # channel blocks (K slices) a tap, of each part
    swizzled_boxes: bool

    @property
    def pieces_per_row(self) -> int:
        return pl.cdiv(self.out_hw[1], self.piece)

    @property
    def pieces_per_half(self) -> int:
        return WG_ROWS // self.piece

    def rows(self, images: int) -> int:
        """The GEMM's M: the slot rows of every piece of the images' output grid."""
        pieces = images * self.out_hw[0] * self.pieces_per_row
        return pl.cdiv(pieces, self.pieces_per_half) * WG_ROWS

    def boxed(self) -> tuple[bool, bool]:
        """Whether A's and B's boxes land in a swizzle-only view (`slots`)."""
        return self.swizzled_boxes, False

    def k_slices(self) -> int:
        """The product's K slices: each tap's channel blocks. The weights' K may be padded
        further (whole TMA tiles), but a slice past the last tap would box real pixels at a
        tap that is not there, whose Inf or NaN times the padding's zero weights is NaN."""
        return self.kernel_hw[0] * self.kernel_hw[1] * self.blocks

    def loads(self, plan: Plan) -> int:
        """TMA copies a K step: a box a piece of A's tile, and B's tile."""
        return plan.block_m // WG_ROWS * self.pieces_per_half + 1

    def pixel(self, q):
        """(image, output row, first column) of piece q of the output grid."""
        row = q // self.pieces_per_row
        return row // self.out_hw[0], row % self.out_hw[0], q % self.pieces_per_row * self.piece

    def tap_box(self, x, q, tap, group, part, channels):
        """The (piece, channels) box of the input view `x` that tap `tap` (kh, kw row-major)
        multiplies into piece q's outputs (the class docstring)."""
        n, r, c = self.pixel(q)
        kh, kw = tap // self.kernel_hw[1], tap % self.kernel_hw[1]
        column = kw * self.dilation[1] + self.origin[1]
        plane = ((column % self.stride[1]) * self.groups + group) * self.parts + part
        h = r * self.stride[0] + kh * self.dilation[0] + self.origin[0]
        return x.at[n, h, pl.ds(c + column // self.stride[1], self.piece), plane, channels]

    def _slot_row(self, j: int) -> int:
        return j // self.pieces_per_half * WG_ROWS + j % self.pieces_per_half * self.piece

    def load(self, item: Item, a_k, b_k, a_ref, b_ref, barrier, p: Problem, plan: Plan):
        """A's K slice `a_k` of the item's row tile, a box a piece, and B's `b_k`."""
        per_tap = self.parts * self.blocks
        tap, block = a_k // per_tap, a_k % per_tap
        channels = pl.ds(block % self.blocks * plan.block_k, plan.block_k)
        pieces = plan.block_m // WG_ROWS * self.pieces_per_half
        for j in range(pieces):
            box = self.tap_box(item.a, item.m_tile * pieces + j, tap, item.batch,
                               block // self.blocks, channels)
            plgpu.copy_gmem_to_smem(box, a_ref.at[pl.ds(self._slot_row(j), self.piece)],
                                    barrier)
        plgpu.copy_gmem_to_smem(window(item.b, b_k, plan.block_k, not p.transpose_b), b_ref,
                                barrier)

    def store(self, smem, gmem, first_half, halves: int, batch, cols) -> None:
        """A column slice of the halves from `first_half` (`smem`: their rows) into the NHWC
        output, a box a piece."""
        for j in range(halves * self.pieces_per_half):
            n, r, c = self.pixel(first_half * self.pieces_per_half + j)
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(self._slot_row(j), self.piece)],
                                    gmem.at[n, r, pl.ds(c, self.piece), batch, cols])


class PixelSums(NamedTuple):
    """The weight gradient's GEMMs over NHWC images (conv2d's, `kernels.conv2d.mosaic_gpu`),
    both operands read in place: batch (group g, tap t) is dWᵀ[g, t] (O/G x C/G) = the sum
    over output pixels of dY[pixel, g]ᵀ x[pixel + tap t, g], K the output grid's pieces of 8
    pixels (`image`'s geometry, `Pixels`), `slice_pieces` a K slice.

    A is dY as (N, OH, OW, G, O/G), taken transposed: its (K slice, block_m) tile is 8-row
    tiles of one swizzle span of channels each, and each piece's span is one box (8 pixels, a
    span of channels) into one tile, swizzle-only where `image.swizzled_boxes` (`slots`), so
    neither OW nor O/G need be whole tiles. B is x's view as `Pixels` reads it, each piece's
    box at the tap's offset (`Pixels.tap_box`). Pieces past the last image and columns past
    OW are TMA's zeros in dY, so what x holds there adds nothing (an Inf or NaN there makes
    NaN)."""

    image: Pixels
    taps: int  # KH·KW
    slice_pieces: int
    span: int  # dY's channels a box: one swizzle span of its dtype

    def boxed(self) -> tuple[bool, bool]:
        return self.image.swizzled_boxes, self.image.swizzled_boxes

    def loads(self, plan: Plan) -> int:
        """A box a piece and span of dY, and a box a piece of x."""
        return self.slice_pieces * (plan.block_m // self.span + 1)

    def load(self, item: Item, a_k, b_k, a_ref, b_ref, barrier, p: Problem, plan: Plan):
        """The pieces of K slice `a_k` (= `b_k`) of dY and of x."""
        del b_k, p
        group, tap = item.batch // self.taps, item.batch % self.taps
        span = self.span
        channels = pl.ds(item.n_tile * plan.block_n, plan.block_n)
        for j in range(self.slice_pieces):
            q = a_k * self.slice_pieces + j
            n, r, c = self.image.pixel(q)
            rows = pl.ds(j * TMA_ROWS, TMA_ROWS)
            for t in range(plan.block_m // span):
                box = item.a.at[n, r, pl.ds(c, TMA_ROWS), group,
                                pl.ds(item.m_tile * plan.block_m + t * span, span)]
                tile = (a_ref.at[j, t] if self.image.swizzled_boxes
                        else a_ref.at[rows, pl.ds(t * span, span)])
                plgpu.copy_gmem_to_smem(box, tile, barrier)
            plgpu.copy_gmem_to_smem(self.image.tap_box(item.b, q, tap, group, 0, channels),
                                    b_ref.at[rows], barrier)


class Terms(NamedTuple):
    """The products a Blackwell kernel sums per K slice: `pairs`, (part of A, part of B) per
    term (`config.split_terms`: float32 and mixed products as bfloat16 parts; one term, (0, 0),
    for any other). Each operand's parts lie side by side along K once (its hi and lo, or
    itself), in segments of `blocks` K slices: the product's K slice r is slice r % `blocks`
    of segment r // `blocks` (the matmul: one segment, all of K; conv2d's forward: a tap's
    channels, a segment a tap), whose part i starts (segment * parts + i) * `blocks` slices
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
    K steps read (the tile's rows and columns over the split's K range; over all of K where
    `item_of` is given split parts' `Terms`; whole images where it is given `Pixels` or
    `PixelSums`), whose K slice `k_first` is the item's first."""

    batch: Any
    out_index: Any
    m_tile: Any
    n_tile: Any
    a: Any
    b: Any
    k_first: Any = 0


def item_of(index, a_gmem, b_gmem, p: Problem, plan: Plan, terms: Terms | None = None,
            pixels: Pixels | PixelSums | None = None) -> Item:
    """Work item `index` of (split, batch, tile), the tiles of a batch in planar-snake order
    (bands of `plan.group` row tiles, so consecutive CTAs share B's panels in L2). With
    `pixels`, A is the whole input image (`Pixels.load` picks each step's boxes)."""
    block_m, block_n, block_k = plan.block_m, plan.block_n, plan.block_k
    m_tiles, n_tiles = pl.cdiv(p.m, block_m), pl.cdiv(p.n, block_n)
    per_split = plan.k_blocks_per_split(p)
    out_index, tile = index // (m_tiles * n_tiles), index % (m_tiles * n_tiles)
    split, batch = out_index // p.num_batches, out_index % p.num_batches
    m_tile, n_tile = plgpu.planar_snake(tile, (m_tiles, n_tiles), 0, min(plan.group, m_tiles))
    rows, cols = pl.ds(m_tile * block_m, block_m), pl.ds(n_tile * block_n, block_n)
    if isinstance(pixels, PixelSums):  # whole images: `load` picks each step's boxes
        return Item(batch, out_index, m_tile, n_tile, a_gmem, b_gmem, split * per_split)
    ks = pl.ds(split * per_split * block_k, per_split * block_k)
    b = b_gmem.at[batch_index(batch, p.out_batch, p.b_batch)]
    # `Pixels`: A is the whole image, whose boxes `Pixels.load` picks each step.
    a = a_gmem if pixels is not None else a_gmem.at[batch_index(batch, p.out_batch, p.a_batch)]
    a_ks = b_ks = ks
    k_first = 0
    if terms is not None:  # split parts: all of K (`Terms`)
        a_ks = pl.ds(0, a.shape[-2 if p.transpose_a else -1])
        b_ks = pl.ds(0, b.shape[-1 if p.transpose_b else -2])
        k_first = split * per_split
    if pixels is None:
        a = a.at[a_ks, rows] if p.transpose_a else a.at[rows, a_ks]
    b = b.at[cols, b_ks] if p.transpose_b else b.at[b_ks, cols]
    return Item(batch, out_index, m_tile, n_tile, a, b, k_first)


def window(view, k, block_k: int, transposed: bool):
    """K slice k's (rows, K) tile of an item's operand view ((K, rows) where `transposed`)."""
    ks = pl.ds(k * block_k, block_k)
    return view.at[ks, :] if transposed else view.at[:, ks]


def slots(stages: int, block: tuple[int, int], dtype, boxed: bool):
    """An operand's ring of `stages` shared-memory slots, tiled and swizzled for the MMA;
    where boxes land in a swizzle-only view (`Pixels.swizzled_boxes`), the union of both
    views of the same bytes: (rows, span) where a row is one swizzle span (`SWIZZLE` bytes),
    else (rows / 8, row / span, 8, span), one 8-row tile of a span each, as the tiling lays
    them out."""
    tiled = plgpu.SMEM((stages, *block), dtype, transforms=transforms(block, dtype))
    if not boxed:
        return tiled
    span = SWIZZLE // jnp.dtype(dtype).itemsize
    if block[1] % span:
        raise AssertionError(f"a row of {block[1]} {dtype} is not whole swizzle spans")
    shape = block if block[1] == span else (block[0] // TMA_ROWS, block[1] // span, TMA_ROWS,
                                            span)
    swizzled = plgpu.SMEM((stages, *shape), dtype,
                          transforms=(plgpu.SwizzleTransform(SWIZZLE),))
    return plgpu.RefUnion(swizzled, tiled)


def slot_views(ring, boxed: bool):
    """(the view TMA copies, the view the MMA or the registers use) of `slots`' ring or of
    `epilogue_scratch`'s slices: the union's two views where `boxed`, else the ring twice."""
    return tuple(ring) if boxed else (ring, ring)


def boxed_operands(pixels: Pixels | PixelSums | None) -> tuple[bool, bool]:
    """Whether A's and B's slots are unions for swizzle-only boxes."""
    return (False, False) if pixels is None else pixels.boxed()


def k_slices(p: Problem, plan: Plan, pixels: Pixels | PixelSums | None) -> int:
    """K slices a work item walks: its split's (`Plan.k_blocks_per_split`), or the taps'
    channel blocks of `Pixels` (`Pixels.k_slices`)."""
    return pixels.k_slices() if isinstance(pixels, Pixels) else plan.k_blocks_per_split(p)


def loads_per_step(pixels: Pixels | PixelSums | None, plan: Plan) -> int:
    """TMA copies a K step, each arriving on the slot's barrier once."""
    return 2 if pixels is None else pixels.loads(plan)


def load_step(item: Item, a_k, b_k, a_ref, b_ref, barrier, p: Problem, plan: Plan,
              pixels: Pixels | PixelSums | None) -> None:
    """Copies A's K slice `a_k` of `item` and B's `b_k` into a slot (`a_ref`, `b_ref`: the
    views TMA writes), every copy arriving on `barrier` (`loads_per_step` arrivals). A K
    slice counts from the start of the item's views: `Item.k_first` plus the item's step
    (a split's views of a matrix start at its K range, so its `k_first` is 0)."""
    if pixels is not None:
        pixels.load(item, a_k, b_k, a_ref, b_ref, barrier, p, plan)
        return
    plgpu.copy_gmem_to_smem(window(item.a, a_k, plan.block_k, p.transpose_a), a_ref, barrier)
    plgpu.copy_gmem_to_smem(window(item.b, b_k, plan.block_k, not p.transpose_b), b_ref,
                            barrier)


def store_of(item: Item, rows, first_half, halves: int, pixels: Pixels | PixelSums | None):
    """How `epilogue_slice` stores a column slice of the rows `rows` (the halves of 64 rows
    from `first_half`): into those rows of the output batch, or as `pixels` into NHWC."""
    def store(smem, gmem, cols):
        if not isinstance(pixels, Pixels):
            plgpu.copy_smem_to_gmem(smem, gmem.at[item.out_index, rows, cols])
        else:
            pixels.store(smem, gmem, first_half, halves, item.batch, cols)

    return store


def transforms(shape: tuple[int, int], dtype) -> tuple:
    """TMA's tiling and swizzle of a shared-memory tile, by the bytes of its minor dim."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def epilogue_slice(values, column: int, ctx: dict, p: Problem) -> None:
    """Bias, activation and residual on `values`, columns [column, column + width) of a
    tile's float32 accumulator in registers of `ctx["layout"]` (a Hopper consumer's rows, or
    Blackwell's whole tile of 128), written
    through shared-memory slot `ctx["slot"]` by TMA (and z beside it where saved). Hopper's
    consumers and Blackwell's epilogue warpgroup (`blackwell.py`) share it."""
    width = ctx["out_smem"][1].shape[-1]
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
    for (_, written), _, value in outputs:
        written[slot] = value.astype(written.dtype)
    plgpu.commit_smem()
    for (boxes, _), gmem, _ in outputs:
        ctx["store"](boxes.at[slot], gmem, cols)


def epilogue_scratch(slots: int, rows: int, width: int, out_gmem, z_gmem, residual,
                     pixels: Pixels | PixelSums | None = None) -> dict:
    """Shared memory of `epilogue_slice`: `slots` column slices of (rows, width) of the
    output, of z and of the residual, and the residual's barriers. Where `pixels` boxes are
    swizzle-only (`Pixels.swizzled_boxes`), an output's slice is the union of its tiled view
    (the registers' store) and a swizzle-only one (the boxes' stores: Mosaic GPU wants a
    tiled box's GMEM dims whole tiles, which OW and O/G need not be); `epilogue_width` makes
    them the same bytes."""
    shape = (slots, rows, width)

    def slice_of(dtype, boxed=False):
        tiled = plgpu.SMEM(shape, dtype, transforms=transforms(shape, dtype))
        if not boxed:
            return tiled
        return plgpu.RefUnion(
            plgpu.SMEM(shape, dtype, transforms=transforms(shape, dtype)[1:]), tiled)

    boxed = _stores_boxes(pixels)
    scratch = dict(out_smem=slice_of(out_gmem.dtype, boxed))
    if z_gmem is not None:
        scratch["z_smem"] = slice_of(z_gmem.dtype, boxed)
    if residual is not None:
        if pixels is not None:
            raise AssertionError("pixels take no residual")
        scratch["res_smem"] = slice_of(residual.dtype)
        scratch["barrier"] = plgpu.Barrier(num_barriers=slots)
    return scratch


def epilogue_width(width: int, block_n: int, pixels: Pixels | PixelSums | None,
                   *outputs) -> int:
    """The epilogue's column slice: `width`, or where `pixels` stores boxes from swizzle-only
    views (`epilogue_scratch`), a row of one swizzle span of 32, 64 or 128 bytes of the widest
    output that divides block_n, so that the tiled and the swizzle-only views are the same
    bytes (`check_stored_columns` declines a block_n with none)."""
    if not _stores_boxes(pixels):
        return width
    itemsize = max(jnp.dtype(o.dtype).itemsize for o in outputs if o is not None)
    spans = [w for w in _spans(itemsize) if w <= width and block_n % w == 0]
    if not spans:
        raise AssertionError(f"no swizzle span of {block_n} columns (`check_stored_columns`)")
    return spans[0]


def _spans(itemsize: int) -> list[int]:
    """Columns of a swizzle span of 128, 64 and 32 bytes."""
    return [SWIZZLE // step // itemsize for step in (1, 2, 4)]


def check_stored_columns(block_n: int, itemsize: int) -> None:
    """Declines a tile of `block_n` columns whose NHWC stores no swizzle span divides
    (`epilogue_width`): a multiple of 32 bytes of the output."""
    if block_n % _spans(itemsize)[-1]:
        raise ValueError(f"Mosaic GPU conv2d stores its output in column slices of 32, 64 or "
                         f"128 bytes: block_n must be a multiple of {_spans(itemsize)[-1]}, "
                         f"got {block_n}")


def output_views(smem, pixels: Pixels | PixelSums | None):
    """(the view TMA stores from, the view registers are stored to) of an output's slices
    from `epilogue_scratch` (None where there is no such output), as `epilogue_slice` takes
    them."""
    return None if smem is None else slot_views(smem, _stores_boxes(pixels))


def _stores_boxes(pixels) -> bool:
    """Whether the epilogue stores NHWC boxes from swizzle-only views (`Pixels.store`)."""
    return isinstance(pixels, Pixels) and pixels.swizzled_boxes
