"""Whole programs compiled as users run them, for GPUs and multi-chip TPUs, on any machine.

`kernels.compile` compiles each kernel alone. Users run jitted programs, often sharded over many
devices and compiled on one machine for another; those fail where single kernels do not (a
partitioner that cannot take a kernel, a reshape of a sharded array, a decision made for the
host). This module compiles whole programs with the real compilers and compile-only devices:

- GPU: XLA's own GPU compiler (the `jax-cuda12-plugin`, no CUDA driver or GPU needed) for a
  topology of H100s or A100s described by `_targets.gpu_target_config`; the Triton kernels are
  compiled by XLA's bundled Triton and ptxas.
- TPU: libtpu, ahead of time, for a multi-chip topology (v5e 2x2, v6e 2x2, v4 2x2x1).

A program is traced the way a user traces it: `jax.jit` of the function over arguments sharded
on a `Mesh` of the compile-only devices, with Auto axes (the pjit style) or Explicit axes
(`jax.set_mesh`), or on one device. The report counts, in the compiled program, the kernel calls
(Triton or Mosaic custom calls: compiled kernels, not interpreted ones, which would be loops of
XLA fusions) and the collectives.

    python -m kernels.compile --programs --devices 4 --mesh auto   # every op, 5 targets

The programs are each op's (`PROGRAMS`, from `kernels/<op>/cases.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from kernels import _dispatch, _targets, registry
from kernels._cases import Case, Program
from kernels.compile.api import implementation_for
from kernels.compile.report import first_line
from kernels.ops import OPS

__all__ = ["ProgramReport", "Program", "PROGRAMS", "MESHES", "devices", "compile_program",
           "expects_kernels", "collectives", "layer_program"]

MESHES = ("one", "auto", "explicit")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Multi-chip TPU topologies by chip count (libtpu's names and per-host bounds).
_TPU_TOPOLOGIES = {
    ("v5e", 1): ("v5e:1x1", (1, 1, 1)), ("v5e", 4): ("v5e:2x2", (2, 2, 1)),
    ("v5e", 8): ("v5e:2x4", (2, 4, 1)),
    ("v6e", 1): ("v6e:1x1", (1, 1, 1)), ("v6e", 4): ("v6e:2x2", (2, 2, 1)),
    ("v6e", 8): ("v6e:2x4", (2, 4, 1)),
    ("v4", 1): ("v4:1x1x1", (1, 1, 1)), ("v4", 4): ("v4:2x2x1", (2, 2, 1)),
    ("v4", 8): ("v4:2x2x2", (2, 2, 2)),
}


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One whole program compiled for one target: compiled or the compiler's first error line,
    and what the compiled program holds."""

    program: str
    target: str
    devices: int
    mesh: str
    implementation: str
    compiled: bool
    error: str = ""
    kernel_calls: int = 0
    collectives: tuple[tuple[str, int], ...] = ()
    seconds: float = 0.0

    def collective(self, name: str) -> int:
        return dict(self.collectives).get(name, 0)


@functools.cache
def devices(target_name: str, count: int) -> tuple[Any, ...]:
    """`count` compile-only devices of `target_name` (a key of `_targets.TARGETS`)."""
    from jax.experimental import topologies

    target = _targets.TARGETS[target_name]
    if target.platform == "gpu":
        _ptxas_on_path()
        try:
            topology = topologies.get_topology_desc(
                platform="cuda", topology=f"1x1x{count}",
                target_config=_targets.gpu_target_config(target))
        except NotImplementedError as error:
            raise RuntimeError(
                f"no compile-only {target_name} devices: XLA's GPU compiler needs "
                "jax[cuda12-local] installed and kernels.compile.use_compile_only_devices() "
                "called before jax starts its backends") from error
    else:
        name, per_host = _TPU_TOPOLOGIES[(target_name, count)]
        extra = {k: v for k, v in target.topology if k != "topology_name"}
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                chips_per_host_bounds=per_host, **extra)
    return tuple(topology.devices)


