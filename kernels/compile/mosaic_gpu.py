"""Mosaic GPU's back end on a CPU, for `sm_90` (H100: sm_90a) and `sm_100` (B200: sm_100a): the
kernel alone is compiled by XLA's own GPU compiler for a compile-only device of the target
(`kernels.compile.programs.devices`), which runs Mosaic GPU's pipeline (its layout inference
rejects what the interpreter accepts) and ptxas; Mosaic GPU's dump of ptxas's report
(`MOSAIC_GPU_DUMP_TO`, `MOSAIC_GPU_DUMP_PTXAS`) gives the registers and spills, and its
resources dump the dynamic shared memory.
Needs `jax[cuda12-local]` (the test extra), as whole programs do."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import tempfile
import time

import jax

from kernels._targets import Target
from kernels.compile.launches import bind, grid_of, launch_key, operands
from kernels.compile.report import KernelReport, first_line, with_timeout

__all__ = ["mosaic_gpu_report", "OWN_PROCESS"]

# Measured (jax 0.12.0.1): in a process that has compiled a Mosaic GPU kernel for sm_90a, a
# compile for sm_100a fails in ptxas ("SM version specified by .target is higher than default
# SM version assumed"), and in a fresh process it compiles: Mosaic GPU keeps the first
# architecture it compiled for. So one process compiles for one GPU generation, and
# `python -m kernels.compile` leaves these targets to a run of their own (`--targets sm_100`).
OWN_PROCESS = ("sm_100",)
_compiled_for: list[str] = []  # the GPU target this process's Mosaic GPU compiles are for
# Compiled reports by (target, `launch_key`): Mosaic GPU caches a compiled kernel by its module
# in the process and dumps nothing when it compiles the same kernel again (two gather cases
# whose backward is the same launch), so a kernel's report is the one from its first compile.
_reports: dict[tuple, KernelReport] = {}


@contextlib.contextmanager
def _dumped_to(folder: str):
    """Mosaic GPU writes each kernel's PTX and ptxas report under `folder` (read at every
    kernel compile)."""
    saved = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")}
    os.environ.update(MOSAIC_GPU_DUMP_TO=folder, MOSAIC_GPU_DUMP_PTXAS="1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# TMA's copies in PTX (tensor copies, or plain bulk copies of contiguous bytes), by direction.
_TMA_COPIES = {"load": r"cp\.async\.bulk(?:\.tensor\.\w+)?\.shared::\w+\.global",
               "store": r"cp\.async\.bulk(?:\.tensor\.\w+)?\.global\.shared"}


def _ptxas(folder: str) -> dict:
    """Registers and spills from ptxas's report; shared memory: ptxas's static bytes plus the
    dynamic shared memory Mosaic GPU allocates (its resources dump's `smem_scratch_bytes`: the
    kernel's scratch buffers and barriers), which ptxas does not see; and the TMA copy
    instructions in the PTX (`_TMA_COPIES`), its tensor-core instructions and the register
    budgets its warpgroups set (`setmaxnreg`: a warp-specialized kernel's producer and
    consumers)."""
    def read(pattern):
        return "".join(open(path).read() for path in glob.glob(os.path.join(folder, pattern)))

    text, resources, ptx = read("*.ptxas"), read("*.resources.txt"), read("*.ptx")
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    static = re.search(r"(\d+) bytes smem", text)
    dynamic = re.search(r"smem_scratch_bytes=(\d+)", resources)
    return {"registers": int(registers[1]) if registers else None,
            "spill_bytes": int(spills[1]) + int(spills[2]) if spills else None,
            "shared_bytes": (int(static[1]) if static else 0) + int(dynamic[1])
            if dynamic else None,
            "tma": {direction: len(re.findall(pattern, ptx))
                    for direction, pattern in _TMA_COPIES.items()},
            "mma": tuple(sorted(set(re.findall(r"\b(?:wgmma\.mma_async|tcgen05\.mma)\S*", ptx)))),
            "max_registers": tuple(sorted({int(n) for n in re.findall(
                r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})),
            "threads": _threads(ptx)}


def _threads(ptx: str) -> int | None:
    """Threads per CTA: the PTX's `.reqntid` (or `.maxntid`) directive."""
    found = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", ptx)
    return math.prod(int(n) for n in found.groups() if n) if found else None


def mosaic_gpu_report(eqn, target: Target, timeout_s: float | None) -> KernelReport:
    """Compiles one Mosaic GPU kernel launch (an `mpmd_map` equation, `launches.grid_of`) for
    `target` (a GPU of the sm_90 or sm_100 family); a compile that leaves no ptxas report is
    a failure, not a kernel of no resources."""
    name = eqn.params["name"]
    report = dict(name=name, target=target.name, grid=grid_of(eqn),
                  operands=operands(eqn), shared_limit=target.shared_memory)
    if _compiled_for and _compiled_for[0] != target.name:
        return KernelReport(compiled=False, seconds=0.0, error=(
            f"{name} for {target.name}: this process compiled Mosaic GPU kernels for "
            f"{_compiled_for[0]}; compile for {target.name} in a process of its own"), **report)
    _compiled_for[:1] = [target.name]
    key = (target.name, launch_key(eqn))
    if key not in _reports:
        compiled = _compile(eqn, target, timeout_s, report)
        if not compiled.compiled:
            return compiled  # a failure or a timeout may be tried again
        _reports[key] = compiled
    return _reports[key]


def _compile(eqn, target: Target, timeout_s: float | None, report: dict) -> KernelReport:
    from kernels.compile.programs import devices  # the compile-only GPUs (the CUDA plugin)

    name = eqn.params["name"]
    start = time.perf_counter()
    device = devices(target.name, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)
            for v in eqn.invars]
    with tempfile.TemporaryDirectory() as folder:
        def work():
            with _dumped_to(folder), jax.default_device(device):
                jax.jit(bind(eqn)).trace(*args).lower().compile()
            return _ptxas(folder)

        try:
            resources = with_timeout(work, timeout_s)
            if resources["registers"] is None or resources["shared_bytes"] is None:
                raise RuntimeError("Mosaic GPU left no ptxas report (MOSAIC_GPU_DUMP_PTXAS) "
                                   "or no resources dump")
        except Exception as error:  # noqa: BLE001 - the verdict is the report
            return KernelReport(compiled=False, error=f"{name} for {target.name}: "
                                f"{first_line(error)}", seconds=time.perf_counter() - start,
                                **report)
    threads = resources.pop("threads")
    ctas = None if threads is None else target.ctas_per_sm(threads, resources["registers"],
                                                           resources["shared_bytes"])
    return KernelReport(compiled=True, error=None, seconds=time.perf_counter() - start,
                        ctas_per_sm=ctas, **report, **resources)
