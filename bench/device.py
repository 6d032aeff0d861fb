"""`python -m bench.device`: what only a GPU can settle, in one call of at most `BUDGET_S`
(an H100 or H200 lent for minutes, with no network), compiles included.

1. Versions: jax, jaxlib and the device, and for each kernel implementation whether it runs
   natively here or why not (`registry.unavailable`, `registry.device_reason`). Nothing is
   fetched: a newer jax travels in the working tree as wheels (`--wheels DIR`, installed
   offline before anything else).
2. Smoke (`smoke_plan`): every kernel the device runs, its forward and gradient (a fixed random
   cotangent) on each op's smallest compile case (ragged blocks, padded stores) and the design
   case with the most operands (its fused epilogues), against float64 truth computed on the
   host's CPU. XLA on the same device and inputs sets the bar (`SMOKE_FACTOR`): faults only a
   device shows (TMA alignment, a bulk store past its rows) give errors of order one.
3. Rows (`row_plan`): the bench's native cases, each case with every implementation that runs
   here, ordered by need (`need`: what this device kind's record lacks first), each
   implementation's row merged into bench/records/<device kind>.json as it finishes (`merge`):
   a run cut off keeps what it measured, and a later run adds rows beside the earlier ones.

No case starts whose estimate would pass the deadline (`--budget-s`). `--dry-run` (any machine,
no GPU needed) prints the plan with each step's estimate and its basis: compile times measured
here for a compile-only H100, device times from the recorded rows (`estimate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Seconds one call of the command may take: 8 minutes of a lease of about 15, leaving the rest
# for the machine's start and a second try.
BUDGET_S = 480
# A kernel passes the smoke when its largest error against float64 truth (relative to the
# truth's largest magnitude) is within SMOKE_FACTOR times XLA's own on the same device and
# inputs, or SMOKE_FACTOR units of its dtype's rounding.
SMOKE_FACTOR = 4
# The rows use the bench's chained timer as it is (`harness.chained_seconds`: n from one
# waited call, so that the shorter program lasts about 2.5 ms; the calls a loop that compiles
# one call whatever n). A fixed n = 2, which this command once used to spare compile time (the
# H200 run of bench/records/nvidia_h200.json), left rows of 3-120 us off by tens of
# microseconds, some under their roofline floor: a waited program's round trip varies by more
# than two such calls take. A row under its roofline floor is marked
# (`harness.mark_timer_floor`) and timed again.
# Timed runs per program, the two programs' runs interleaved (`harness.chained_seconds`).
REPEATS = 30
# Host work per step that no compile time measured here covers (tracing, transfers, the
# record's write): an allowance, not a device measurement.
STEP_OVERHEAD_S = 1.0
# A step's device time where nothing is recorded: this many times its roofline floor.
UNRECORDED_FLOOR_FACTOR = 3
# Device kinds whose records stand in for one another's timings in an estimate (the same chip
# generation; a record is still written per device kind).
SAME_GENERATION = (("NVIDIA H100", "NVIDIA H200"),)


@dataclasses.dataclass
class Step:
    """One step of the plan: a smoke check or a timed case, with its estimate."""

    phase: str  # "smoke" or "rows"
    op: str
    label: str
    implementations: list[str]
    run: Callable[[], Any]  # what the command does for this step
    need: int = 0  # rows: `need`'s rank; lower runs first
    order: tuple[int, int] = (0, 0)  # the plan's sort key
    estimate_s: float | None = None
    basis: str = ""


def versions() -> list[str]:
    """What this run runs and skips, and why."""
    import jax
    import jaxlib

    from kernels import registry

    backend = jax.default_backend()
    lines = [f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {backend}, "
             f"device {jax.devices()[0].device_kind}"]
    for name in registry.kernel_names():
        reason = (registry.unavailable(name) or registry.device_reason(name, backend)
                  or (None if registry.runs_natively(name, backend)
                      else f"its kernels do not compile for {backend}"))
        lines.append(f"  {name}: " + ("runs natively" if reason is None else f"skipped, {reason}"))
    return lines


def native_implementations() -> list[str]:
    """The kernel implementations that run natively on this device, then `xla`."""
    import jax

    from kernels import registry

    backend = jax.default_backend()
    return [*(name for name in registry.kernel_names()
              if registry.unavailable(name) is None and registry.runs_natively(name, backend)),
            registry.REFERENCE]


# --- smoke ---------------------------------------------------------------------------------


def smoke_cases() -> Iterator[Any]:
    """Per op: its smallest compile case and its design case with the most operands."""
    from kernels.compile import CASES

    for cases in CASES.values():
        def size(case):
            return sum(math.prod(a.shape) for a in case.args)

        yield min(cases, key=size)
        yield max((c for c in cases if c.design), key=lambda c: len(c.args))


def _values(case) -> list[Any]:
    """Random operands for a compile case: floats standard normal, integers (a gather's ids)
    within the first operand's rows."""
    import jax.numpy as jnp
    import numpy as np

    from kernels._cases import random

    rng = np.random.default_rng(3)
    return [random(a.shape, a.dtype, seed=i) if jnp.issubdtype(a.dtype, jnp.floating)
            else jnp.asarray(rng.integers(0, case.args[0].shape[0], a.shape), a.dtype)
            for i, a in enumerate(case.args)]


def _truth(case, arrays, cotangent) -> Any:
    """The reference's forward and gradient in float64 on the host's CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def wide(x):
        return (np.asarray(x, np.float64) if jnp.issubdtype(x.dtype, jnp.floating)
                else np.asarray(x))

    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(case.layer("xla"))(wide(cotangent), *map(wide, arrays))


def smoke(case, implementations: list[str]) -> list[dict]:
    """Each kernel of `implementations` on `case`, natively, against float64 truth, beside XLA
    on the same device (`SMOKE_FACTOR`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.harness import max_relative_error
    from kernels._cases import random

    arrays = _values(case)
    out_shape = jax.eval_shape(case.forward("xla"), *arrays)
    cotangent = random(out_shape.shape, jnp.float32, seed=7)
    truth = _truth(case, arrays, cotangent)
    errors = {}
    for name in implementations:
        try:
            got = jax.jit(case.layer(name))(cotangent, *arrays)
            errors[name] = (max_relative_error(got[0], truth[0]),
                            max_relative_error(got[1], truth[1]))
        except Exception as error:  # noqa: BLE001 - a kernel that fails is a result
            errors[name] = error
    xla = errors.pop("xla")
    if isinstance(xla, Exception):
        raise xla
    unit = SMOKE_FACTOR * float(jnp.finfo(case.args[0].dtype).eps)
    results = []
    for name, error in errors.items():
        result = {"op": case.op, "case": case.description, "implementation": name,
                  "forward_error": None, "gradient_error": None, "xla_errors": list(xla)}
        if isinstance(error, Exception):
            # A case the kernel declines by design (NotImplementedError) is not a failure.
            result["ok"] = isinstance(error, NotImplementedError)
            result["declined" if result["ok"] else "error"] = (
                f"{type(error).__name__}: {error}".splitlines()[0][:300])
        else:
            result["forward_error"], result["gradient_error"] = error
            result["ok"] = all(np.isfinite(e) and e <= max(SMOKE_FACTOR * x, unit)
                               for e, x in zip(error, xla))
        results.append(result)
    return results


def smoke_plan(implementations: list[str]) -> list[Step]:
    kernels = [name for name in implementations if name != "xla"]
    return [Step("smoke", case.op, case.description, kernels,
                 run=lambda case=case: smoke(case, [*kernels, "xla"]))
            for case in smoke_cases()]


# --- rows ----------------------------------------------------------------------------------


def need(case, implementations: list[str], recorded: list[dict], jax_version: str) -> int:
    """How much the record needs `case` (lower first): 0 an implementation has no row for the
    case's op and dtype on this device kind, 1 none at this shape (a row faster than its
    roofline floor, `under_roofline_floor`, is the timer's error, not a time), 2 only rows of
    another jax, 3 recorded."""
    def rank(name):
        same = [r for r in recorded if r["op"] == case.op and r["dtype"] == case.dtype
                and r["implementation"] == name]
        if not same:
            return 0
        at_shape = [r for r in same if r["shape"] == case.shape]
        if not at_shape:
            return 1
        timed = [r for r in at_shape if not r.get("under_roofline_floor")]
        if not timed:
            return 1
        return 3 if any(r.get("jax") == jax_version for r in timed) else 2

    return min(rank(name) for name in implementations)


def bench_cases(ops: list[str], shapes: str) -> list[Any]:
    """The bench's `shapes` cases of `ops`, without host baselines or timed parts (neither
    bears on a default)."""
    out = []
    for op in ops:
        module = importlib.import_module(f"bench.{op}")
        out += [dataclasses.replace(case, baselines={}, parts={})
                for case in module.cases(shapes)]
    return out


def row_plan(cases: list[Any], implementations: list[str], recorded: list[dict],
             jax_version: str, record: Callable[[list[dict]], None],
             repeats: int, chained: bool = True) -> list[Step]:
    """One step per case, ordered by `need`, then by op in turn (each op's first case before any
    op's second), each implementation's rows passed to `record` as they finish. `chained`: the
    device's timer (a CPU's, `--allow-cpu`, waits per call)."""
    from bench import harness

    turn: dict[str, int] = {}
    steps = []
    for case in cases:
        turn[case.op.split()[0]] = turn.get(case.op.split()[0], -1) + 1

        def run(case=case):
            rows = []  # xla first: each kernel's row carries its ratio to xla's time
            for name in sorted(implementations, key=lambda name: name != "xla"):
                measured = harness.measure(case, [(name, False)], repeats, chained=chained)
                for row in measured:
                    xla = rows[0]["median_ms"] if rows else None
                    row["vs_xla"] = row["median_ms"] / xla if xla and row["median_ms"] else (
                        1.0 if name == "xla" and row["median_ms"] else None)
                record(measured)
                rows += measured
            return rows

        rank = need(case, implementations, recorded, jax_version)
        steps.append(Step("rows", case.op, f"{case.shape} {case.dtype}", implementations, run,
                          need=rank, order=(rank, turn[case.op.split()[0]])))
    return sorted(steps, key=lambda step: step.order)


# --- records -------------------------------------------------------------------------------


def read_record(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def merge(record: dict | None, rows: list[dict], run: dict, key: str = "rows") -> dict:
    """`record` (a device kind's, as read; None: none yet) with `rows` that `run` measured
    added under `key`: every earlier row kept (a row names the run that measured it, and the
    run its date, jax and jaxlib)."""
    merged = dict(record or {"device_kind": run["device_kind"]})
    merged["runs"] = [*merged.get("runs", []), *([run] if run not in merged.get("runs", [])
                                                 else [])]
    merged[key] = [*merged.get(key, []), *({**row, "run": run["started"]} for row in rows)]
    return merged


def write_record(path: Path, record: dict) -> None:
    """Replaces `path` whole (a run cut off mid-write leaves the previous record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)


def recorded_rows(records: Path, device_kind: str) -> list[dict]:
    """The rows recorded for `device_kind`: the record's own, and those of the earlier runs a
    hand-made record keeps beside them (a dict with its own "rows", or "runs" of rows), each
    with its run's jax where the row does not name one."""
    from bench.__main__ import record_path

    record = read_record(record_path(device_kind, records)) or {}
    rows = [{"jax": record.get("jax"), **row} for row in record.get("rows", [])]
    for kept in (value for value in record.values() if isinstance(value, dict)):
        for run in [kept, *kept.get("runs", [])]:
            jax_version = run.get("jax", kept.get("jax", record.get("jax")))
            rows += [{"jax": jax_version, **row} for row in run.get("rows", [])]
    return rows


# --- estimates -----------------------------------------------------------------------------


def _stand_ins(device_kind: str, records: Path) -> list[str]:
    """`device_kind` and the recorded device kinds of its generation (`SAME_GENERATION`)."""
    prefixes = next((kinds for kinds in SAME_GENERATION
                     if any(device_kind.startswith(k) for k in kinds)), (device_kind,))
    found = (json.loads(path.read_text()).get("device_kind", "")
             for path in sorted(records.glob("*.json")))
    return list(dict.fromkeys([device_kind, *(kind for kind in found
                                              if kind.startswith(prefixes))]))


def _timed_rows(stand_ins: dict[str, list[dict]]) -> list[dict]:
    """The rows of `_stand_ins`'s device kinds, this device kind's last: a call's latest row
    (`_recorded_seconds`) is then its own where it has one."""
    return [row for rows in reversed(stand_ins.values()) for row in rows]


def _recorded_seconds(rows: list[dict], op: str, shape: str, dtype: str,
                      implementation: str) -> float | None:
    times = [r["median_ms"] for r in rows if (r["op"], r["shape"], r["dtype"],
             r["implementation"]) == (op, shape, dtype, implementation)
             and r.get("median_ms") and math.isfinite(r["median_ms"])]
    return times[-1] / 1e3 if times else None


def expected_seconds(case: Any, implementation: str, recorded: list[dict]) -> tuple[float, str]:
    """A call's expected device time and its source: its latest row in `recorded`, else
    `UNRECORDED_FLOOR_FACTOR` times its H100 roofline floor (1 ms where it has none)."""
    from bench import harness

    seconds = _recorded_seconds(recorded, case.op, case.shape, case.dtype, implementation)
    if seconds is not None:
        return seconds, "recorded"
    floor = harness.roofline_floor_us(case, "H100")
    return (UNRECORDED_FLOOR_FACTOR * (floor or 1000.0) / 1e6,
            f"{UNRECORDED_FLOOR_FACTOR}x roofline floor")


def _compile_seconds(fn: Callable[..., Any], args: list[Any]) -> float:
    """Seconds to compile `fn` here for a compile-only H100 (the kernels' compilers included)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from kernels.compile import programs

    device = programs.devices("sm_90", 1)[0]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
             for a in args]
    start = time.perf_counter()
    with jax.default_device(device):
        jax.jit(fn).lower(*specs).compile()
    return time.perf_counter() - start


def estimate(step: Step, case: Any, recorded: list[dict], repeats: int) -> None:
    """Sets `step.estimate_s` and `step.basis`. Compiles: the step's programs compiled here for
    a compile-only H100, as the device will compile them (a row's call alone, then the chained
    timer's programs of n and 2n calls, n by `harness.chain_calls`). Device time: a row's
    calls at its expected time (`expected_seconds`, from this device kind's record or one of
    the same generation's); a smoke's float64 truth timed on this host."""
    import jax
    import jax.numpy as jnp

    from bench import harness

    if step.phase == "smoke":
        arrays = _values(case)
        cotangent = jnp.zeros(jax.eval_shape(case.forward("xla"), *arrays).shape, jnp.float32)
        start = time.perf_counter()
        jax.block_until_ready(_truth(case, arrays, cotangent))
        truth_s = time.perf_counter() - start
        compile_s = sum(_compile_seconds(case.layer(name), [cotangent, *arrays])
                        for name in [*step.implementations, "xla"])
        step.estimate_s = compile_s + truth_s + STEP_OVERHEAD_S
        step.basis = f"compiled here {compile_s:.1f} s, float64 truth here {truth_s:.1f} s"
        return
    compile_s = device_s = 0.0
    sources = set()
    for name in step.implementations:
        fn = case.run(name, False)
        seconds, source = expected_seconds(case, name, recorded)
        sources.add(source)
        calls = harness.chain_calls(seconds)
        compile_s += sum(_compile_seconds(program, list(case.args)) for program in
                         (fn, harness.chain(fn, calls), harness.chain(fn, 2 * calls)))
        # `harness.median_seconds`'s 2 warm-ups: 3 waited calls choose n, then each program's
        # 2 warm-ups and its repeats (the error is the shorter program's last warm-up result).
        device_s += seconds * (3 + (2 + repeats) * 3 * calls)
    step.estimate_s = compile_s + device_s + STEP_OVERHEAD_S * len(step.implementations)
    step.basis = (f"compiled here {compile_s:.1f} s, device {device_s:.2f} s "
                  f"({', '.join(sorted(sources))})")


# --- the command ---------------------------------------------------------------------------


def _install_wheels(directory: str) -> None:
    """Installs the wheels in `directory` offline (no index, no dependencies), then runs the
    command again without `--wheels` so the new jax is the one imported."""
    wheels = sorted(str(p) for p in Path(directory).glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {directory}: no wheels there")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                    *wheels], check=True)
    argv = [a for i, a in enumerate(sys.argv[1:])
            if a != "--wheels" and sys.argv[i] != "--wheels" and not a.startswith("--wheels=")]
    os.execv(sys.executable, [sys.executable, "-m", "bench.device", *argv])


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # the budget counts from here
    parser = argparse.ArgumentParser(prog="python -m bench.device", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan with estimates (any machine; compiles for a "
                             "compile-only H100 here)")
    parser.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"start nothing estimated to end past this (default {BUDGET_S})")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed runs per program (default {REPEATS})")
    parser.add_argument("--records", default=None,
                        help="where the records are (default bench/records)")
    parser.add_argument("--phases", default="smoke,rows", help="smoke,rows (default both)")
    parser.add_argument("--wheels", metavar="DIR",
                        help="install DIR's wheels offline first (a newer jax carried over)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the rows on a CPU (the command's own test: CPU timings are "
                             "never evidence, so --records must name another directory)")
    args = parser.parse_args(argv)
    if args.wheels:
        _install_wheels(args.wheels)
    if args.dry_run:
        from kernels.compile import use_compile_only_devices

        use_compile_only_devices()
    import jax

    from bench.__main__ import RECORDS, record_path
    from kernels.ops import OPS

    records = Path(args.records) if args.records else RECORDS
    on_device = jax.default_backend() in ("gpu", "cuda", "rocm")
    if not (on_device or args.dry_run or args.allow_cpu):
        parser.error("needs a GPU (or --dry-run): CPU timings are not evidence for a default")
    if args.allow_cpu and records.resolve() == RECORDS.resolve():
        parser.error("--allow-cpu writes CPU rows: give --records another directory")
    ops = args.ops.split(",") if args.ops else list(OPS)
    phases = args.phases.split(",")
    for line in versions():
        print(line, flush=True)

    device_kind = "NVIDIA H100 80GB HBM3" if args.dry_run and not on_device else (
        jax.devices()[0].device_kind)
    implementations = native_implementations() if on_device else (
        ["triton", *(["mosaic_gpu"] if _available("mosaic_gpu") else []), "xla"]
        if args.dry_run else ["xla"])
    path = record_path(device_kind, records)
    recorded = recorded_rows(records, device_kind)
    stand_ins = {kind: recorded_rows(records, kind) for kind in _stand_ins(device_kind, records)}
    run = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device_kind": device_kind, "jax": jax.__version__,
           "jaxlib": importlib.import_module("jaxlib").__version__,
           "timer": {"method": "chained" if on_device else "waited per call"}}

    if on_device and "rows" in phases:  # the chained timer's floor, as `python -m bench`
        from bench import harness

        run["timer"]["floor_us"] = harness.timer_floor_seconds() * 1e6

    def record(rows, key="rows"):
        if key == "rows" and on_device:
            harness.mark_timer_floor(rows, run["timer"]["floor_us"],
                                     harness.roofline_device(device_kind))
        write_record(path, merge(read_record(path), rows, run, key))

    plan: list[tuple[Step, Any]] = []
    if "smoke" in phases and on_device or args.dry_run and "smoke" in phases:
        plan += [(step, case) for step, case in zip(smoke_plan(implementations), smoke_cases())
                 if step.op in ops]
    if "rows" in phases:
        built = time.perf_counter()
        cases = bench_cases(ops, "native" if on_device or args.dry_run else "cpu")
        setup_s = time.perf_counter() - built
        steps = row_plan(cases, implementations, recorded, jax.__version__, record,
                         args.repeats, chained=on_device or args.dry_run)
        by_label = {(c.op, f"{c.shape} {c.dtype}"): c for c in cases}
        plan += [(step, by_label[(step.op, step.label)]) for step in steps]
    if args.dry_run:
        return _print_plan(plan, stand_ins, args, setup_s if "rows" in phases else 0.0)
    return _run(plan, args.budget_s, record, started)


def _available(name: str) -> bool:
    from kernels import registry

    return registry.unavailable(name) is None


def _print_plan(plan: list[tuple[Step, Any]], stand_ins: dict[str, list[dict]], args,
                setup_s: float) -> int:
    """Each step with its estimate (`estimate`) and the running total, from `setup_s` (the
    bench's cases built here, their expected values computed): the steps within the budget
    are this run's; the rest, a later run's (which the record's `need` then puts first)."""
    recorded = _timed_rows(stand_ins)
    this_run, later = setup_s, 0.0
    print(f"  0 setup: the bench's device cases built here in {setup_s:.1f} s", flush=True)
    for number, (step, case) in enumerate(plan, 1):
        estimate(step, case, recorded, args.repeats)
        fits = not later and this_run + step.estimate_s <= args.budget_s
        if fits:
            this_run += step.estimate_s
        else:
            later += step.estimate_s
        print(f"{number:3d} {step.phase:5s} {step.op:18s} {step.label:48s} "
              f"{', '.join(step.implementations):26s} {step.estimate_s:6.1f} s  "
              f"{'total ' + format(this_run, '6.1f') + ' s' if fits else 'a later run'}  "
              f"need {step.need}  [{step.basis}]", flush=True)
    kinds = ", ".join(kind for kind, rows in stand_ins.items() if rows) or "none"
    print(f"estimate: {this_run:.0f} s for this run against a budget of {args.budget_s:.0f} s"
          + (f", {later:.0f} s more for a later run" if later else "")
          + f" (compile times measured here for a compile-only H100; device times from the "
          f"records of {kinds}, else {UNRECORDED_FLOOR_FACTOR}x the roofline floor)")
    return 0


def _run(plan: list[tuple[Step, Any]], budget_s: float, record: Callable[..., None],
         start: float | None = None) -> int:
    """Runs each step in order, skipping one that the mean time of the finished steps of its
    phase says would end past `budget_s` from `start` (default: now); smoke results and rows
    are recorded as they finish. Returns 1 if a smoke check failed."""
    start = time.perf_counter() if start is None else start
    spent: dict[str, list[float]] = {}
    failed = 0
    for number, (step, _) in enumerate(plan, 1):
        elapsed = time.perf_counter() - start
        durations = spent.get(step.phase, [])
        expected = sum(durations) / len(durations) if durations else 0.0
        if elapsed + expected > budget_s:
            print(f"[{number}/{len(plan)}] skipped {step.phase} {step.op} {step.label}: "
                  f"would end past {budget_s:g} s", flush=True)
            continue
        began = time.perf_counter()
        result = step.run()
        spent.setdefault(step.phase, []).append(time.perf_counter() - began)
        if step.phase == "smoke":
            record(result, "smoke")
            failed += sum(not r["ok"] for r in result)
            for r in result:
                verdict = ("declined: " + r["declined"] if "declined" in r else
                           "ok" if r["ok"] else "FAILED " + r.get("error", ""))
                print(f"[{number}/{len(plan)}] smoke {r['implementation']:10s} {step.op} "
                      f"{step.label}: {verdict} (errors: forward {r['forward_error']}, "
                      f"gradient {r['gradient_error']}; xla's {r['xla_errors']})", flush=True)
        else:
            print(f"[{number}/{len(plan)}] rows {step.op} {step.label}: " + ", ".join(
                f"{r['implementation']} {r['median_ms']:.3f} ms" if r["median_ms"] else
                f"{r['implementation']} {r['kind']}" for r in result), flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
