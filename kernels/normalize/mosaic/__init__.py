"""normalize as Pallas kernels lowered through Mosaic (TPU): forward and fused backward.

Each kernel's loop nest, per grid step (blocks: `config.py`); x[o, b, c] is the VMEM
block of slab o, group block b and chunk c of the reduced axis, and step (u, k, phase, c)
works on block b = r·blocks_per_range + k of slab o, where u = o·ranges + r:

    forward, step (u, k, phase, c), where with a residual x[o, b, c] means x + r, added on
    load, and the step writing y also writes it to sum[o, b, c]:
        one chunk:  mean, rstd = moments(x[o, b, 0]);  y[o, b, 0] = affine((x - mean) * rstd)
        phase 0:    acc = merge(acc, moments(x[o, b, c]))              # VMEM scratch
        phase 1:    y[o, b, c] = affine((x[o, b, c] - mean(acc)) * rstd(acc))
    backward, step (u, k, phase, c):
        phase 0:    sums += (sum(dy·scale), sum(dy·scale·x̂)) over chunk c   # one chunk: in place
        phase 1:    dx[o, b, c] = input_gradient(x[o, b, c], dy[o, b, c], sums)
                                  (+ dsum[o, b, c], the sum output's cotangent, with a residual)
                    dscale_partial[u, c] += column sums of dy·x̂;  doffset_partial: of dy
                    # in VMEM through the range's blocks k; zeroed at k = 0

Both kernels work on the 3-D view of `common` (rows `(1, groups, reduced)` or columns
`(outer, reduced, groups)`) with VMEM blocks of `block_groups` groups by `block_reduced`
elements: `(block_groups, block_reduced)` for rows, `(block_reduced, block_groups)` for columns.
Blocks respect TPU tiling: the sublane dim is a multiple of 8 (16 for 16-bit dtypes) or the
whole array dim, the lane dim a multiple of 128 or the whole array dim. The defaults take the
whole group (reduced <= 16384) and as many groups as keep a block near 128K elements.
"""

from kernels.normalize.mosaic.backward import backward
from kernels.normalize.mosaic.config import check, resolve_config, vmem_bytes
from kernels.normalize.mosaic.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config", "vmem_bytes"]
