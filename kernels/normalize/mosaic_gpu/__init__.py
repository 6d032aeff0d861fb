"""normalize's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a): every layout, row length and dtype but float64, forward and backward.

The kernels work on rows: the columns layout (normalized axes followed by others) is
transposed to rows first, and a row that is not a multiple of 16 bytes is padded (each a copy
by XLA, `rows.rows_view`). A block of rows moves by TMA in pieces of 256 columns
(`_pallas.mosaic_gpu`'s `BlockBuffers` and `StreamedRows`), which zero-fills past the array's
edges, so ragged rows and blocks need no masks on loads and stores. Both kernels run one CTA
(one warpgroup) per SM; CTA q walks blocks q, q + programs, ... (`rows.walk_blocks`), holding
two whole blocks of its inputs in shared memory so the next block's copies are in flight while
it computes on this one. The loop nests, per block, over the pieces k of its rows
(`config.plan_of` sizes the blocks):

    forward (`forward.py`), x the sum x + residual where there is one:
        pass 1: acc += x[k]                                       -> a first mean m
        pass 2: acc_d += x[k] - m;  acc += (x[k] - m)²            -> mean, rstd (RMS: no pass 2)
        pass 3: y[k] = (x[k] - mean) * rstd * scale[k] + offset[k]  (y and the sum staged)
    backward (`backward.py`):
        pass 1: acc_gs += dy[k] * scale[k];  acc_gsx += dy[k] * scale[k] * x̂[k]
        pass 2: dx[k] = rstd * (gs - sum(acc_gs)/n - x̂ * sum(acc_gsx)/n) (+ dsum[k])
                dscale_terms[k] += Σ_rows dy[k] * x̂[k];  doffset_terms[k] += Σ_rows dy[k]

scale and offset are staged once per CTA where they fit. Rows too long for two blocks stream
their pieces again per pass (`Plan.resident`): the forward one block per CTA, the backward's
CTAs still walking. The dscale/doffset terms,
summed over a CTA's rows in shared memory, are its partial row (one per SM, or per
`config.num_partials` CTA; per block where a summed row does not fit), summed by XLA
(deterministic).
"""

from __future__ import annotations

from kernels.normalize.mosaic_gpu.backward import backward
from kernels.normalize.mosaic_gpu.config import check, resolve_config
from kernels.normalize.mosaic_gpu.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config"]
