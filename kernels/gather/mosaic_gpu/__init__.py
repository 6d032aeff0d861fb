"""gather's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a): every mode and table dtype but 64-bit ones, forward and its scatter-add
gradient.

The kernels move rows by TMA on the `(batch, n, columns)` view of the table (see common.py),
whole rows by one linear copy where their bytes allow, else in pieces of up to 256 columns
(one TMA box); `config.forward_plan` and `config.backward_plan` size the tiles and
`config.forward_seconds` and `config.backward_seconds` state what they are expected to take.
The loop nests, per CTA (one warpgroup):

    gather (`forward.py`), CTA (b, group of pieces, run of tiles of ids), a ring of tiles:
        stage the run's ids in shared memory
        for tile t of the run, for piece k of the group:
            TMA x[b, mode(ids[t, i]), k] -> tile slot, for each i   # up to 5 tiles ahead
            TMA tile slot -> out[b, t, k]
    scatter_add_pieces (`backward.py`), CTA (b, piece q of a hot row's positions):
        partials[b, q] = sum of g[b, order[s]] over q's positions          # float32
    scatter_add (`backward.py`), CTA (b, block of tile_rows table rows), a span at a time:
        for each row r of the block:
            acc = sum of g[b, walk[s]] over r's first positions    # a ring of spans
            acc += sum of partials[b, q] over r's pieces
            TMA acc (or zeros) -> dx[b, r]                         # every row written once

A gather never moves values through registers (bits, not arithmetic: NaN payloads survive);
the scatter-add sums in float32 registers in the stable sort's order (the same bits every
run), and no CTA's walk grows with how often one id repeats. Numerics are proven in Mosaic
GPU's interpreter, the resources by compiling for sm_90a and sm_100a (`python -m
kernels.compile`). On an H100 (docs/design.md, section 6) the tests found two faults that
neither shows, since fixed: rows landing in shared memory off `TMA_SMEM_ALIGNMENT`, and
one-row stores running into the next rows (`stored_shape`). On an H200 the forward passed its
tests natively; the scatter-add zeroed whole rows where a row is not whole pieces (a piece's
store ran into the next row); the last piece now stores only the row's `tail`, not rerun there.
"""

from kernels.gather.mosaic_gpu.backward import scatter_add
from kernels.gather.mosaic_gpu.config import check, resolve_config
from kernels.gather.mosaic_gpu.forward import gather

__all__ = ["gather", "scatter_add", "check", "resolve_config"]
