"""Gather and its scatter-add gradient as Pallas kernels lowered through Triton (GPU).

Each kernel's loop nest, per program (the kernels: `forward.py`, `backward.py`; blocks, pieces
and schedules: `config.py`), on the `(batch, n, columns)` view of the table (see common.py); c
is a block of columns:

    gather, program (b, index block i, c):
        rows = mode(indices[i])                       # clamp / wrap / mark out of range
        out[b, i, c] = x[b, rows, c]                  # one masked pointer gather
    scatter_add_pieces, program (b, piece q, c):      # only rows hit more than `length` times
        for k in range(start[q], stop[q], segment_rows):
            acc += sum(g[b, order[k : k + segment_rows], c])
        partials[b, q, c] = acc
    scatter_add, program (b, row block, c):
        for r in the block's rows:
            acc = sum(g[b, order[k], c] for k in r's first `length` sorted positions)
            acc += sum(partials[b, q, c] for q in r's pieces)
            dx[b, r, c] = acc                         # every row written once, zeros included
"""

from kernels.gather.triton.backward import scatter_add
from kernels.gather.triton.config import check, resolve_config
from kernels.gather.triton.forward import gather

__all__ = ["gather", "scatter_add", "check", "resolve_config"]