def _ptxas_on_path() -> None:
    """XLA turns PTX into cubins with the first ptxas on PATH: put first the CUDA 12 one that
    PyPI's triton ships (the test extra), matching the jax-cuda12 plugin, whatever toolkit the
    machine has (a CUDA 13.0 ptxas rejects the plugin's sm_100a PTX: "SM version specified by
    .target is higher than default SM version assumed"); without triton, the machine's."""
    with contextlib.suppress(ImportError):
        import triton

        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        if not os.environ.get("PATH", "").startswith(bin_dir + os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def collectives(text: str) -> dict[str, int]:
    """How many of each collective the compiled program `text` (HLO) runs."""
    return {name: len(re.findall(rf"\b{name}(-start)?\(", text)) for name in COLLECTIVES}


def mesh_for(target_name: str, count: int, kind: str, shape: Sequence[int] | None = None,
             names: Sequence[str] = ("data", "model")) -> Mesh:
    """A mesh of `count` compile-only devices: ("data", "model") of shape `shape` (default
    (2, count // 2)), Auto or Explicit axes; one device for kind "one"."""
    devs = devices(target_name, count)
    if kind == "one":
        return Mesh(np.array(devs[:1]).reshape(1, 1), tuple(names))
    shape = tuple(shape or (2, count // 2))
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return Mesh(np.array(devs).reshape(shape), tuple(names), axis_types=(axis_type,) * len(shape))


def compile_program(name: str, fn: Callable[..., Any], args: Sequence[Any], mesh: Mesh,
                    *, target: str, mesh_kind: str, implementation: str) -> ProgramReport:
    """`jax.jit(fn)` compiled for the devices of `mesh` over `args` (ShapeDtypeStructs sharded
    on it), traced as a user traces it (Explicit meshes are set in scope)."""
    platform = _targets.TARGETS[target].platform
    start = time.perf_counter()
    report = functools.partial(ProgramReport, name, target, mesh.size if mesh_kind != "one"
                               else 1, mesh_kind, implementation)
    try:
        with contextlib.ExitStack() as scope:
            if mesh_kind == "explicit":
                scope.enter_context(jax.set_mesh(mesh))
            device = mesh.devices.flat[0]
            if platform == "gpu":  # Triton lowering and the partitioner ask for a GPU in scope
                scope.enter_context(jax.default_device(device))
            elif mesh_kind == "one":  # Mosaic asks a one-device program's TPU generation here
                scope.enter_context(jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
                    (), (), abstract_device=_targets.abstract_device(_targets.TARGETS[target]))))
            compiled = jax.jit(fn).trace(*args).lower().compile()
        text = compiled.as_text()
    except Exception as error:  # noqa: BLE001 - the verdict is the report
        message = f"{type(error).__name__}: {first_line(error)}"
        return report(False, message, seconds=time.perf_counter() - start)
    lowering = _targets.TARGETS[target].lowering_platform
    calls = sum(len(re.findall(rf'custom_call_target="{re.escape(entry.call_marker)}"', text))
                for entry in registry.IMPLEMENTATIONS.values()
                if entry.is_kernel and lowering in entry.platforms)
    counts = tuple(collectives(text).items())
    return report(True, "", calls, counts, time.perf_counter() - start)


# Entry-computation instructions of a compiled program that launch nothing.
_NOT_LAUNCHES = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
# "%name = shape opcode(operands)" of an HLO instruction (a tuple shape in parentheses).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%\S+) = (\([^=]*?\)|\S+) ([a-z][\w-]*)\(([^)]*)\)",
                          re.MULTILINE)
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


def _array_bytes(shape: str) -> int:
    """Bytes of the first array of an HLO shape ("bf16[8,4]{1,0}", or a tuple's first)."""
    match = _ARRAY.search(shape)
    if match is None:
        return 0
    width = re.search(r"\d+", match[1])  # f32: 32 bits, f8e4m3fn: 8; pred: a byte
    bits = int(width[0]) if width else 8
    return math.prod(int(d) for d in match[2].split(",") if d) * bits // 8


def _custom_call_bytes(entry: str) -> tuple[int, int]:
    """(custom calls, their bytes) in an entry computation: each library call (cuBLAS, cuDNN)
    reads its operands and writes its result once (its scratch, a tuple's other arrays, aside).
    XLA's cost analysis counts each as -1 byte."""
    shapes, calls, nbytes = {}, 0, 0
    for name, shape, opcode, operands in _INSTRUCTION.findall(entry):
        shapes[name] = shape
        if opcode == "custom-call":
            calls += 1
            nbytes += _array_bytes(shape) + sum(
                _array_bytes(shapes.get(operand.strip(), ""))
                for operand in operands.split(",") if operand.strip().startswith("%"))
    return calls, nbytes


