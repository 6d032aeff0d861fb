"""Design figures: what every kernel launch of an op would do on an H100 and a TPU v5e, worked
out on any machine (no device needed) at the device-sized shapes of `kernels.compile.CASES`
marked `design`: a training step's forward and backward, and for a case marked `inference`
(a fused layer) the forward alone too, each beside XLA's own program of the same work.

Per launch: the grid and its programs, against the H100's 132 SMs (waves; fewer than two leave
SMs idle) or, on a TPU, the sequential grid steps of its one core; the flops and bytes the
kernel's cost estimate states, the flops against the op's forward (`op_flops`, which each
backward kernel of a matmul or convolution needs too; a strided convolution's input gradient
runs as several launches that share it), the bytes beside the launch's operands and outputs
taken once (`min_bytes`; a gather touches only the rows it gathers of its table); and, with the
compilers installed (the `test` extra), what the real back end reports: shared memory,
registers and spills (Triton) or planned VMEM (Mosaic).

The stated bytes count re-reads. Mosaic: what the BlockSpec pipeline copies (a block each
time its index changes; `kernels._traffic.pipelined_bytes`), plus the kernel's own DMAs.
Triton matmul and conv2d: the loads the programs issue (each tile's A and B panels; each
output pixel's patch per output-channel block), of which L2 and L1 serve much on a GPU, so
for them it bounds the HBM traffic from above. Triton normalize and gather: their programs
read disjoint tiles, so each launch states its own passes (a split normalize reads x once for
its moments and again to normalize).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from bench.harness import aligned
from kernels import _targets, registry
from kernels.compile import CASES, distinct, launch_key, launches, report, resources
from kernels.compile.api import missing_package
from kernels.compile.launches import grid_of
from kernels.ops import OPS

DEVICE_NAMES = {"sm_90": "H100", "v5e": "TPU v5e"}  # the design targets, as the summary names them
TARGETS = tuple(DEVICE_NAMES)
_FIGURE_COLUMNS = ["kernel", "grid", "programs", "waves/steps", "flops vs op", "HBM MB est.",
                   "operands MB", "streamed us", "compiled"]


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
        out = jax.eval_shape(case.forward(registry.REFERENCE), *case.args)
        return 2 * out.size * kh * kw * cg
    return None


MODES = {"training": "forward and backward", "inference": "inference (forward)"}
# The ops whose kernels' whole programs are compiled beside XLA's (`_program_row`) and counted
# alike, each kernel its operands and results once, every XLA pass between them included (a
# fused layer's dZ, a float32 operand's K-major copy). A GEMM launch's own figure states the
# panel loads its programs issue, mostly served by L2, so only the programs compare with XLA's.
# (A gather kernel reads only the gathered rows of its table operand: its launches' figures
# are the ones to sum.)
_PROGRAM_OPS = ("matmul", "conv2d")


def rows(ops: list[str], compile_kernels: bool = True) -> Iterator[dict]:
    """One row per distinct kernel launch of each design case, per target, mode (`MODES`) and
    implementation whose kernels run there, labelled with the parts of the op it computes
    (`launch`: "forward, dX" where the input gradient runs the forward's very kernel); then, on
    a GPU and with the compilers, one row for XLA's own program of the same work and, for
    `_PROGRAM_OPS`, one for each kernel implementation's (`_program_row`)."""
    for op in ops:
        for case in (c for c in CASES[op] if c.design):
            for mode in ("training", "inference") if case.inference else ("training",):
                for name in TARGETS:
                    yield from _target_rows(case, mode, _targets.TARGETS[name], compile_kernels)


def _target_rows(case, mode: str, target, compile_kernels: bool) -> Iterator[dict]:
    for implementation in _implementations(case.op, target):
        fn = (case.function if mode == "training" else case.forward)(implementation)
        every = launches(fn, *case.args, target=target)
        roles: dict[tuple, list[str]] = {}
        labels = (_roles(case, implementation, target, every) if mode == "training"
                  else _numbered("forward", len(every)))
        for eqn, role in zip(every, labels, strict=True):
            roles.setdefault(launch_key(eqn), []).append(role)
        for eqn in distinct(every):
            yield {**_row(case, eqn, target, implementation, compile_kernels), "mode": mode,
                   "launch": ", ".join(roles[launch_key(eqn)]),
                   "count": len(roles[launch_key(eqn)]), "program": False}
    if target.platform == "gpu" and compile_kernels:
        programs = _implementations(case.op, target) if case.op in _PROGRAM_OPS else []
        for implementation in [registry.REFERENCE, *programs]:
            yield _program_row(case, target, mode, implementation)


def _implementations(op: str, target) -> list[str]:
    """The kernels of `op` that run compiled on `target` and that the installed jax has."""
    return [name for name in registry.kernel_names()
            if registry.runs_natively(name, target.lowering_platform, target)
            and OPS[op].has(name) and not registry.unavailable(name)]


# Normalize and gather kernels are named for what they compute.
_NAMED_ROLES = {"normalize_moments": "forward: moments", "normalize_forward": "forward",
                "normalize_sums": "backward: sums", "normalize_backward": "backward",
                "gather": "forward", "scatter_add_pieces": "backward: pieces",
                "scatter_add": "backward: scatter-add"}


def _roles(case, implementation: str, target, every: list) -> list[str]:
    """What each of `every` launch computes, in launch order. Matmul and conv2d: the forward's
    launches (traced alone), then dA and dB, or dX (one launch per sub-pixel phase of a
    strided convolution) and dW, the last launch."""
    if case.op not in ("matmul", "conv2d"):
        return [_NAMED_ROLES[eqn.params["name"].removesuffix(f"_{implementation}")]
                for eqn in every]
    forward = len(launches(lambda *arrays: case.call(implementation, *arrays), *case.args,
                           target=target))
    backward = len(every) - forward
    if case.op == "matmul":
        return _numbered("forward", forward) + ["dA", "dB"][:backward]
    return _numbered("forward", forward) + _numbered("dX", backward - 1, "phase") + ["dW"]


def _numbered(role: str, count: int, part: str = "part") -> list[str]:
    return [role] if count == 1 else [f"{role} {part} {k}" for k in range(1, count + 1)]


def _row(case, eqn, target, implementation: str, compile_kernels: bool) -> dict:
    grid = grid_of(eqn)
    programs = math.prod(grid)
    cost = eqn.params.get("cost_estimate")
    min_bytes = _bytes(v.aval for v in eqn.invars) + _bytes(v.aval for v in eqn.outvars)
    row = {"op": case.op, "case": case.description, "target": target.name,
           "implementation": implementation, "kernel": eqn.params["name"],
           "grid": "x".join(map(str, grid)), "programs": programs,
           "waves": programs / target.num_sms if target.num_sms else None,
           "flops": cost.flops if cost else None, "op_flops": _op_flops(case),
           "bytes": cost.bytes_accessed if cost else None, "min_bytes": min_bytes,
           "resources": "not compiled"}
    row["streamed_us"] = _streamed_us(case, target, row["bytes"])
    missing = missing_package(implementation)
    if compile_kernels and missing:
        row["resources"] = f"not compiled: {missing} is not installed (the test extra)"
    elif compile_kernels:
        r = report(eqn, target, implementation=implementation)
        row["resources"] = resources(r) if r.compiled else f"FAIL {r.error}"
    return row


def _program_row(case, target, mode: str, implementation: str) -> dict:
    """The whole program of the case's layer with `implementation` (training: forward output
    and gradient from a cotangent; inference: the output), compiled for `target`: its launches
    and the bytes XLA's cost analysis states (`kernels.compile.programs.layer_program`: each
    kernel or library call its operands and results once), beside the layer's operands and
    results once."""
    name = ("XLA's program" if implementation == registry.REFERENCE
            else f"{implementation}'s program")
    row = {"op": case.op, "case": case.description, "target": target.name, "mode": mode,
           "implementation": implementation, "kernel": name, "program": True,
           "launch": MODES[mode], "count": 1, "grid": "-", "programs": None,
           "waves": None,
           "flops": None, "op_flops": _op_flops(case), "bytes": None, "min_bytes": None,
           "streamed_us": None, "resources": "not compiled"}
    missing = missing_package("mosaic_gpu")  # XLA's GPU compiler: the CUDA plugin
    if missing:
        row["resources"] = f"not compiled: {missing} is not installed (the test extra)"
        return row
    from kernels.compile.programs import layer_program

    out = jax.eval_shape(case.forward(registry.REFERENCE), *case.args)
    floats = [a for a in case.args if jnp.issubdtype(a.dtype, jnp.floating)]
    kernels, nbytes = layer_program(case, target.name, implementation,
                                    training=mode == "training")
    once = [*case.args, out, out, *floats] if mode == "training" else [*case.args, out]
    return {**row, "grid": f"{kernels} kernels", "bytes": nbytes, "min_bytes": _bytes(once),
            "resources": "XLA" if implementation == registry.REFERENCE else "XLA program"}


def _streamed_us(case, target, nbytes: int | None) -> float | None:
    """The design model of a memory-bound launch's time on a GPU: its bytes at
    `_targets.STREAMING_SHARE` of the bandwidth (`Target.streaming_seconds`); None for the
    compute-bound ops (`_op_flops`) and on a TPU. Not for XLA's programs: its cost analysis
    counts each fusion's operands whole, more than its recorded times can have moved."""
    if target.platform != "gpu" or nbytes is None or _op_flops(case) is not None:
        return None
    return target.streaming_seconds(nbytes) * 1e6


def _ratio(value, floor) -> str:
    return "-" if value is None or not floor else f"{value / floor:.2f}x"


def _megabytes(value) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def table(design_rows: list[dict]) -> str:
    """Every launch as one row of one table (`--design full`)."""
    header = ["op", "case", "target", "launch", *_FIGURE_COLUMNS]
    cells = [[r["op"], r["case"], r["target"], r["launch"], *_figures(r)] for r in design_rows]
    return aligned(header, cells)


def _figures(r: dict) -> list[str]:
    return [r["kernel"], r["grid"], str(r["programs"] or "-"), _occupancy(r),
            _ratio(r["flops"], r["op_flops"]), _megabytes(r["bytes"]),
            _megabytes(r["min_bytes"]),
            "-" if r["streamed_us"] is None else f"{r['streamed_us']:.1f}", r["resources"]]


def _occupancy(r: dict) -> str:
    if r["program"]:
        return "-"
    return f"{r['waves']:.1f} waves" if r["waves"] is not None else f"{r['programs']} steps"


def _program_bytes(case_rows: list[dict]) -> dict[str, tuple[float, str]]:
    """Per implementation on one target: (bytes, how many kernels) of its whole program where
    it was compiled (XLA's always), else of every launch counted as often as it runs."""
    totals = {}
    for (name,), rows in _groups(case_rows, ("implementation",)).items():
        rows = [r for r in rows if r["program"]] or rows
        if all(r["bytes"] is not None for r in rows):
            totals[name] = (sum(r["bytes"] * r["count"] for r in rows),
                            f" ({rows[0]['grid']})" if rows[0]["program"] else "")
    return totals


def _totals(case_rows: list[dict]) -> str:
    """"triton 500.1 MB, xla 700.2 MB (5 kernels)": `_program_bytes` as a person reads it."""
    return ", ".join(f"{name} {nbytes / 1e6:.1f} MB{kernels}"
                     for name, (nbytes, kernels) in _program_bytes(case_rows).items())


def grouped(design_rows: list[dict]) -> str:
    """The launches grouped per op and case, each case a small table of its launches per
    target (the default view)."""
    blocks = []
    for (op, case, mode), case_rows in _groups(design_rows, ("op", "case", "mode")).items():
        cells = [[DEVICE_NAMES[r["target"]] if i == 0 else "", r["launch"], *_figures(r)[:-1],
                  "-" if r["resources"].startswith("not compiled") else r["resources"]]
                 for target_rows in _groups(case_rows, ("target",)).values()
                 for i, r in enumerate(target_rows)]
        table_text = aligned(["target", "launch", *_FIGURE_COLUMNS], cells)
        totals = [f"  {DEVICE_NAMES[target]}, {MODES[mode]}: {_totals(rows)}"
                  for (target,), rows in _groups(case_rows, ("target",)).items()
                  if _totals(rows)]
        title = f"{op}: {case}" + ("" if mode == "training" else f", {MODES[mode]}")
        blocks.append(title + "\n" + "\n".join(
            ["  " + line for line in table_text.splitlines()] + totals))
    return "\n\n".join(blocks)


def _groups(design_rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in design_rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def target_line(design_rows: list[dict], target: str) -> str:
    """What an op's design figures say for one target, in a line (empty where it has no design
    case there): per implementation its launches, the least occupied one, the most bytes
    against the operands and what the compiler reported; then, where XLA's own program was
    compiled, each implementation's bytes against it over the cases (`--design grouped` names
    the launch and case behind each figure)."""
    rows = [r for r in design_rows if r["target"] == target]
    kernels = [r for r in rows if not r["program"]]
    parts = [f"{name} {_launches_line(launches, target)}"
             for (name,), launches in _groups(kernels, ("implementation",)).items()]
    ratios: dict[tuple[str, str], list[float]] = {}
    for (_, mode), case_rows in _groups(rows, ("case", "mode")).items():
        totals = _program_bytes(case_rows)
        xla = totals.pop(registry.REFERENCE, (None,))[0]
        for name, (nbytes, _) in totals.items() if xla else ():
            ratios.setdefault((name, mode), []).append(nbytes / xla)
    if ratios:
        parts.append("bytes vs XLA's program: " + "; ".join(
            f"{name} " + ", ".join(f"{_range(values)} ({mode})"
                                   for (of, mode), values in ratios.items() if of == name)
            for name in dict.fromkeys(name for name, _ in ratios)))
    return "; ".join(parts)


def _range(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _launches_line(launches: list[dict], target: str) -> str:
    if target == "sm_90":
        occupancy = f"fewest waves {min(r['waves'] for r in launches):.1f}"
    else:
        steps = [r["programs"] for r in launches]
        occupancy = f"grid steps {min(steps)}-{max(steps)}"
    stated = [r["bytes"] / r["min_bytes"] for r in launches if r["bytes"] and r["min_bytes"]]
    traffic = f", HBM est. at most {max(stated):.1f}x its operands" if stated else ""
    failed = [r for r in launches if r["resources"].startswith("FAIL")]
    unknown = all(r["resources"].startswith("not compiled") for r in launches)
    compiled = ("" if unknown else f", {len(failed)} failed to compile" if failed
                else ", all compile within budget")
    return f"{len(launches)} launches, {occupancy}{traffic}{compiled}"


def compiler_note(design_rows: list[dict]) -> str:
    """One line on the compiled-resources column: what it shows, or how to get it."""
    missing = sorted({r["resources"].split(": ", 1)[1].split(" is not")[0] for r in design_rows
                      if r["resources"].startswith("not compiled: ")})
    if not missing:
        return ("compiled: the real compiler's report for that target (Triton: shared memory, "
                "registers, spills, load widths; Mosaic GPU: ptxas's registers and spills, "
                "its shared memory; libtpu: planned VMEM against the limit); XLA: its own "
                "program of the layer, compiled for an H100.")
    return (f"compiled: not shown, {' and '.join(missing)} not installed here; "
            "pip install -e '.[test]' brings Triton's compiler, libtpu and XLA's GPU compiler "
            "(the CUDA plugin), which compile for these targets on a CPU.")


LEGEND = ("Design figures (no device needed): every launch of the forward and backward at "
          "device sizes, worked out for an H100 and a TPU v5e. waves = programs / 132 SMs "
          "(under 2 leaves SMs idle); a v5e core runs its grid steps in order. flops vs op: "
          "the kernel's cost estimate over the op's forward flops (each matmul or conv "
          "backward launch needs the same; a strided conv's dX phases share them). HBM MB "
          "est.: the bytes the kernel's cost estimate states, re-reads included (Mosaic: its "
          "pipeline's block copies; Triton matmul/conv: the loads its programs issue, much of "
          "them served by L2/L1); operands MB: its inputs and outputs, each once (a gather "
          "reads only the rows it gathers). XLA's program: the same layer (forward output and "
          "gradient from a cotangent) as XLA itself compiles it for an H100, its kernels and "
          "the bytes XLA's cost analysis states; each case's last lines sum every "
          "implementation's launches, as often as each runs (not the small XLA work around "
          "them: the backward's sort of the ids, a padding copy). streamed us: a memory-bound "
          f"kernel launch's HBM bytes at {_targets.STREAMING_SHARE:.0%} of the H100's "
          "bandwidth (`_targets.STREAMING_SHARE`: the H100 record's fastest row), the time it "
          "is expected at where it keeps enough bytes in flight.")
