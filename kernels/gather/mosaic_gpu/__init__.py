"""gather's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a): every mode and table dtype but 64-bit ones, forward and its scatter-add
gradient.

The kernels move rows by TMA in pieces of up to 256 columns (one TMA box), on the `(batch, n,
columns)` view of the table (see common.py); `config.forward_plan` and `config.backward_plan`
size the tiles. The loop nests, per CTA (one warpgroup):

    gather (`forward.py`), CTA (b, tile of tile_rows ids, group of pieces), a ring of tiles:
        for piece k of the group:
            TMA x[b, mode(ids[i]), k] -> tile slot, for each i   # up to 3 pieces ahead
            TMA tile slot -> out[b, tile, k]
    scatter_add_pieces (`backward.py`), CTA (b, piece q of a hot row's positions, k):
        partials[b, q, k] = sum of g[b, order[s], k] over q's positions   # float32
    scatter_add (`backward.py`), CTA (b, block of tile_rows table rows, k):
        for each row r of the block:
            acc = sum of g[b, walk[s], k] over r's first positions       # a ring of 16 rows
            acc += sum of partials[b, q, k] over r's pieces
        TMA the block's sums -> dx[b, block, k]                          # every row written once

A gather never moves values through registers (bits, not arithmetic: NaN payloads survive);
the scatter-add sums in float32 registers in the stable sort's order (the same bits every
run), and no CTA's walk grows with how often one id repeats. Numerics are proven in Mosaic
GPU's interpreter, the resources by compiling for sm_90a and sm_100a (`python -m
kernels.compile`). On an H100 (docs/design.md, section 6) the tests found two faults that
neither shows, since fixed: rows landing in shared memory off `TMA_SMEM_ALIGNMENT`, and
one-row stores running into the next rows (`stored_shape`); the second fix has not run there.
"""

from kernels.gather.mosaic_gpu.backward import scatter_add
from kernels.gather.mosaic_gpu.config import check, resolve_config
from kernels.gather.mosaic_gpu.forward import gather

__all__ = ["gather", "scatter_add", "check", "resolve_config"]
