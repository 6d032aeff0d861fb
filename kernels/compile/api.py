"""The entry points: every kernel a function launches, compiled for a target by its back end."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from kernels import registry
from kernels._targets import TARGETS, Target
from kernels.compile.launches import pallas_calls
from kernels.compile.mosaic import mosaic_report
from kernels.compile.mosaic_gpu import mosaic_gpu_report
from kernels.compile.report import DEFAULT_TIMEOUT_S, KernelReport
from kernels.compile.triton import triton_report

__all__ = ["compile_kernels", "report", "implementation_for", "implemented_targets", "listing",
           "missing_package"]

# An implementation's `compile_backend` -> what compiles one of its kernels for a target, and
# the Python package it needs (the test extra installs each): Mosaic GPU's kernels are compiled
# by XLA's own GPU compiler, in the CUDA plugin of `jax[cuda12-local]`.
_BACK_ENDS = {"triton": triton_report, "libtpu": mosaic_report,
              "mosaic_gpu": mosaic_gpu_report}
_PACKAGES = {"triton": "triton", "libtpu": "libtpu", "mosaic_gpu": "jax_cuda12_plugin"}


def missing_package(implementation: str) -> str | None:
    """The package `implementation`'s compile back end needs that is not installed, or None."""
    package = _PACKAGES[registry.get(implementation).compile_backend]
    return package if importlib.util.find_spec(package) is None else None


def compile_kernels(fn: Callable[..., Any], *args: Any, target: str,
                    timeout_s: float | None = DEFAULT_TIMEOUT_S,
                    implementation: str | None = None) -> list[KernelReport]:
    """Compiles each kernel that `fn(*args)` launches for `target` (a key of `TARGETS`).

    `fn` calls the ops with `implementation` (default: the target's, `implementation_for`)
    and `interpret=False`; `args` are arrays or `jax.ShapeDtypeStruct`s. Returns one
    report per distinct kernel; a compiler error becomes a report's `error`, not an exception.
    """
    chosen = TARGETS[target]
    return [report(eqn, chosen, timeout_s, implementation)
            for eqn in pallas_calls(fn, *args, target=chosen)]


def report(eqn, target: Target, timeout_s: float | None = DEFAULT_TIMEOUT_S,
           implementation: str | None = None) -> KernelReport:
    """Compiles one `pallas_call` equation (from `pallas_calls`) of `implementation`
    (default: the target's) for `target`."""
    name = implementation or registry.native(target.lowering_platform, target)
    return _BACK_ENDS[registry.get(name).compile_backend](eqn, target, timeout_s)


def listing() -> list[dict[str, Any]]:
    """Per registered implementation, its compile back end and the targets its kernels are
    compiled for (an implementation that runs the reference has none)."""
    return [{"implementation": entry.name, "back_end": entry.compile_backend,
             "targets": implemented_targets(entry.name)}
            for entry in registry.IMPLEMENTATIONS.values()]


def implemented_targets(implementation: str) -> list[str]:
    """The targets `implementation`'s kernels are compiled for: of its platforms, the devices
    its `runs_on` takes (none for the reference)."""
    entry = registry.get(implementation)
    return [name for name, target in TARGETS.items() if entry.compile_backend
            and registry.runs_natively(implementation, target.lowering_platform, target)]


def implementation_for(target: str) -> str:
    """The implementation whose kernels run on `target` (a key of `TARGETS`)."""
    chosen = TARGETS[target]
    return registry.native(chosen.lowering_platform, chosen)
