"""Compile every Pallas kernel of a function for a real GPU or TPU target, on any machine.

Lowering (`kernels._pallas.lower`) proves only that the compiler front ends accept a kernel.
This package runs the real back ends, which work without the hardware, one module per job:

- `launches`: the kernels (`pallas_call` equations) a function launches for a target;
- `triton`: Triton's compiler for `sm_90` (H100) and `sm_80` (A100): shared memory, registers,
  spills, load widths and tensor-core instructions, from the cubin, ptxas and the PTX;
- `mosaic`: libtpu, ahead of time for a device-less `v5e`, `v6e` or `v4` topology: VMEM and
  Mosaic's layout rules, and the kernel's planned VMEM;
- `report`: the verdict (`KernelReport`) and what both back ends share to reach it;
- `api`: the entry points (`compile_kernels`, `report`) and each implementation's back end and
  targets (`listing`, `python -m kernels.compile --list`);
- `cases`: the shapes every kernel is compiled at (`CASES`, each op's `kernels/<op>/cases.py`);
- `programs`: whole programs, compiled as users run them (each op's `PROGRAMS`);
- `environment`: the variables the compilers need before jax starts (`use_compile_only_devices`,
  which every entry point calls first; importing the package sets nothing);
- `__main__`: the command line.

Each kernel of the function is compiled alone, so a verdict names one kernel. Both back ends
need the `test` extra (`triton`, and `jax[tpu]` for libtpu).

    python -m kernels.compile                       # every op, forward and backward, 5 targets
    python -m kernels.compile --ops gather --targets v5e,v4 --json report.json
    python -m kernels.compile --programs --devices 4 --mesh auto   # whole programs

With `--programs` it compiles whole jitted programs instead (`kernels.compile.programs`: each op's
forward and gradient on one device or sharded over a mesh of compile-only devices, as XLA's GPU
compiler and libtpu build them) and reports per program: compiled or the compiler's first error
line, kernel calls, collectives. That also needs `jax[cuda12-local]` (XLA's GPU compiler).
"""

from __future__ import annotations

from kernels.compile.cases import CASES, Case
from kernels.compile.environment import use_compile_only_devices
from kernels.compile.launches import (distinct, find_pallas_calls, launch_key,
                                      launches, pallas_calls)
from kernels.compile.mosaic import planned_vmem
from kernels.compile.api import compile_kernels, implementation_for, listing, report
from kernels.compile.report import (DEFAULT_TIMEOUT_S, KernelReport, first_line,
                                    resources)

__all__ = ["KernelReport", "compile_kernels", "report", "resources", "launches", "pallas_calls",
           "distinct", "launch_key", "find_pallas_calls", "first_line", "implementation_for",
           "listing",
           "planned_vmem", "CASES", "Case", "DEFAULT_TIMEOUT_S", "use_compile_only_devices"]
