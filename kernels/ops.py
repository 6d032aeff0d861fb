"""Every op's registration (`kernels.registry.Op`), by name: the list the contract tests run over
(`tests/test_contract.py`) and the one place a new op is added to."""

from __future__ import annotations

from kernels.registry import Op
from kernels.conv2d import OP as CONV2D
from kernels.gather import OP as GATHER
from kernels.matmul import OP as MATMUL
from kernels.normalize import OP as NORMALIZE

__all__ = ["OPS"]

OPS: dict[str, Op] = {op.name: op for op in (MATMUL, CONV2D, NORMALIZE, GATHER)}
