"""Matmul as a Pallas kernel lowered through Triton (GPU).

The kernel's loop nest, per program (tiles and split-K: `config.py`):

    program (tile t, batch i, split s):              # t -> (rows, cols) in grouped order
        acc = 0                                      # float32 (float64 for float64)
        for kb in s's range of cdiv(K, block_k):     # all of them unless split-K
            acc += a[i, rows, kb] @ b[i, kb, cols]   # masked loads: past the edges read 0
        out[s, i, rows, cols] = acc                  # split-K: partial sums XLA adds
"""

from kernels.matmul.triton.config import check, resolve_config
from kernels.matmul.triton.forward import matmul

__all__ = ["matmul", "check", "resolve_config"]