def layer_program(case: Case, target_name: str, implementation: str = registry.REFERENCE,
                  training: bool = True) -> tuple[int, int]:
    """The whole program of `case`'s op as a layer of a model, with `implementation` (XLA's own
    by default): the forward's output and (when `training`) the gradient of every float operand
    from a given cotangent, compiled for one compile-only GPU of `target_name`. Returns
    (launches, bytes): the instructions of its entry computation that launch a kernel, and the
    bytes XLA's cost analysis states for the compiled (fused) module, which it counts per fusion
    from what each reads and writes (a library call's or a Pallas kernel's, from its operands
    and result: `_custom_call_bytes`), so programs of every implementation are counted alike."""
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    device = devices(target_name, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in case.args]
    out = jax.eval_shape(case.forward(registry.REFERENCE), *case.args)
    cotangent = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=sharding)
    layer = case.layer(implementation)

    with jax.default_device(device):
        if training:
            compiled = jax.jit(layer).trace(cotangent, *args).lower().compile()
        else:
            compiled = jax.jit(case.forward(implementation)).trace(*args).lower().compile()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    opcodes = re.findall(r"^\s*(?:ROOT )?\S+ = .*? ([a-z][\w-]*)\(", entry, re.MULTILINE)
    module = compiled.runtime_executable().hlo_modules()[0]
    # Compile-only executables have no cost analysis; XLA's HloCostAnalysis of the optimized
    # module, run by the CPU client, counts the same fusions' bytes.
    cost = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    calls, call_bytes = _custom_call_bytes(entry)
    return (sum(op not in _NOT_LAUNCHES for op in opcodes),
            int(cost["bytes accessed"]) + calls + call_bytes)


# Every op's whole programs, from its folder (`kernels/<op>/cases.py`), by name.
PROGRAMS: dict[str, Program] = {name: program for op in OPS.values()
                                for name, program in op.cases.PROGRAMS.items()}


def default_of(program: Program, target: str) -> str:
    """The implementation `implementation=None` runs first in `program` compiled for `target`
    (the defaults table, for the target's device kind and the program's dtype)."""
    spec = _targets.TARGETS[target]
    return _dispatch.implementations(None, program.op, spec.lowering_platform, program.dtype,
                                     spec.device_kind)[0]


def expects_kernels(program: Program, target: str, mesh_kind: str,
                    implementation: str | None) -> bool:
    """Whether the compiled program should hold this library's kernels: an explicit kernel
    always; the default where the defaults table puts a kernel first for the target's
    platform, except compiled Mosaic kernels on Auto axes, where the default is `xla`."""
    if implementation is None:
        implementation = default_of(program, target)
    entry = registry.get(implementation)
    if not entry.is_kernel or mesh_kind != "one" and not program.sharded_kernels:
        return False
    return entry.auto_axes or mesh_kind != "auto"


def compile_ops(target: str, count: int = 4, meshes: Sequence[str] = MESHES,
                implementations: Sequence[str | None] = (None,),
                programs: Sequence[str] | None = None) -> list[ProgramReport]:
    """Every program of `PROGRAMS` (or those named) compiled for `target` on each mesh kind,
    with each implementation (None: the default; "kernel": the target's own kernel). Where the
    default is the kernel that compiled for the same program and mesh, it is the same program:
    its report is that one's, not a second compile."""
    reports = []
    for kind in meshes:
        mesh = mesh_for(target, count, kind)
        for name in programs or PROGRAMS:
            program = PROGRAMS[name]
            explicit: dict[str, ProgramReport] = {}  # compiled, by the kernel named
            for implementation in sorted(implementations, key=lambda i: i is None):
                chosen = (implementation_for(target) if implementation == "kernel"
                          else implementation)
                default = default_of(program, target)
                if chosen is None and default in explicit:
                    reports.append(dataclasses.replace(explicit[default], implementation="None"))
                    continue
                report = compile_program(
                    name, program.function(chosen), program.args(mesh, kind == "one"), mesh,
                    target=target, mesh_kind=kind, implementation=str(chosen))
                if chosen is not None and report.compiled and registry.get(chosen).is_kernel:
                    explicit[chosen] = report
                reports.append(report)
    return reports
