"""Compile every Pallas kernel of a function for a real GPU or TPU target, on any machine.

Lowering (`kernels._pallas.lower`) proves only that the compiler front ends accept a kernel. This
module runs the real back ends, which work without the hardware:

- Triton, for `sm_90` (H100) and `sm_80` (A100): the lowered module's Triton custom call carries
  the kernel as Triton-dialect MLIR; the PyPI `triton` package compiles it to a cubin, which
  gives the shared memory it needs (compared here with the per-block limit: Triton itself only
  fails when a driver loads the kernel), through ptxas's log its registers and spills, and from
  the PTX the width of every global load (16-byte vector loads and `cp.async` copies are what
  a pipelined kernel issues; 2-byte loads mean the compiler could not prove the addresses
  contiguous) and the tensor-core instructions (`wgmma` on sm_90, `mma.sync` on sm_80).
- Mosaic, for `v5e`, `v6e` and `v4`: libtpu compiles ahead of time for a TPU topology described
  without a device (`jax.experimental.topologies`). Its verdict covers VMEM exhaustion and
  Mosaic's layout rules; the report adds the compiled executable's memory analysis and the
  kernel's planned VMEM (its double-buffered blocks and scratch, tile-padded).

Each kernel (`pallas_call`) of the function is compiled alone, so a verdict names one kernel.
Both need the `test` extra (`triton`, and `jax[tpu]` for libtpu).

    python -m kernels.compile                       # every op, forward and backward, 5 targets
    python -m kernels.compile --ops gather --targets v5e,v4 --json report.json
    python -m kernels.compile --programs --devices 4 --mesh auto   # whole programs

With `--programs` it compiles whole jitted programs instead (`kernels.programs`: each op's
forward and gradient on one device or sharded over a mesh of compile-only devices, as XLA's GPU
compiler and libtpu build them) and reports per program: compiled or the compiler's first error
line, kernel calls, collectives. That also needs `jax[cuda12-local]` (XLA's GPU compiler).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

# libtpu on a machine without a TPU: skip the cloud metadata query, and let several processes
# (pytest-xdist workers) load the library at once.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend import core as jax_core  # noqa: E402

from kernels._blocks import sublanes  # noqa: E402
from kernels._pallas import TRITON_CALL_MARKER, lower, on_target  # noqa: E402
from kernels._targets import TARGETS, Target  # noqa: E402

__all__ = ["KernelReport", "compile_kernels", "report", "resources", "launches", "pallas_calls",
           "distinct", "launch_key", "CASES", "main"]

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass
class KernelReport:
    """One kernel compiled for one target."""

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
    load_bytes: dict[int, int] | None = None  # global loads in the PTX: bytes each -> count
    mma: tuple[str, ...] | None = None  # the tensor-core instructions in the PTX
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


# ----------------------------------------------------------------------------- the kernels


def _sub_jaxprs(value: Any):
    values = value if isinstance(value, (tuple, list)) else [value]
    for v in values:
        if isinstance(v, jax_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jax_core.Jaxpr):
            yield v


def _find_pallas_calls(jaxpr, found: list) -> list:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                _find_pallas_calls(sub, found)
    return found


def _operands(eqn) -> str:
    return ", ".join(f"{jnp.dtype(v.aval.dtype).name}{list(v.aval.shape)}" for v in eqn.invars)


def launches(fn: Callable[..., Any], *args: Any, target: Target) -> list:
    """Every `pallas_call` equation that `fn(*args)` runs when traced for `target` (kernels
    called with `interpret=False`), in order: a kernel launched twice appears twice."""
    with on_target(target):
        jaxpr = jax.make_jaxpr(fn)(*args)
    return _find_pallas_calls(jaxpr.jaxpr, [])


def launch_key(eqn) -> tuple:
    """What makes two launches the same kernel: name, operands, grid and body."""
    return (eqn.params["name"], _operands(eqn), eqn.params["grid_mapping"].grid,
            str(eqn.params["jaxpr"]))


def pallas_calls(fn: Callable[..., Any], *args: Any, target: Target) -> list:
    """The distinct `launches` of `fn(*args)` for `target`, in order of appearance."""
    return distinct(launches(fn, *args, target=target))


def distinct(eqns: list) -> list:
    """`eqns` without repeats of the same kernel (`launch_key`), in order of appearance."""
    calls, seen = [], set()
    for eqn in eqns:
        key = launch_key(eqn)
        if key not in seen:
            seen.add(key)
            calls.append(eqn)
    return calls


def _bind(eqn) -> Callable[..., Any]:
    return lambda *operands: eqn.primitive.bind(*operands, **eqn.params)


def first_line(error: BaseException) -> str:
    """The compiler's first diagnostic line (with the next one when it only names a code)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return first[:400]


