"""Gather and its scatter-add gradient as Pallas kernels lowered through Mosaic (TPU).

Each kernel's loop nest, per grid step (the kernels: `forward.py`, `backward.py`; the DMA ring
both walk: `ring.py`; blocks, ring depth and checks: `config.py`; 16-bit and 8-bit rows as
32-bit word-rows: `words.py`):

    gather, 32-bit tables, step (batch block, index block j):
        stage indices[j] into SMEM                            # 128 at a time
        for k in range(128): start DMA x[batch block, mode(index k)] -> out[batch block, k]
        wait for all of them
    gather, 16/8-bit tables, step (range r, b, k), in order within (r, b), on index block
    j = r * blocks_per_range + k:
        if k == 0: fill the ring                              # `depth` DMAs in flight
        for i in range(128):
            words = wait for the word-row holding row mode(index i) in its ring slot
            rows[i] = row_of_word(words, row % rows_per_word)
            start the DMA of position i + depth's word-row    # the last `depth`: block j + 1
        out[b, j] = rows                                      # written by the pipeline
    scatter_add, step (b, row block r, column block c):
        acc = 0                                               # float32, in VMEM
        fill the ring                                         # `depth` DMAs in flight
        for i in the sorted positions whose target row is in r:
            acc[target[i] - first row of r] += row_of_word(wait for g[b, order[i], c]'s
                                                           word-row)
            start the DMA of position i + depth's word-row
        dx[b, r, c] = acc                                     # written by the pipeline

Both kernels work on the `(batch, n, columns)` view of the table (see common.py), bit-cast in
the wrapper to the signed integer of the table's width (a free view): the kernels copy bits,
never arithmetic values, so NaN payloads and -0.0 survive.

What the TPU's memory layout allows (checked with the real compiler, `kernels.compile`): a
32-bit table row is one contiguous run of each (8, 128) memory tile, so a DMA can move a single
row at any offset. 16-bit and 8-bit tables pack 2 or 4 adjacent rows into each 32-bit word of a
tile, so a DMA cannot start at any row; but viewed as int32 (`Ref.bitcast`, free: the same
tiles) such a table is (n / 2 or n / 4, columns) "word-rows", each a single 32-bit row that a
DMA can move at any offset. The row wanted is then shifted out of each word in registers:
2x (4x) the row's bytes moved, where moving a whole packed tile would cost 16x (32x).

Not measured: nothing here has run on a TPU. The ring depth is design (HBM bandwidth times DMA
latency); the ring and its staging are compiled with libtpu for v5e, v6e and v4 and
checked in TPU interpret mode, whose DMAs complete when waited on, so it cannot show timing.
"""

from kernels.gather.mosaic.backward import scatter_add
from kernels.gather.mosaic.config import check, resolve_config
from kernels.gather.mosaic.forward import gather

__all__ = ["gather", "scatter_add", "check", "resolve_config"]
