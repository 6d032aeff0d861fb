"""Every op on a mesh: per-shard kernels, shardings, collectives (see kernels/partition/).

The cases run in subprocesses (`sharded_run.py`, `multiprocess_run.py`): the fake CPU device
count must be set before jax starts, and this suite's own process has one device.
"""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from kernels import registry
from kernels.ops import OPS
from tests.support import (IMPLEMENTATIONS, dot_platform, implementations_of, kernels_of,
                           subprocess_env, tolerance)

HERE = Path(__file__).parent
# Every op's sharded cases (kernels/<op>/cases.py: `sharded`), and those whose rule sums
# per-shard partials in the forward pass (`REDUCING`: a sharded contraction or normalized axis,
# a vocab-parallel table).
CASE_OP = {name: op.name for op in OPS.values() for name in op.cases.sharded(registry.REFERENCE)}
CASES = tuple(CASE_OP)
REDUCING = set().union(*(op.cases.REDUCING for op in OPS.values()))
# The mesh kinds each implementation's cases run on. The partitioning (kernels/partition/
# and each op's sharding rule) is one code path for every kernel, so each mesh kind is proven
# with one kernel and each kernel under a mesh. JAX's own op (xla) runs under Explicit axes,
# where JAX alone would raise for some cases (a sharded contraction, a vocab-parallel table)
# and is given the kernels' sharding; each kernel run also compares its output sharding with
# xla's under its own mesh kind.
# A kernel whose compiled calls partition on Auto axes (`auto_axes`) runs under Auto axes.
# An interpreter that runs only through host callbacks (Mosaic GPU's) declines a mesh of
# several devices (`partition.check_partitionable`, tested below): its kernels' sharding is
# proven compiled, on GPU meshes (tests/test_normalize_mosaic_gpu.py).
SHARDED = tuple(name for name in IMPLEMENTATIONS
                if True not in registry.get(name).interpreter_callbacks)
MESH_KINDS = {name: ("Auto",) if registry.get(name).is_kernel and registry.get(name).auto_axes
              else ("Explicit",) for name in SHARDED}
RUNS = [(impl, kind) for impl in SHARDED for kind in MESH_KINDS[impl]]
# Each case runs for the implementations of its op (`implementations_of`); the shard_map and
# reduce-scatter programs use several ops, so the kernels every op has.
SHARDED_RUNS = [(impl, mesh, case) for impl, mesh in RUNS for case in CASES
                if impl in implementations_of(CASE_OP[case])]


def _sharded_kernels(op: str) -> list[str]:
    return [name for name in kernels_of(op) if name in SHARDED]


def _proving_kernel(op: str, case: str, cases: list[str]) -> str:
    """The kernel that runs `case` of `op` in the README's command: the op's cases taken in
    turn by its kernels, so each kernel runs under every mesh kind and each case runs with a
    kernel (the partitioning is one code path for every kernel); the other kernels' runs of
    the case are in the exhaustive tier."""
    kernels = _sharded_kernels(op)
    return kernels[cases.index(case) % len(kernels)]


def tiered(runs: list[tuple[str, str, str]], case_op: dict[str, str]) -> list:
    """`runs` as parameters, a kernel's run of a case marked exhaustive where another kernel
    proves that case in the README's command (`_proving_kernel`)."""
    def cases_of(op):
        return [case for case, of in case_op.items() if of == op]

    return [pytest.param(impl, mesh, case, marks=() if not registry.get(impl).is_kernel
                         or _proving_kernel(case_op[case], case, cases_of(case_op[case])) == impl
                         else pytest.mark.exhaustive) for impl, mesh, case in runs]


_results: dict[str, dict] = {}


def _selected_cases(items) -> dict[str, set[str]]:
    """impl -> the subprocess cases this session's selected tests read (`-m`, `-k`)."""
    selected: dict[str, set[str]] = {}
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if item.module.__name__.endswith("test_sharding") and params and "impl" in params:
            case = params.get("case", item.originalname)
            name = {"test_inside_shard_map": "shard_map",
                    "test_row_parallel_matmul_reduce_scatters_into_a_sharded_output":
                        "matmul/K-reduce-scatter",
                    "test_out_sharding_on_explicit_axes": f"out_sharding/{case}"}.get(
                        item.originalname, case)
            selected.setdefault(params["impl"], set()).add(name)
    return selected


