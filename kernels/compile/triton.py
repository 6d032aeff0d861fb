"""Triton's back end on a CPU, for `sm_90` (H100) and `sm_80` (A100): the lowered module's
Triton custom call carries the kernel as Triton-dialect MLIR; the PyPI `triton` package
compiles it to a cubin, which gives the shared memory it needs (compared here with the per-block
limit: Triton itself only fails when a driver loads the kernel), through ptxas's log its
registers and spills, and from the PTX the width of every global load (16-byte vector loads
and `cp.async` copies are what a pipelined kernel issues; 2-byte loads mean the compiler could
not prove the addresses contiguous) and the tensor-core instructions (`wgmma` on sm_90,
`mma.sync` on sm_80) with the rounding of float32 tiles before them (`tf32_masks`)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import tempfile
import time
import warnings

import jax

from kernels._blocks import TF32_DROPPED_BITS
from kernels._pallas import TRITON_CALL_MARKER, lower
from kernels._targets import Target
from kernels.compile.launches import bind, operands
from kernels.compile.report import KernelReport, first_line, with_timeout

__all__ = ["triton_report"]


def _triton_kernel(eqn, target: Target) -> tuple[str, dict[str, int]]:
    """The Triton-dialect text and launch parameters of one kernel lowered for `target`."""
    # jax's private MLIR bindings and Triton lowering, loaded only when a Triton kernel is
    # compiled (as the optional `triton` package below: the test extra).
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    module = lower(bind(eqn), *avals, target=target).compiler_ir("stablehlo")
    calls = []

    def walk(operation):
        for region in operation.regions:
            for block in region:
                for op in block:
                    if (op.name == "stablehlo.custom_call" and ir.StringAttr(
                            op.attributes["call_target_name"]).value == TRITON_CALL_MARKER):
                        calls.append(op)
                    walk(op)

    walk(module.operation)
    (call,) = calls
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    launch = {key: ir.IntegerAttr(config[key]).value
              for key in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
    with _new_ir_context():
        text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
    return text, launch


def _compile_triton(text: str, launch: dict[str, int], target: Target) -> dict[str, int]:
    import triton
    from triton.backends.compiler import GPUTarget

    triton.knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    triton.knobs.nvidia.dump_ptxas_log = True
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.ttir")
        with open(path, "w") as f:
            f.write(text)
        log = io.StringIO()
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kernel = triton.compile(
                path, target=GPUTarget("cuda", target.compute_capability, 32),
                options=dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"]))
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    ptx = kernel.asm["ptx"]
    mma = tuple(sorted(set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\S*", ptx))))
    load_bytes: dict[int, int] = {}
    for width in map(_load_width, ptx.splitlines()):
        if width:
            load_bytes[width] = load_bytes.get(width, 0) + 1
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    tf32_mask = re.compile(rf"\band\.b32\s[^;]*,\s*{-(1 << TF32_DROPPED_BITS)};")
    return dict(shared_bytes=int(kernel.metadata.shared),
                registers=int(registers.group(1)) if registers else None,
                spill_bytes=int(spills.group(1)) if spills else None, load_bytes=load_bytes,
                mma=mma, tf32_masks=len(tf32_mask.findall(ptx)))


def _load_width(ptx_line: str) -> int | None:
    """Bytes that one PTX instruction loads from global memory per thread (`ld.global` and
    `cp.async`, whose third operand is the copy's size), or None for any other line."""
    copy = re.search(r"cp\.async\.c[ag]\.shared\.global\s[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)",
                     ptx_line)
    if copy:
        return int(copy.group(1), 0)
    load = re.search(r"\bld\.global\S*", ptx_line)
    if not load:
        return None
    parts = load.group(0).split(".")
    vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    bits = next(int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p))
    return vector * bits // 8


def triton_report(eqn, target: Target, timeout_s: float | None) -> KernelReport:
    name, start = eqn.params["name"], time.perf_counter()
    report = KernelReport(name=name, target=target.name, compiled=False, error=None,
                          grid=eqn.params["grid_mapping"].grid, operands=operands(eqn),
                          seconds=0.0, shared_limit=target.shared_memory)
    try:
        text, launch = _triton_kernel(eqn, target)
        report.num_warps, report.num_stages = launch["num_warps"], launch["num_stages"]
        report.grid = (launch["grid_x"], launch["grid_y"], launch["grid_z"])
        resources = with_timeout(lambda: _compile_triton(text, launch, target), timeout_s)
        report = dataclasses.replace(report, compiled=True, **resources)
        if report.registers is not None:
            report.ctas_per_sm = target.ctas_per_sm(32 * report.num_warps, report.registers,
                                                    report.shared_bytes)
    except Exception as error:  # noqa: BLE001 - the verdict is the report
        report.error = f"{name} for {target.name}: {first_line(error)}"
    report.seconds = time.perf_counter() - start
    if report.compiled and not report.fits:
        report.error = (f"{name} for {target.name}: needs {report.shared_bytes} bytes of shared "
                        f"memory (limit {report.shared_limit}), spills {report.spill_bytes} "
                        "bytes")
    return report

