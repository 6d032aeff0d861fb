"""The entry points: every kernel a function launches, compiled for a target by its back end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels import registry
from kernels._targets import TARGETS, Target
from kernels.compile.launches import pallas_calls
from kernels.compile.mosaic import mosaic_report
from kernels.compile.report import DEFAULT_TIMEOUT_S, KernelReport
from kernels.compile.triton import triton_report

__all__ = ["compile_kernels", "report", "implementation_for", "listing"]

# An implementation's `compile_backend` -> what compiles one of its kernels for a target.
_BACK_ENDS = {"triton": triton_report, "libtpu": mosaic_report}


def compile_kernels(fn: Callable[..., Any], *args: Any, target: str,
                    timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[KernelReport]:
    """Compiles each kernel that `fn(*args)` launches for `target` (a key of `TARGETS`).

    `fn` calls the ops with the target's implementation (`implementation_for`) and
    `interpret=False`; `args` are arrays or `jax.ShapeDtypeStruct`s. Returns one
    report per distinct kernel; a compiler error becomes a report's `error`, not an exception.
    """
    chosen = TARGETS[target]
    return [report(eqn, chosen, timeout_s) for eqn in pallas_calls(fn, *args, target=chosen)]


def report(eqn, target: Target, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> KernelReport:
    """Compiles one `pallas_call` equation (from `pallas_calls`) for `target`."""
    backend = registry.get(registry.native(target.lowering_platform, target)).compile_backend
    return _BACK_ENDS[backend](eqn, target, timeout_s)


def listing() -> list[dict[str, Any]]:
    """Per registered implementation, its compile back end and the targets its kernels are
    compiled for (an implementation that runs the reference has none)."""
    return [{"implementation": entry.name, "back_end": entry.compile_backend,
             "targets": [name for name, target in TARGETS.items()
                         if entry.compile_backend and registry.native(
                             target.lowering_platform, target) == entry.name]}
            for entry in registry.IMPLEMENTATIONS.values()]


def implementation_for(target: str) -> str:
    """The implementation whose kernels run on `target` (a key of `TARGETS`)."""
    chosen = TARGETS[target]
    return registry.native(chosen.lowering_platform, chosen)