@pytest.fixture(scope="session")
def results(tmp_path_factory, request):
    """impl -> {(case, mesh): record}. The first xdist worker to ask starts the subprocesses of
    all implementations at once, each running the cases this session's tests read (the
    others wait on its lock and read their files): run one after another, each kept a worker
    waiting on it with a core idle."""
    shared = tmp_path_factory.getbasetemp().parent

    def run(impl: str) -> dict:
        if impl not in _results:
            selected = _selected_cases(request.session.items)
            outputs = {name: shared / f"sharded-{name}.jsonl" for name in selected}
            with open(shared / "sharded.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not outputs[impl].exists():
                    _run_all(outputs, selected)
            records = [json.loads(line) for line in outputs[impl].read_text().splitlines()
                       if line.startswith("{")]
            _results[impl] = {(r["case"], r["mesh"]): r for r in records}
        return _results[impl]

    return run


def _run_all(outputs: dict[str, Path], selected: dict[str, set[str]]) -> None:
    procs = {name: subprocess.Popen([sys.executable, str(HERE / "sharded_run.py"), name,
                                     ",".join(MESH_KINDS[name]), ",".join(sorted(selected[name]))],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=subprocess_env(cpu_only=True), cwd=HERE.parent)
             for name in outputs}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        outputs[name].write_text(out)


@pytest.mark.parametrize("impl,mesh,case", tiered(SHARDED_RUNS, CASE_OP))
def test_sharded_call_equals_unsharded(results, impl, case, mesh, request):
    if impl == "xla" and case == "conv2d/spatial":
        # XLA's SPMD partitioner (jax 0.10.2 and 0.12, CPU) sums the weight gradient of a
        # spatially sharded convolution over the replicated "model" axis too: 4x too large.
        # Our kernels gather whole images (the documented fallback) and are right.
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="XLA: conv weight gradient over-summed on a 2-D mesh"))
    r = results(impl)[(case, mesh)]
    assert r["value_error"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["nan_match"], r
    assert r["grad_error"] <= _allowed(impl, CASE_OP[case], 1e-3, r["grad_scale"]), r


@pytest.mark.parametrize("impl,mesh,case", tiered([run for run in SHARDED_RUNS
                                                   if registry.get(run[0]).is_kernel], CASE_OP))
def test_sharding_and_collectives(results, impl, case, mesh):
    r = results(impl)[(case, mesh)]
    if case == "conv2d/spatial":  # documented fallback: whole images, gathered once
        assert r["forward"]["all-gather"] == 1, r
        return
    assert r["same_sharding_as_xla"], r
    assert r["forward"]["all-gather"] == 0 and r["backward"]["all-gather"] == 0, r
    assert r["forward"]["all-to-all"] == 0 and r["forward"]["collective-permute"] == 0, r
    reduces = r["forward"]["all-reduce"] + r["forward"]["reduce-scatter"]
    if case in REDUCING:
        assert 1 <= reduces <= 2, r  # one psum, or two for Chan's merge (mean, then M2)
    else:
        assert reduces == 0, r


# Every op's out_sharding cases on Explicit axes, given or not (`OUT_SHARDING`), and the ones
# whose kernels must reduce-scatter into the sharding asked for (`REDUCE_SCATTERS`).
OUT_SHARDING_OP = {name: op.name for op in OPS.values() for name in op.cases.OUT_SHARDING}
REDUCE_SCATTERS = set().union(*(op.cases.REDUCE_SCATTERS for op in OPS.values()))


@pytest.mark.parametrize("impl,mesh,case", tiered([
    (impl, mesh, case) for case, op in OUT_SHARDING_OP.items()
    for impl, mesh in [(impl, "Explicit") for impl in implementations_of(op) if impl in SHARDED]
    + [(registry.REFERENCE, "Explicit, default")]], OUT_SHARDING_OP))
def test_out_sharding_on_explicit_axes(results, impl, mesh, case):
    """Every implementation and the default (xla on a CPU) run each case (none raises), with
    the values and gradients of the unsharded call, the output sharded as asked (or, not
    asked, as the kernels shard it), and each gradient typed like its primal. The kernels
    honour the sharding through their rules: a sharded contraction reduce-scatters into it."""
    r = results(impl)[(f"out_sharding/{case}", mesh)]
    assert r["value_error"] <= 1e-5 * max(1.0, r["scale"]), r
    assert r["nan_match"], r
    assert r["grad_error"] <= _allowed(impl, OUT_SHARDING_OP[case], 1e-3, r["grad_scale"]), r
    assert r["same_spec"] and r["grad_specs_match"], r
    if registry.get(impl).is_kernel and case in REDUCE_SCATTERS:
        assert r["forward"]["reduce-scatter"] == 1 and r["forward"]["all-reduce"] == 0, r
        assert r["forward"]["all-gather"] == 0 and r["forward"]["collective-permute"] == 0, r


@pytest.mark.parametrize("impl", [k for k in kernels_of(None) if k in SHARDED])
def test_inside_shard_map(results, impl):
    r = results(impl)[("shard_map", "Manual")]
    assert r["value_error"] <= _allowed(impl, "matmul", 1e-5 * max(1.0, r["scale"]),
                                        r["scale"]), r
    assert r["grad_error"] <= 1e-3, r


@pytest.mark.parametrize("impl", [k for k in kernels_of(None) if k in SHARDED])
def test_row_parallel_matmul_reduce_scatters_into_a_sharded_output(results, impl):
    r = results(impl)[("matmul/K-reduce-scatter", "Auto")]
    assert r["value_error"] <= _allowed(impl, "matmul", 1e-4, r["scale"]), r
    assert r["forward"]["reduce-scatter"] == 1 and r["forward"]["all-reduce"] == 0, r
    assert r["forward"]["all-gather"] == 0, r


def _dot_rtol(impl: str) -> float:
    """The tolerance rule's relative allowance for `impl`'s float32 dots (`tolerance`, as
    `dot_platform` says `impl` computes them: TF32's for a GPU kernel)."""
    return tolerance(jnp.float32, dot=True, platform=dot_platform(impl))["rtol"]


def _allowed(impl: str, op: str, float32_allowed: float, scale: float) -> float:
    """`float32_allowed`, what float32 computations meet here; for a dot at least the rule's
    relative allowance of `scale` (the largest magnitude compared), which for a GPU kernel is
    TF32's: a sum that differs in its last float32 bit can round to a TF32 value one unit
    apart where it feeds the next product (a cotangent), and a reference in float32 differs
    by the TF32 rounding itself."""
    if op not in ("matmul", "conv2d"):
        return float32_allowed
    return max(float32_allowed, _dot_rtol(impl) * scale)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("impl", ["triton", pytest.param("mosaic", marks=pytest.mark.exhaustive)])
def test_two_processes(impl):
    """jax.distributed with two processes of 4 CPU devices each, over localhost (one kernel
    proves the mesh kind in the README's command, as `_proving_kernel` does)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_run.py"), str(i),
                               str(port), impl, str(_dot_rtol(impl))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=subprocess_env(cpu_only=True), cwd=HERE.parent)
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "RESULT ok" in out, out + err[-2000:]


def test_sharded_training_example():
    """examples/sharded_training.py: data- and tensor-parallel losses equal the unsharded run's."""
    done = subprocess.run([sys.executable, str(HERE.parent / "examples" / "sharded_training.py"),
                           "--steps", "2"], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(cpu_only=True), cwd=HERE.parent)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "losses match" in done.stdout, done.stdout


_STRICT_ON_A_MESH = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import kernels
from kernels import reference

x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
want = np.asarray(reference.layer_norm(jnp.asarray(x)))
layer_norm = lambda x: kernels.layer_norm(x, implementation="mosaic", interpret="strict")
for kind in ("Explicit", "Auto", "shard_map"):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(
        AxisType.Auto if kind == "Auto" else AxisType.Explicit,))
    fn = jax.jit(layer_norm if kind != "shard_map" else jax.shard_map(
        layer_norm, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        text = fn.lower(xs).as_text()
        got = np.asarray(fn(xs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(kind, "simulator" if "callback" in text else "hlo-interpreter")
"""


_SIXTEEN_BIT_EPILOGUE_ON_A_MESH = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import kernels

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
shapes = {"a": ((64, 32), P("data", None)), "b": ((32, 48), P(None, "model")),
          "bias": ((48,), P()), "residual": ((64, 48), P())}
whole = [jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
         for i, (shape, _) in enumerate(shapes.values())]


def loss(impl, out_sharding):
    def f(a, b, bias, residual):
        y = kernels.matmul(a, b, bias=bias, activation="gelu", residual=residual,
                           out_sharding=out_sharding, implementation=impl)
        return jnp.sum(y.astype(jnp.float32) ** 2)
    return f


want = jax.jit(jax.grad(loss("xla", None), argnums=(0, 1, 2, 3)))(*whole)
for impl in ("xla", "triton"):
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, spec))
                for x, (_, spec) in zip(whole, shapes.values())]
        grads = jax.jit(jax.grad(loss(impl, P("data", "model")), argnums=(0, 1, 2, 3)))(*args)
    for g, x, w in zip(grads, args, want):
        assert g.dtype == jnp.bfloat16 and g.sharding.is_equivalent_to(x.sharding, g.ndim)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2 ** -6, atol=2 ** -6 * float(jnp.max(jnp.abs(w))))
    print(impl, "typed like their primals")
"""


def test_sixteen_bit_epilogue_gradients_on_explicit_axes():
    """A bfloat16 column-parallel layer with a replicated bias and residual on Explicit axes:
    the 16-bit layer's gradient rule (the reference's own `custom_vjp`, and the kernels') gives
    each gradient its primal's sharding, as JAX's types demand, and the unsharded values
    (within bfloat16's rounding: the sharded sums run in another order)."""
    proc = subprocess.run([sys.executable, "-c", _SIXTEEN_BIT_EPILOGUE_ON_A_MESH],
                          capture_output=True, text=True, env=subprocess_env(cpu_only=True),
                          cwd=HERE.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["xla typed like their primals",
                                        "triton typed like their primals"]


def test_strict_mode_on_a_mesh():
    """"strict" keeps TPU interpret mode under Explicit axes and shard_map; only under Auto
    axes (XLA's partitioner, which cannot lower its host callbacks) does it give way to the
    HLO interpreter. Values are right every way."""
    proc = subprocess.run([sys.executable, "-c", _STRICT_ON_A_MESH], capture_output=True,
                          text=True, env=subprocess_env(cpu_only=True), cwd=HERE.parent,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["Explicit", "simulator", "Auto", "hlo-interpreter",
                                   "shard_map", "simulator"]