def _with_timeout(work: Callable[[], Any], timeout_s: float | None) -> Any:
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


# ----------------------------------------------------------------------------- Triton


def _triton_kernel(eqn, target: Target) -> tuple[str, dict[str, int]]:
    """The Triton-dialect text and launch parameters of one kernel lowered for `target`."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    module = lower(_bind(eqn), *avals, target=target).compiler_ir("stablehlo")
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
    return dict(shared_bytes=int(kernel.metadata.shared),
                registers=int(registers.group(1)) if registers else None,
                spill_bytes=int(spills.group(1)) if spills else None, load_bytes=load_bytes,
                mma=mma)


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


def _triton_report(eqn, target: Target, timeout_s: float | None) -> KernelReport:
    name, start = eqn.params["name"], time.perf_counter()
    report = KernelReport(name, target.name, False, None, eqn.params["grid_mapping"].grid,
                          _operands(eqn), 0.0, shared_limit=target.shared_memory)
    try:
        text, launch = _triton_kernel(eqn, target)
        report.num_warps, report.num_stages = launch["num_warps"], launch["num_stages"]
        report.grid = (launch["grid_x"], launch["grid_y"], launch["grid_z"])
        resources = _with_timeout(lambda: _compile_triton(text, launch, target), timeout_s)
        report = dataclasses.replace(report, compiled=True, **resources)
    except Exception as error:  # noqa: BLE001 - the verdict is the report
        report.error = f"{name} for {target.name}: {first_line(error)}"
    report.seconds = time.perf_counter() - start
    if report.compiled and not report.fits:
        report.error = (f"{name} for {target.name}: needs {report.shared_bytes} bytes of shared "
                        f"memory (limit {report.shared_limit}), spills {report.spill_bytes} "
                        "bytes")
    return report


# ----------------------------------------------------------------------------- Mosaic


@functools.cache
def _tpu_device(target_name: str):
    from jax.experimental import topologies

    target = TARGETS[target_name]
    topology = topologies.get_topology_desc(platform="tpu", chips_per_host_bounds=(1, 1, 1),
                                            **dict(target.topology))
    return topology.devices[0]


def _padded_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of a VMEM buffer of `shape`: TPU memory tiles pad the last two dims."""
    dims = [d for d in shape if d is not None]
    if len(dims) >= 1:
        dims[-1] = -(-dims[-1] // 128) * 128
    if len(dims) >= 2:
        tile = sublanes(dtype)
        dims[-2] = -(-dims[-2] // tile) * tile
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def planned_vmem(eqn) -> int:
    """VMEM a Mosaic kernel's schedule plans: two buffers of each pipelined block, and its
    VMEM scratch."""
    grid_mapping = eqn.params["grid_mapping"]
    total = 0
    for mapping in grid_mapping.block_mappings:
        space = str(getattr(mapping.block_aval, "memory_space", "")).lower()
        if "any" in space or "smem" in space or "hbm" in space:
            continue
        block = [b for b in mapping.block_aval.shape]
        total += 2 * _padded_bytes(block, mapping.array_aval.dtype)
    for aval in grid_mapping.scratch_avals:
        if "vmem" in str(getattr(aval, "memory_space", "")).lower():
            total += _padded_bytes(aval.shape, aval.dtype)
    return total


def _mosaic_report(eqn, target: Target, timeout_s: float | None) -> KernelReport:
    name, start = eqn.params["name"], time.perf_counter()
    limit = eqn.params["compiler_params"].vmem_limit_bytes or target.scoped_vmem
    report = KernelReport(name, target.name, False, None, eqn.params["grid_mapping"].grid,
                          _operands(eqn), 0.0, vmem_planned=planned_vmem(eqn), vmem_limit=limit)
    try:
        device = _tpu_device(target.name)
        sharding = jax.sharding.SingleDeviceSharding(device)
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)
                 for v in eqn.invars]
        compiled = _with_timeout(lower(_bind(eqn), *avals, target=target).compile, timeout_s)
        stats = compiled.memory_analysis()
        report.memory = {key: int(getattr(stats, f"{key}_size_in_bytes"))
                         for key in ("argument", "output", "temp", "generated_code")}
        report.compiled = True
    except Exception as error:  # noqa: BLE001 - the verdict is the report
        report.error = f"{name} for {target.name}: {first_line(error)}"
    report.seconds = time.perf_counter() - start
    return report


