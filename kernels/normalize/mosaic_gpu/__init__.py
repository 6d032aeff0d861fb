"""normalize's kernels lowered through Mosaic GPU (`implementation="mosaic_gpu"`, jax >= 0.12,
sm_90a and sm_100a): every layout, row length and dtype but float64, forward and backward.

The kernels work on rows: the columns layout (normalized axes followed by others) is
transposed to rows first, and a row that is not a multiple of 16 bytes is padded (each a copy
by XLA, `rows.rows_view`). A block of rows moves by TMA in pieces of 256 columns
(`_pallas.mosaic_gpu`'s `StagedRows` and `BlockBuffers`), which zero-fills past the array's
edges, so ragged rows and blocks need no masks on loads and stores. The loop nests, per CTA
(one warpgroup), over the pieces k of its block of rows (`config.plan_of` sizes the blocks):

    forward (`forward.py`), one block per CTA:
        pass 1: acc += x[k] (+ residual[k], the sum written)     -> a first mean m
        pass 2: acc_d += x[k] - m;  acc += (x[k] - m)²            -> mean, rstd (RMS: no pass 2)
        pass 3: y[k] = (x[k] - mean) * rstd * scale[k] + offset[k]
    backward (`backward.py`), one CTA per SM, CTA q walks blocks q, q + programs, ...,
    the next block's copies in flight while it computes on this one (two block buffers):
        pass 1: acc_gs += dy[k] * scale[k];  acc_gsx += dy[k] * scale[k] * x̂[k]
        pass 2: dx[k] = rstd * (gs - sum(acc_gs)/n - x̂ * sum(acc_gsx)/n) (+ dsum[k])
                dscale_terms[k] += Σ_rows dy[k] * x̂[k];  doffset_terms[k] += Σ_rows dy[k]

The forward's block stays in shared memory for its passes where it fits (x read from GMEM
once); the backward's two blocks do where they fit. Longer rows stream their pieces again per
pass (`Plan.resident`). The dscale/doffset terms, summed over a CTA's rows in shared memory,
are its partial row (one per SM, or per `config.num_partials` CTA; per block where a summed
row does not fit), summed by XLA (deterministic).
"""

from __future__ import annotations

from kernels.normalize.mosaic_gpu.backward import backward
from kernels.normalize.mosaic_gpu.config import check, resolve_config
from kernels.normalize.mosaic_gpu.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config"]
