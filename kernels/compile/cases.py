"""The shapes every kernel is compiled at (`CASES`, per op): each op's `COMPILE` list, in its
folder (`kernels/<op>/cases.py`): the bench's device shapes, the shapes of models people train,
and odd small ones. Each `Case` is an op's forward and its gradient, so a case compiles every
kernel the op launches; `design` marks the shapes whose launches the bench's design figures
show."""

from __future__ import annotations

from kernels._cases import Case
from kernels.ops import OPS

__all__ = ["Case", "CASES"]

CASES: dict[str, list[Case]] = {name: list(op.cases.COMPILE) for name, op in OPS.items()}
