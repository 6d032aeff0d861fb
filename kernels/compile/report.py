"""What compiling one kernel for one target found (`KernelReport`), and what both back ends
share to find it: the compiler's first diagnostic line, a time limit, a one-line summary."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["KernelReport", "DEFAULT_TIMEOUT_S", "resources", "first_line", "with_timeout"]

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(kw_only=True)
class KernelReport:
    """One kernel compiled for one target (built with keywords: most fields are one back
    end's)."""

    name: str
    target: str
    compiled: bool
    error: str | None  # "<kernel> for <target>: <the compiler's first diagnostic line>"
    grid: tuple[int, ...]
    operands: str  # the kernel's operand shapes, which tell its launches apart
    seconds: float
    # Triton
    shared_bytes: int | None = None
    shared_limit: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    ctas_per_sm: int | None = None  # `Target.ctas_per_sm` of its warps, registers, shared memory
    load_bytes: dict[int, int] | None = None  # global loads in the PTX: bytes each -> count
    mma: tuple[str, ...] | None = None  # the tensor-core instructions in the PTX
    # `and.b32` with TF32's mask in the PTX: float32 tiles rounded before a TF32 dot
    # (`kernels._blocks.round_to_tf32`)
    tf32_masks: int | None = None
    # Mosaic GPU: the TMA copy instructions in the PTX, {"load": n, "store": n}, and the
    # register budgets its warpgroups set (setmaxnreg), warp-specialized kernels only
    tma: dict[str, int] | None = None
    max_registers: tuple[int, ...] | None = None
    # Mosaic
    vmem_planned: int | None = None  # double-buffered blocks + scratch, tile-padded
    vmem_limit: int | None = None  # the kernel's vmem_limit_bytes, or the target's default
    memory: dict[str, int] | None = None  # the compiled executable's memory analysis

    @property
    def fits(self) -> bool:
        """Compiled, and (Triton) within shared memory with no register spills."""
        if not self.compiled:
            return False
        if self.shared_bytes is not None and self.shared_bytes > self.shared_limit:
            return False
        return not self.spill_bytes


def first_line(error: BaseException) -> str:
    """The compiler's first diagnostic line (with the next one when it only names a code)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return first[:400]


def with_timeout(work: Callable[[], Any], timeout_s: float | None) -> Any:
    """`work()` on a daemon thread; TimeoutError if it runs past `timeout_s` (the thread is
    abandoned, not killed: compilers cannot be interrupted)."""
    if timeout_s is None:
        return work()
    result: dict[str, Any] = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"compilation did not finish within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def resources(r: KernelReport) -> str:
    """A report's resources in one line: Triton's shared memory, registers and spills (Mosaic
    GPU's, and its TMA copies), or Mosaic's planned VMEM against its limit."""
    if r.shared_limit is not None:  # a GPU kernel
        if not r.compiled:
            return ""
        text = f"smem {r.shared_bytes}/{r.shared_limit} regs {r.registers} spill {r.spill_bytes}"
        if r.tma is not None:  # Mosaic GPU: ptxas's report and the PTX's TMA copies
            return (f"{text} ({r.ctas_per_sm} CTAs/SM) tma {r.tma['load']}/{r.tma['store']} "
                    f"(loads/stores)")
        return (f"{text} warps {r.num_warps} ({r.ctas_per_sm} CTAs/SM) stages {r.num_stages} "
                f"loads {'/'.join(f'{b}B' for b in sorted(r.load_bytes, reverse=True))}")
    return f"vmem {r.vmem_planned / 2**20:.1f}/{r.vmem_limit / 2**20:.0f} MiB (planned/limit)"
