"""conv2d on the Mosaic GPU GEMM engine (`implementation="mosaic_gpu"`, jax >= 0.12, Hopper
sm_90a and Blackwell sm_100a): implicit GEMM on NHWC images read in place, the epilogue fused,
the output stored in NHWC by the kernel.

The loop nests, per work item of the GEMM engine's persistent kernel (`kernels.gemm.mosaic_gpu`:
`tiles.Pixels`, `tiles.PixelSums`) and per CTA of the depthwise kernels (the launches:
`forward.py`, `depthwise.py`):

    forward:     for tap in range(KH * KW):                            # item = (g, tile)
                     for kb in range(terms * C/G // block_k):            # channel slices
                         for piece in the tile's pieces of output rows:  # a TMA box each
                             a_slot[piece] = x[n, r·sh + kh·dh - top,
                                               c·sw + kw·dw - left, g, kb]
                         acc += a_slot @ w[g, tap, kb, cols]
                 out[n, r, c, g, cols] = activation(acc + bias[g, cols])   # a box a piece
    weight grad: for pb in the split's K slices of 64 output pixels:    # item = (g, tap, tile)
                     dy_slot, x_slot = the pieces' boxes of dY and of x at the tap
                     acc += dy_slot[:, rows]ᵀ @ x_slot[:, cols]
                 dwᵀ[s, g, tap, rows, cols] = acc                        # partials summed by XLA
    depthwise:   for tap in range(KH * KW):                             # CTA: rows, channels, j
                     acc += taps[rows + shift(kh), kw, channels] * w[tap, j, channels]
                 out[j, rows, channels] = activation(acc + bias[j, channels])
    its dW:      for pb in the split's pixel blocks:                    # CTA: (s, tap), channels, j
                     acc += taps[pb + shift(kh), kw, channels] * dy[j, pb, channels]
                 dw[s, tap, j, channels] = the sum of acc's rows        # partials summed by XLA

**The path, and why.** A TMA box over NHWC, (piece of an output row's pixels, block_k
channels) at a tap's coordinate, is that piece's rows of the tap's A tile: the tap is a GMEM
coordinate, not a copy. The padding is TMA's zero fill (a start before the image, or past
it), and a stride along W is a plane of the free view (N, H, W / sw, sw·G, C/G) of x, so a
strided tap is still one contiguous box (`config.image_operand`); along H a stride is the
box's row. Boxes land in a swizzle-only view of the slot's bytes (Mosaic GPU's layout
inference wants a tiled box's start along W a multiple of 8, which a tap's column is not), so
narrow images (OW 7, 14, 28) need no padding: a piece is OW rounded up to 8 pixels, at most
64, and a slot holds whole pieces. The weight gradient reads dY and x the same way, its K
the output pixels in pieces of 8. What remains of XLA's copies: a group's channels padded
to one K slice (64 16-bit, 32 float32: an RGB stem's 3 channels become 64, a copy of 21x
the input) or to TMA's 16-byte rows, W padded to a multiple of the stride, Blackwell's split
parts of float32 data, the weights' layout, and the interleaving of a strided input
gradient's sub-pixel phases (`kernels.conv2d`). A piece that does not divide 64 leaves rows
of a slot idle (OW 33 to 40: 24 of each 64). docs/design.md has the whole programs' bytes
against XLA's.

**What the interpreter cannot run.** It reads a box with a negative start from the array's
end and keeps a `RefUnion`'s two views apart, so interpreted, x is padded at the top and left
by XLA (the box starts shifted by the padding) and boxes land in the tiled view; the rest of
the kernels' code is the compiled code. The negative starts and the union of views are proved
by compiling for sm_90a and sm_100a (tests/test_mosaic_gpu.py, tests/test_conv2d_mosaic_gpu.py),
not by numerics; nothing here has run on a device.

Depthwise convolutions run on their own kernels (`depthwise.py`: no product for the tensor
cores; the input laid out as tap rows, `tap_rows.py`), and so does a grouped one of a few input
channels and one output channel a group (a depthwise gradient with a channel multiplier), as
summed depthwise convolutions. Declined: what the engine declines (float64, float32 at
HIGHEST). float32 and mixed data run as TF32 on Hopper (rounded to nearest TF32 by the
engine's `launch`: one XLA pass) and as split bfloat16 on Blackwell (each part once, side by
side in x's planes and each tap's K: `config.forward_terms`, the `terms` above; one
elsewhere); their weight gradient, whose pixels are K, gets each tap's window of x copied by
XLA for the engine's matmul (TF32 takes K-major tiles only, and the split parts lie along K).
"""

from kernels.conv2d.mosaic_gpu.config import check, resolve_config
from kernels.conv2d.mosaic_gpu.forward import conv, weight_grad

__all__ = ["check", "resolve_config", "conv", "weight_grad"]
