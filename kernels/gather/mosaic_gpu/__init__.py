"""gather's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a): every mode and table dtype but 64-bit ones, forward and its scatter-add
gradient.

Both kernels move rows by TMA in pieces of 256 columns (one TMA box), on the `(batch, n,
columns)` view of the table (see common.py); `config.plan_of` sizes the tiles. The loop nests,
per CTA (one warpgroup):

    gather (`forward.py`), CTA (b, tile of tile_rows indices), a ring of `slots` tiles:
        for piece k:
            TMA x[b, mode(indices[i]), k] -> tile slot, for each i   # slots - 1 pieces ahead
            TMA tile slot -> out[b, tile, k]
    scatter_add (`backward.py`), CTA (b, block of tile_rows table rows, piece k):
        for each row r of the block, for each sorted position s of r's segment:
            acc += TMA g[b, order[s], k] -> ring slot                # `slots` rows in flight
        TMA the block's sums -> dx[b, block, k]                      # every row written once

A gather never moves values through registers (bits, not arithmetic: NaN payloads survive);
the scatter-add sums in float32 registers in the stable sort's order (the same bits every
run). Nothing here has run on a GPU: numerics are proven in Mosaic GPU's interpreter, the
resources by compiling for sm_90a and sm_100a (`python -m kernels.compile`).
"""

from kernels.gather.mosaic_gpu.backward import scatter_add
from kernels.gather.mosaic_gpu.config import check, resolve_config
from kernels.gather.mosaic_gpu.forward import gather

__all__ = ["gather", "scatter_add", "check", "resolve_config"]
