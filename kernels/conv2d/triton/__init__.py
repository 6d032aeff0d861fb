"""conv2d as Pallas kernels lowered through Triton (GPU): implicit GEMM.

Each kernel's loop nest, per program (blocks and splits: `config.py`):

    forward, GEMM path:   for kb in range(num_k_blocks):            # (tap, channel slice)
                              acc += patches[i, kb] @ w[kb, j]      # patches gathered, masked
                          out[i, j] = acc
    forward, depthwise:   for tap in range(KH * KW):
                              acc += x[pixels(i) + tap, channels(j)] * w[tap, j]
                          out[i, j] = acc
    dW, GEMM path:        for pb in pixel blocks of split s:
                              acc += patches[pb, kb]^T @ dy[pb, j]
                          dw[s, kb, j] = acc                        # partials summed by XLA
    dW, float32 pixel-major: for qb in column blocks of split s:  # x, dy copied (C|O, pixels)
                              acc += x[kb, qb + shift(tap)] @ dy[j, qb]^T
                          dw[s, kb, j] = acc
    dW, depthwise:        for pb in pixel blocks of split s:
                              for tap in taps(kb):                  # unrolled
                                  acc[tap] += x[pixels(pb) + tap, j] * dy[pb, j]
                          dw[s, tap, j] = sum over pixels of acc[tap]

The convolution is the GEMM out[M, O] = patches[M, K] @ w[K, O] per group, with M = N·OH·OW
output pixels and K = KH·KW·C_in/G (taps times input channels, channel fastest). The patch
matrix is never built in HBM: each program gathers its tile of it straight from the NHWC input
with masked pointer loads, computing for every (pixel, tap) the input position
`oh·stride + kh·dilation - pad_lo`; positions in the padding or past an edge are masked off and
read as zero. So strides, dilations and every padding form (negative: a crop) cost nothing extra
in HBM.

K is walked in blocks that stay inside one tap when a group has 16 or more input channels
(`tap_major`): a block is (tap, channel slice), its tap is one scalar per step, and each patch
row is a run of consecutive channels of one input pixel. The compiler then issues 16-byte
vector loads and pipelines them with `cp.async` like the weight tiles (the compile report's
`load_bytes`); a block that spanned taps would need a division per element and scalar 2-byte
loads. Groups of fewer channels (an RGB stem) keep blocks that span taps: per-tap blocks would
be mostly padding.
"""

from kernels.conv2d.triton.backward import weight_grad
from kernels.conv2d.triton.config import check, resolve_config
from kernels.conv2d.triton.forward import conv

__all__ = ["check", "resolve_config", "conv", "weight_grad"]