# ----------------------------------------------------------------------------- entry points


def compile_kernels(fn: Callable[..., Any], *args: Any, target: str,
                    timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[KernelReport]:
    """Compiles each kernel that `fn(*args)` launches for `target` (a key of `TARGETS`).

    `fn` calls the ops with `implementation="triton"` (GPU targets) or `"mosaic"` (TPU
    targets) and `interpret=False`; `args` are arrays or `jax.ShapeDtypeStruct`s. Returns one
    report per distinct kernel; a compiler error becomes a report's `error`, not an exception.
    """
    chosen = TARGETS[target]
    return [report(eqn, chosen, timeout_s) for eqn in pallas_calls(fn, *args, target=chosen)]


def report(eqn, target: Target, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> KernelReport:
    """Compiles one `pallas_call` equation (from `pallas_calls`) for `target`."""
    compile_one = _triton_report if target.platform == "gpu" else _mosaic_report
    return compile_one(eqn, target, timeout_s)


def implementation_for(target: str) -> str:
    return "triton" if TARGETS[target].platform == "gpu" else "mosaic"


# ----------------------------------------------------------------------------- realistic cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape: `call(implementation, *arrays)` runs it; the compiled function is
    its forward and its gradient with respect to every float argument."""

    op: str
    description: str
    args: tuple[jax.ShapeDtypeStruct, ...]
    call: Callable[..., Any]
    design: bool = False  # one of the device-sized shapes the bench's design figures show

    def function(self, implementation: str) -> Callable[..., Any]:
        def forward_and_backward(*arrays):
            def loss(*xs):
                return jnp.sum(self.call(implementation, *xs).astype(jnp.float32))

            float_args = tuple(i for i, a in enumerate(arrays)
                               if jnp.issubdtype(a.dtype, jnp.floating))
            return jax.value_and_grad(loss, argnums=float_args)(*arrays)

        return forward_and_backward


def _spec(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _matmul_case(a_shape, b_shape, dtype) -> Case:
    import kernels

    return Case("matmul", f"{'x'.join(map(str, a_shape))} @ {'x'.join(map(str, b_shape))} "
                f"{jnp.dtype(dtype).name}", (_spec(a_shape, dtype), _spec(b_shape, dtype)),
                lambda impl, a, b: kernels.matmul(a, b, implementation=impl, interpret=False))


def _conv_case(x_shape, w_shape, dtype, **options) -> Case:
    import kernels

    extra = "".join(f", {k}={v}" for k, v in options.items())
    return Case("conv2d", f"{'x'.join(map(str, x_shape))} * {'x'.join(map(str, w_shape))} "
                f"{jnp.dtype(dtype).name}{extra}", (_spec(x_shape, dtype), _spec(w_shape, dtype)),
                lambda impl, x, w: kernels.conv2d(x, w, implementation=impl, interpret=False,
                                                  **options))


def _normalize_case(op: str, shape, dtype, axis=-1, params=True, **options) -> Case:
    import kernels

    axes = (axis,) if isinstance(axis, int) else axis
    param_shape = tuple(shape[a] for a in sorted(a % len(shape) for a in axes))
    fn = getattr(kernels, op)
    count = {"normalize": 2, "layer_norm": 2, "rms_norm": 1}[op] if params else 0
    args = (_spec(shape, dtype),) + (_spec(param_shape, jnp.float32),) * count
    return Case("normalize", f"{op} {'x'.join(map(str, shape))} {jnp.dtype(dtype).name} "
                f"axis={axis}", args,
                lambda impl, x, *p: fn(x, *p, axis=axis, implementation=impl, interpret=False,
                                       **options))


def _gather_case(table_shape, num_ids, dtype, axis=0, mode=None) -> Case:
    import kernels

    return Case("gather", f"table {'x'.join(map(str, table_shape))} {jnp.dtype(dtype).name}, "
                f"{num_ids} ids, axis={axis}, mode={mode}",
                (_spec(table_shape, dtype), _spec((num_ids,), jnp.int32)),
                lambda impl, x, i: kernels.gather(x, i, axis=axis, mode=mode,
                                                  implementation=impl, interpret=False))


def _design(case: Case) -> Case:
    return dataclasses.replace(case, design=True)


def _cases() -> dict[str, list[Case]]:
    """The bench's device shapes, the shapes of models people train, and odd small ones;
    `_design` marks those the bench's design figures show."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    return {
        "matmul": [
            _design(_matmul_case((1024, 1024), (1024, 1024), f32)),
            _matmul_case((1024, 1024), (1024, 1024), bf16),
            _matmul_case((4096, 4096), (4096, 4096), f32),
            _design(_matmul_case((4096, 4096), (4096, 4096), bf16)),
            _matmul_case((8192, 4096), (4096, 1024), f32),
            _design(_matmul_case((8192, 4096), (4096, 1024), bf16)),
            _design(_matmul_case((16, 4096), (4096, 4096), bf16)),  # decode: split K
            _matmul_case((129, 65), (65, 257), f32),
            _matmul_case((8, 1000, 1000), (8, 1000, 1000), bf16),
            _matmul_case((7, 5), (5, 13), f32),
        ],
        "conv2d": [
            _design(_conv_case((32, 56, 56, 64), (3, 3, 64, 64), bf16)),
            _design(_conv_case((32, 56, 56, 64), (1, 1, 64, 256), bf16)),
            _design(_conv_case((32, 28, 28, 128), (3, 3, 128, 256), bf16, stride=2)),
            _design(_conv_case((32, 112, 112, 32), (3, 3, 1, 32), bf16, feature_group_count=32)),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 128), f32),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 128), bf16),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 256), f32, stride=2),
            _conv_case((2, 33, 65, 65), (3, 3, 65, 129), f32),
            _conv_case((8, 56, 56, 96), (7, 7, 1, 96), bf16, feature_group_count=96),  # ConvNeXt
            _conv_case((1, 9, 17, 8), (3, 3, 8, 16), f32, stride=2),
        ],
        "normalize": [
            _design(_normalize_case("layer_norm", (8192, 1024), bf16)),
            _design(_normalize_case("layer_norm", (4096, 8192), bf16)),
            _normalize_case("rms_norm", (4096, 8192), bf16),
            _normalize_case("layer_norm", (512, 16384), f32),
            _normalize_case("rms_norm", (512, 16384), f32),
            _normalize_case("normalize", (4096, 8192), bf16, axis=0),
            _normalize_case("normalize", (10000, 100), f32, axis=0, params=False, epsilon=0.0),
            _design(_normalize_case("normalize", (1048576, 64), f32, axis=0)),
            _design(_normalize_case("normalize", (32, 56, 56, 256), bf16, axis=(0, 1, 2))),
            _normalize_case("normalize", (8, 64, 4096), f32, axis=(0, 2)),
            _normalize_case("layer_norm", (7, 129), f32),
        ],
        "gather": [
            _design(_gather_case((32000, 4096), 8192, bf16)),
            _gather_case((32000, 4096), 8192, f32),
            _gather_case((32000, 4096), 8192, bf16, mode="fill"),
            _gather_case((8, 1000, 257), 64, f32, axis=1),
            _gather_case((129, 257), 7, bf16, mode="fill"),
        ],
    }


