"""Matmul as a Pallas kernel lowered through Mosaic (TPU).

The kernel's loop nest, per grid step (blocks: `config.py`):

    step (batch i, r, c, k):                         # k: the sequential, "arbitrary" axis
        if k == 0: acc = 0                           # float32 VMEM scratch
        acc += a[i, r, k] @ b[i, k, c]               # blocks the pipeline brought into VMEM
        if k == last: out[i, r, c] = acc
"""

from kernels.matmul.mosaic.config import check, resolve_config, vmem_bytes
from kernels.matmul.mosaic.forward import matmul

__all__ = ["matmul", "check", "resolve_config", "vmem_bytes"]
