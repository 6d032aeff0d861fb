"""Design figures: what every kernel launch of an op would do on an H100 and a TPU v5e, worked
out on any machine (no device needed) at the device-sized shapes of `kernels.compile.CASES`
marked `design`, forward and backward.

Per launch: the grid and its programs, against the H100's 132 SMs (waves; fewer than two leave
SMs idle) or, on a TPU, the sequential grid steps of its one core; the flops and bytes the
kernel's cost estimate states, the flops against the op's forward (`op_flops`, which each
backward kernel of a matmul or convolution needs too; a strided convolution's input gradient
runs as several launches that share it), the bytes beside the launch's operands and outputs
taken once (`min_bytes`; a gather touches only the rows it gathers of its table); and, with the
compilers installed (the `test` extra), what the real back end reports: shared memory,
registers and spills (Triton) or planned VMEM (Mosaic).

The stated bytes count re-reads. Mosaic: what the BlockSpec pipeline copies (a block each
time its index changes; `kernels._pallas.pipelined_bytes`), plus the kernel's own DMAs.
Triton matmul and conv2d: the loads the programs issue (each tile's A and B panels; each
output pixel's patch per output-channel block), of which L2 and L1 serve much on a GPU, so
for them it bounds the HBM traffic from above. Triton normalize and gather: their programs
read disjoint tiles, so each launch states its own passes (a split normalize reads x once for
its moments and again to normalize).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from bench.harness import aligned
from kernels import _targets
from kernels.compile import CASES, implementation_for, pallas_calls, report, resources

TARGETS = ("sm_90", "v5e")


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in avals)


def _op_flops(case) -> int | None:
    """Multiply-adds x 2 of the op's forward, for the ops whose kernels are compute-bound."""
    shapes = [a.shape for a in case.args]
    if case.op == "matmul":
        (*batch, m, k), n = shapes[0], shapes[1][-1]
        return 2 * math.prod(batch) * m * n * k
    if case.op == "conv2d":  # output pixels x channels x taps x input channels per group
        kh, kw, cg, _ = shapes[1]
        out = jax.eval_shape(lambda *arrays: case.call("xla", *arrays), *case.args)
        return 2 * out.size * kh * kw * cg
    return None


def rows(ops: list[str], compile_kernels: bool = True) -> Iterator[dict]:
    """One row per distinct kernel launch of each design case, per target."""
    for op in ops:
        for case in (c for c in CASES[op] if c.design):
            for name in TARGETS:
                target = _targets.TARGETS[name]
                fn = case.function(implementation_for(name))
                for eqn in pallas_calls(fn, *case.args, target=target):
                    yield _row(case, eqn, target, compile_kernels)


def _row(case, eqn, target, compile_kernels: bool) -> dict:
    grid = tuple(eqn.params["grid_mapping"].grid)
    programs = math.prod(grid)
    cost = eqn.params.get("cost_estimate")
    min_bytes = _bytes(v.aval for v in eqn.invars) + _bytes(v.aval for v in eqn.outvars)
    row = {"op": case.op, "case": case.description, "target": target.name,
           "kernel": eqn.params["name"], "grid": "x".join(map(str, grid)),
           "programs": programs,
           "waves": programs / target.num_sms if target.num_sms else None,
           "flops": cost.flops if cost else None, "op_flops": _op_flops(case),
           "bytes": cost.bytes_accessed if cost else None, "min_bytes": min_bytes,
           "resources": "not compiled"}
    compiler = "triton" if target.platform == "gpu" else "libtpu"
    if compile_kernels and importlib.util.find_spec(compiler) is None:
        row["resources"] = f"not compiled: {compiler} is not installed (the test extra)"
    elif compile_kernels:
        r = report(eqn, target)
        row["resources"] = resources(r) if r.compiled else f"FAIL {r.error}"
    return row


def _ratio(value, floor) -> str:
    return "-" if value is None or not floor else f"{value / floor:.2f}x"


def _megabytes(value) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def table(design_rows: list[dict]) -> str:
    header = ["op", "case", "target", "kernel", "grid", "programs", "waves/steps",
              "flops vs op", "HBM MB est.", "operands MB", "compiled"]
    cells = [[r["op"], r["case"], r["target"], r["kernel"], r["grid"], str(r["programs"]),
              f"{r['waves']:.1f} waves" if r["waves"] is not None else f"{r['programs']} steps",
              _ratio(r["flops"], r["op_flops"]), _megabytes(r["bytes"]),
              _megabytes(r["min_bytes"]), r["resources"]] for r in design_rows]
    return aligned(header, cells)


LEGEND = ("Design figures (no device needed): waves = programs / 132 SMs of an H100 (under 2 "
          "leaves SMs idle); TPU grid steps run in order on one v5e core. flops vs op: the "
          "kernel's cost estimate over the op's forward flops (each matmul or conv backward "
          "kernel needs the same; a strided conv's input-gradient phases share them). HBM MB "
          "est.: the bytes the kernel's cost estimate states, re-reads included (Mosaic: its "
          "pipeline's block copies; Triton matmul/conv: the loads its programs issue, much of "
          "them served by L2/L1); operands MB: its inputs and outputs, each once (a gather "
          "reads only the rows it gathers). compiled: the real compiler's report for that "
          "target.")