CASES = _cases()


# ----------------------------------------------------------------------------- command line


def resources(r: KernelReport) -> str:
    """A report's resources in one line: Triton's shared memory, registers and spills, or
    Mosaic's planned VMEM against its limit."""
    if r.shared_limit is not None:
        return (f"smem {r.shared_bytes}/{r.shared_limit} regs {r.registers} "
                f"spill {r.spill_bytes} warps {r.num_warps} stages {r.num_stages} "
                f"loads {'/'.join(f'{b}B' for b in sorted(r.load_bytes, reverse=True))}"
                if r.compiled else "")
    return f"vmem {r.vmem_planned / 2**20:.1f}/{r.vmem_limit / 2**20:.0f} MiB (planned/limit)"


def _row(case: Case, r: KernelReport) -> dict[str, Any]:
    return {"op": case.op, "case": case.description, "kernel": r.name, "target": r.target,
            "verdict": "ok" if r.fits else "FAIL", "grid": "x".join(map(str, r.grid)),
            "resources": resources(r), "seconds": round(r.seconds, 2), "error": r.error}


def _programs_main(args: argparse.Namespace, targets: list[str]) -> int:
    from kernels import programs

    implementations = [None if i == "default" else i for i in args.implementations.split(",")]
    rows, failures = [], 0
    for target in targets:
        chosen = [name for name, p in programs.PROGRAMS.items() if p.op in args.ops.split(",")]
        for r in programs.compile_ops(target, args.devices, args.mesh.split(","),
                                      implementations, chosen):
            # The library's own refusal (a Mosaic kernel on Auto TPU axes) names what works.
            refused = not r.compiled and r.error.startswith("NotImplementedError")
            verdict = "ok" if r.compiled else "refused" if refused else "FAIL"
            row = {**dataclasses.asdict(r), "verdict": verdict}
            failures += verdict == "FAIL"
            rows.append(row)
            collectives = ", ".join(f"{n} {c}" for n, c in r.collectives if c) or "none"
            print(f"{verdict:7}  {target:5}  {r.devices} device(s) "
                  f"{r.mesh:8}  {r.implementation:6}  {r.program:18}  kernel calls "
                  f"{r.kernel_calls:2}  collectives: {collectives}  {r.seconds:.1f}s"
                  + (f"\n      {r.error}" if r.error else ""), flush=True)
    return _finish(rows, failures, args.json,
                   f"{len(rows)} programs, {failures} failed to compile, "
                   f"{sum(r['verdict'] == 'refused' for r in rows)} refused before compiling "
                   "(compiled on this machine for compile-only devices; nothing here ran on a "
                   "device)")


