"""conv2d as Pallas kernels lowered through Mosaic (TPU): shifted windows over a VMEM tile.

Each kernel's loop nest, per grid step (blocks and the staged geometry: `config.py`);
x_tile is the step's input rows plus the halo, window(tap) a static slice of it:

    conv, step (n, g, j, r):                  # GEMM path; depthwise: window * w[tap] on the VPU
        out[n, r, :, j] = sum(window(tap) @ w[g, tap, :, j] for tap in taps)   # float32 acc
    weight_grad, step (g, j, n, r):           # (n, r): the reduction over pixels, "arbitrary"
        acc[tap] += window(tap)ᵀ @ dy[n, r, :, j] for tap in taps          # VMEM accumulator
        at the last (n, r):  dw[g, :, :, :, j] = acc

The whole input tile of a step must fit VMEM with double buffering, within the target's budget
(`Target.vmem_budget`, the policy every Mosaic kernel shares: physical VMEM less an eighth, so
14 MiB on a v4 and 112 MiB on a v5e; `_pallas.vmem_limit` raises the compiler's scoped limit
to what the step needs); a problem whose tile would not (very wide images with many channels)
is declined. (libtpu clamps a limit above the physical VMEM rather than refusing it, so the
former fixed 48 MiB cap let a v4 step that needed 22 MiB through to a compile error. The
estimate, `vmem_bytes`, counts float32 accumulators beside the blocks and is conservative:
a v4 step it puts at 23.6 MiB plans 13.2 MiB of blocks and compiles, but is declined.)
"""

from kernels.conv2d.mosaic.backward import weight_grad
from kernels.conv2d.mosaic.config import check, resolve_config, vmem_bytes
from kernels.conv2d.mosaic.forward import conv
from kernels.conv2d.mosaic.windows import staged_input

__all__ = ["conv", "weight_grad", "staged_input", "check", "resolve_config", "vmem_bytes"]
