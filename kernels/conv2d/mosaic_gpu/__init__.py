"""conv2d on the Mosaic GPU GEMM engine (`implementation="mosaic_gpu"`, jax >= 0.12, Hopper
sm_90a and Blackwell sm_100a): implicit GEMM by shifted TMA windows, the epilogue fused.

The loop nests, per work item of the GEMM engine's persistent kernel (`kernels.gemm.mosaic_gpu`)
and per CTA of the depthwise kernels (the layout: `config.TapRows`; the launches:
`forward.py`, `depthwise.py`):

    forward:     for kh in range(KH):                                  # tap rows
                     for kb in range(terms * width // block_k):         # (kw, channel) slices
                         acc += taps[g, rows + shift(kh), kb] @ w[g, kh, kb, cols]
                 out[g, rows, cols] = activation(acc + bias[g, cols])
    weight grad: for pb in the split's pixel blocks:                    # item = (g, kh, tile)
                     acc += taps[g, pb + shift(kh), rows]ᵀ @ dy[g, pb, cols]
                 dw[s, g, kh, rows, cols] = acc                         # partials summed by XLA
    depthwise:   for tap in range(KH * KW):                             # CTA: rows, channels, j
                     acc += taps[rows + shift(kh), kw, channels] * w[tap, j, channels]
                 out[j, rows, channels] = activation(acc + bias[j, channels])
    its dW:      for pb in the split's pixel blocks:                    # CTA: (s, tap), channels, j
                     acc += taps[pb + shift(kh), kw, channels] * dy[j, pb, channels]
                 dw[s, tap, j, channels] = the sum of acc's rows        # partials summed by XLA

XLA lays the input out once as tap rows: per output-grid pixel, the KW input pixels its window
reads along W, their group's channels (KW times the input), stride phases along H stacked. A
tap row kh is then a shift of whole rows, a multiple of TMA's 8-row tile: the TMA producer
loads each K step's (block_m, block_k) window at that offset, so the patches are never built
in HBM. The output grid is OW rounded up to 8 columns and OH plus the taps' reach in rows; the
extra pixels are computed and cut off by XLA (at 56x56 with a 3x3 kernel, 3.6% more). The
input gradient is this forward on the output gradient (sub-pixel phases where strided,
`kernels.conv2d`); a 1x1 convolution runs on the matmul kernel itself.

Depthwise convolutions run on their own kernels (`depthwise.py`: no product for the tensor
cores), and so does a grouped one of a few input channels and one output channel a group (a
depthwise gradient with a channel multiplier), as summed depthwise convolutions. Declined: what
the matmul kernel declines (float64, float32 at HIGHEST). float32 and mixed data run as TF32 on
Hopper (rounded to nearest TF32 by the matmul's `launch`) and as split bfloat16 on Blackwell
(each part's tap rows once, side by side in each tap row's K: `config.forward_terms`, the
`terms` above; one elsewhere); their weight gradient, whose
pixels are K, gets each tap row's windows copied pixel-major by XLA for the matmul (TF32 takes
K-major tiles only, and the split parts lie along K). Nothing here has run on a device.
"""

from kernels.conv2d.mosaic_gpu.config import check, resolve_config
from kernels.conv2d.mosaic_gpu.forward import conv, weight_grad

__all__ = ["check", "resolve_config", "conv", "weight_grad"]