def _finish(rows: list[dict[str, Any]], failures: int, json_path: str | None,
            summary: str) -> int:
    print(summary)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated ops")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    parser.add_argument("--json", metavar="PATH", help="also write every report to PATH")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per kernel compile")
    parser.add_argument("--programs", action="store_true",
                        help="compile whole programs (kernels.programs) instead of kernels")
    parser.add_argument("--devices", type=int, default=4, choices=(4, 8),
                        help="--programs: devices of the Auto and Explicit meshes")
    parser.add_argument("--mesh", default="one,auto,explicit",
                        help="--programs: comma-separated mesh kinds (one, auto, explicit)")
    parser.add_argument("--implementations", default="default,kernel",
                        help="--programs: comma-separated: default, kernel, xla, triton, mosaic")
    args = parser.parse_args(argv)
    ops, targets = args.ops.split(","), args.targets.split(",")
    for name, chosen, known in (("ops", ops, CASES), ("targets", targets, TARGETS)):
        unknown = [x for x in chosen if x not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; choose from {list(known)}")
    if args.programs:
        return _programs_main(args, targets)
    rows, failures = [], 0
    for op in ops:
        for case in CASES[op]:
            for target in targets:
                for report in compile_kernels(case.function(implementation_for(target)),
                                              *case.args, target=target,
                                              timeout_s=args.timeout):
                    row = _row(case, report)
                    failures += row["verdict"] != "ok"
                    rows.append(row)
                    print(f"{row['verdict']:4}  {target:5}  {report.name:40}  {case.description:52}"
                          f"  grid {row['grid']:14}  {row['resources']}  {row['seconds']:.1f}s"
                          + (f"\n      {report.error}" if report.error else ""), flush=True)
    return _finish(rows, failures, args.json,
                   f"{len(rows)} kernel compiles, {failures} failed or over budget (compiled on "
                   "this machine for the named targets; nothing here ran on a device)")


if __name__ == "__main__":
    sys.exit(main())
