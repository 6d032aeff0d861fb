"""`python -m bench`: time every op with every implementation this machine has.

On a GPU or TPU: the platform's kernel (natively) and `xla`, at realistic sizes. On a CPU:
`xla` at CPU-sized shapes, then the interpreted rows: the Triton and Mosaic kernels, forward
and backward, in the default (fast) interpreter at the sizes a model author's CPU test uses,
and the Mosaic kernels in the "strict" simulator on small grids. Interpreted rows are not
speed figures of the kernels: their ratio to `xla` is what running the kernels' own code
costs a CPU test, and their error column checks it against the reference.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import design, harness
from kernels import defaults, registry
from kernels.compile import use_compile_only_devices
from kernels.ops import OPS

# Each op's bench module, bench/<op>.py (its shapes are data in kernels/<op>/cases.py).
BENCHES = {name: importlib.import_module(f"bench.{name}") for name in OPS}
RECORDS = Path(__file__).parent / "records"
# --interpret value -> the interpreted plans run on a CPU: (shape set, implementations). The
# fast interpreter's rows at model-test sizes; the strict rows on small grids for the
# simulators, and for kernels with no fast interpreter (Mosaic GPU's interpreter).
_FAST = ("interpret", [*((name, True) for name in registry.kernel_names()
                         if registry.get(name).fast_interpreter), (registry.REFERENCE, False)])
_STRICT = ("strict", [*((name, "strict") for name in registry.kernel_names()
                        if registry.get(name).strict_simulator
                        or not registry.get(name).fast_interpreter),
                      (registry.REFERENCE, False)])
INTERPRET_CHOICES = {"both": [_FAST, _STRICT], "true": [_FAST], "strict": [_STRICT],
                     "false": []}


# What the two views of the rows show (`--rows`).
COMPARISON_LEGEND = (
    "Rows a person compares: each case's xla time in ms and every other implementation's time "
    "against it in the same run. On a CPU a kernel's column runs its own code in Pallas' fast "
    "interpreter (\"strict\": the TPU or Mosaic GPU simulator): its ratio is what that code "
    "costs a CPU test, not the kernel's speed on a device. max err: the largest relative error "
    "against the reference among them.")
ROWS_LEGEND = (
    "Every row. floor_*_us: the roofline floor on that device from the op's flop and byte "
    "counts (the larger of compute time and memory time). (interpret) and (strict) rows: as "
    "above, not speed figures; a timed part (a wrapper's copy) is named for its implementation.")


def _of_op(op: str, implementations: list[tuple[str, bool | str]]) -> list[tuple[str, bool | str]]:
    """The `implementations` that `op` has and the installed jax runs."""
    return [(name, mode) for name, mode in implementations
            if not registry.get(name).is_kernel
            or OPS[op].has(name) and not registry.unavailable(name)]


def record_path(device_kind: str, records: Path = RECORDS) -> Path:
    """Where the rows measured on `device_kind` are recorded (cited by kernels.defaults)."""
    return records / (re.sub(r"[^A-Za-z0-9]+", "_", device_kind).strip("_").lower() + ".json")


def summary(ops: list[str], rows: list[dict], design_rows: list[dict] | None,
            timer: dict) -> str:
    """What a person reads first: this machine and its timer, how far the kernels are proven,
    then per op its default on each platform and why, what its kernels cost a CPU test here,
    and what the design figures say for an H100 and a TPU v5e."""
    recorded = sorted(path.stem for path in RECORDS.glob("*.json"))
    lines = [
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices "
        f"{sorted({d.device_kind for d in jax.devices()})}",
        f"timer: {timer['method']}" + (f", floor {timer['floor_us']:.2f} us a call (rows whose "
                                       "roofline floor is under it are marked)"
                                       if "floor_us" in timer else ""),
        *textwrap.wrap(
            "proven: numerics of every kernel against the float64 reference, interpreted on a "
            "CPU (the test suite); compiled by the real back ends for sm_90, sm_80, v5e, v6e and "
            "v4, Mosaic GPU's kernels for sm_90a and sm_100a (python -m kernels.compile)",
            width=100, subsequent_indent="    "),
        "ran on a device: " + (", ".join(recorded) + " (bench/records/)" if recorded else
                               "none recorded; no kernel has been timed on a GPU or TPU"),
    ]
    for op in ops:
        lines += ["", op]
        for platform in ("gpu", "tpu"):
            for entry in defaults.TABLE.get((op, platform), ()):
                reach = " and ".join(filter(None, (", ".join(entry.device_kinds),
                                                   ", ".join(entry.dtypes))))
                lines += _wrapped(f"default on {platform.upper()}: "
                                  f"{', then '.join(entry.implementations)} ({entry.evidence})"
                                  + (f", for {reach}" if reach else ""))
        here = jax.devices()[0]
        by_dtype = {jnp.dtype(dtype).name: ", ".join(
            defaults.default(op, here.platform, dtype, here.device_kind))
            for dtype in (jnp.bfloat16, jnp.float32)}
        lines.append(f"  default here ({jax.default_backend()}): " + (
            next(iter(by_dtype.values())) if len(set(by_dtype.values())) == 1
            else "; ".join(f"{dtype} {names}" for dtype, names in by_dtype.items())))
        interpreted = _interpreted_cost([r for r in rows if r["op"].split()[0] == op])
        if interpreted:
            lines += _wrapped("interpreted on this machine, time vs XLA's (forward / "
                              "backward, the largest over the shapes): " + interpreted)
        for target, device in design.DEVICE_NAMES.items() if design_rows else ():
            line = design.target_line([r for r in design_rows if r["op"] == op], target)
            lines += _wrapped(f"design {device}: {line}") if line else []
    return "\n".join(lines)


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, width=100, initial_indent="  ", subsequent_indent="      ")


def _interpreted_cost(op_rows: list[dict]) -> str:
    """'triton 1.2x / 3.4x, mosaic ...': each interpreted implementation's largest ratio to
    XLA, forward and backward."""
    worst: dict[str, dict[bool, float]] = {}
    for r in op_rows:
        if r["kind"] == "interpreted" and r["vs_xla"] is not None:
            by_direction = worst.setdefault(r["implementation"], {})
            backward = r["op"].endswith(" backward")
            by_direction[backward] = max(by_direction.get(backward, 0.0), r["vs_xla"])
    return ", ".join(
        f"{name} " + " / ".join(f"{ratios[d]:.1f}x" if d in ratios else "-"
                                for d in (False, True))
        for name, ratios in worst.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--ops", default=",".join(BENCHES),
                        help="comma-separated ops (default: all)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per row")
    parser.add_argument("--json", metavar="PATH", help="also write all rows to PATH")
    parser.add_argument("--csv", metavar="PATH", help="also write all rows to PATH as CSV")
    parser.add_argument("--plot", metavar="DIR",
                        help="write DIR/<op>.png: time vs size per implementation, with the "
                             "roofline floor (needs matplotlib: the examples extra)")
    parser.add_argument("--interpret", choices=INTERPRET_CHOICES, default="both",
                        help="the interpreted rows on a CPU: both (default), true (the fast "
                             "interpreter's, at model-test sizes), strict (the simulators', on "
                             "small grids) or false (none), as the ops' interpret= values")
    parser.add_argument("--no-interpret", action="store_true", help="same as --interpret false")
    parser.add_argument("--rows", choices=("compare", "all"), default="compare",
                        help="compare (default): per op, each case that more than xla ran, its "
                             "time against xla's; all: every row with every column (GB/s, "
                             "TFLOP/s, roofline floors, xla's own CPU-sized rows, timed parts)")
    parser.add_argument("--design", choices=("summary", "grouped", "full", "none"),
                        default="summary",
                        help="the design figures (every kernel launch worked out for an H100 "
                             "and a TPU v5e, compiled by the real back ends where installed): "
                             "summary (default: a line per op and device), grouped (also a "
                             "table per case), full (one table, every column), none")
    parser.add_argument("--no-design", action="store_true", help="same as --design none")
    parser.add_argument("--record", action="store_true",
                        help="on a GPU or TPU, write the rows to bench/records/<device kind>.json "
                             "(the evidence kernels/defaults.py cites)")
    args = parser.parse_args(argv)
    # Interpreted Mosaic GPU kernels need more threads in XLA's CPU thread pools than a small
    # host has (`registry.MOSAIC_GPU_INTERPRETER_THREADS`; on 2 cores a jitted backward of
    # several launches hung): set before jax starts its CPU client, as tests/conftest.py does.
    os.environ.setdefault("PJRT_NPROC", str(registry.MOSAIC_GPU_INTERPRETER_THREADS))
    if not (args.no_design or args.design == "none"):
        # The design figures compile for GPUs and TPUs that are not here (Mosaic GPU's kernels
        # and XLA's own programs on compile-only H100s): set before jax starts its backends.
        use_compile_only_devices()
    ops = [op.strip() for op in args.ops.split(",")]
    unknown = [op for op in ops if op not in BENCHES]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(BENCHES)}")
    platform = defaults.PLATFORMS.get(jax.default_backend())
    if args.record and platform is None:
        parser.error("--record needs a GPU or TPU: CPU timings are not evidence for a default")

    # The platform's kernels are timed natively next to xla, whichever of them is the default.
    native_plan = [*((name, False) for name in registry.kernel_names()
                     if platform and registry.runs_natively(name, jax.default_backend())),
                   (registry.REFERENCE, False)]
    on_accelerator = platform is not None
    device_kind = jax.devices()[0].device_kind
    plan = []
    for op in ops:
        interpreted = [] if on_accelerator or args.no_interpret else INTERPRET_CHOICES[
            args.interpret]
        op_plan = [(case, _of_op(op, implementations),
                    3 if shapes == "strict" else args.repeats)  # the simulator's: fewer runs
                   for shapes, implementations in interpreted for case in BENCHES[op].cases(shapes)]
        # xla's rows at CPU sizes, but for a case an interpreted row times beside xla already.
        timed = {(case.op, case.shape, case.dtype) for case, _, _ in op_plan}
        plan += [(case, _of_op(op, native_plan), args.repeats)
                 for case in BENCHES[op].cases("native" if on_accelerator else "cpu")
                 if (case.op, case.shape, case.dtype) not in timed] + op_plan
    progress = harness.Progress()
    # On a device every op is timed by the chained timer, whose floor is measured first.
    timer = {"method": "chained" if on_accelerator else "waited per call"}
    if on_accelerator:
        progress.show("the chained timer's floor")
        timer["floor_us"] = harness.timer_floor_seconds() * 1e6
    roofline = harness.roofline_device(device_kind)
    rows = []
    for number, (case, implementations, repeats) in enumerate(plan, 1):
        progress.show(f"[{number}/{len(plan)}] {case.op} {case.shape} {case.dtype}: "
                      f"{', '.join(name for name, _ in implementations)}")
        measured = harness.measure(case, implementations, repeats, chained=on_accelerator)
        if on_accelerator:
            harness.mark_timer_floor(measured, timer["floor_us"], roofline)
        rows += measured
    design_choice = "none" if args.no_design else args.design
    design_rows = None
    if design_choice != "none":
        progress.show("design figures: tracing and compiling every launch for sm_90 and v5e")
        design_rows = list(design.rows(ops))
    progress.clear()
    print(summary(ops, rows, design_rows, timer))
    if args.rows == "all":
        print("\n" + "\n".join(textwrap.wrap(ROWS_LEGEND, 100)))
        print(harness.table(rows))
    else:
        print("\n" + "\n".join(textwrap.wrap(COMPARISON_LEGEND, 100)) + "\n")
        print(harness.comparison(rows))
    if design_choice in ("grouped", "full"):
        print("\n" + design.LEGEND + "\n" + design.compiler_note(design_rows) + "\n")
        print(design.table(design_rows) if design_choice == "full" else
              design.grouped(design_rows), flush=True)
    print(f"\n{len(rows)} rows: --rows all prints each with every column, --json PATH writes "
          "them; --design grouped shows each launch's design figures.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.csv:
        Path(args.csv).write_text(harness.csv_text(rows))
    if args.plot:
        from bench import plot

        for path in plot.plot(rows, args.plot, device_kind):
            print(f"wrote {path}")
    if args.record:
        path = record_path(device_kind)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"device_kind": device_kind, "jax": jax.__version__,
                                    "timer": timer, "rows": rows}, indent=1))
        print(f"recorded {len(rows)} rows in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
