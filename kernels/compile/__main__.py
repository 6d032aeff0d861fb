"""`python -m kernels.compile`: every op's kernels (or whole programs) compiled for the named
targets, a line per kernel (or program), and an exit status of 1 if any failed or went over
budget. See `kernels.compile` for what each back end checks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kernels import compile as package
from kernels import registry
from kernels._targets import TARGETS
from kernels.compile import programs
from kernels.compile.api import compile_kernels, implemented_targets, listing
from kernels.compile.cases import CASES, Case
from kernels.compile.mosaic_gpu import OWN_PROCESS
from kernels.compile.report import DEFAULT_TIMEOUT_S, KernelReport, resources
from kernels.ops import OPS


def _row(case: Case, r: KernelReport, implementation: str) -> dict[str, Any]:
    return {"op": case.op, "case": case.description, "implementation": implementation,
            "kernel": r.name, "target": r.target,
            "verdict": "ok" if r.fits else "FAIL", "grid": "x".join(map(str, r.grid)),
            "resources": resources(r), "seconds": round(r.seconds, 2), "error": r.error}


def _implementations(op: str, target: str) -> list[str]:
    """The kernel implementations of `op` compiled for `target`: those whose kernels run there
    and that the installed jax has."""
    return [name for name in registry.kernel_names()
            if target in implemented_targets(name) and not registry.unavailable(name)
            and OPS[op].has(name)]


def _programs_main(args: argparse.Namespace, targets: list[str]) -> int:
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
    parser = argparse.ArgumentParser(prog="python -m kernels.compile", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated ops")
    parser.add_argument("--targets", default=",".join(t for t in TARGETS if t not in OWN_PROCESS),
                        help="comma-separated targets (default: all but "
                             f"{', '.join(OWN_PROCESS)}, which Mosaic GPU compiles for only in "
                             "a process of its own: name it alone)")
    parser.add_argument("--json", metavar="PATH", help="also write every report to PATH")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per kernel compile")
    parser.add_argument("--list", action="store_true",
                        help="list each registered implementation's back end and targets")
    parser.add_argument("--programs", action="store_true",
                        help="compile whole programs (kernels.compile.programs) instead of kernels")
    parser.add_argument("--devices", type=int, default=4, choices=(4, 8),
                        help="--programs: devices of the Auto and Explicit meshes")
    parser.add_argument("--mesh", default="one,auto,explicit",
                        help="--programs: comma-separated mesh kinds (one, auto, explicit)")
    parser.add_argument("--implementations", default="default,kernel",
                        help="--programs: comma-separated: default, kernel or an "
                             f"implementation ({', '.join(registry.names())})")
    args = parser.parse_args(argv)
    if args.list:
        for row in listing():
            print(f"{row['implementation']:8}  {row['back_end'] or '-':8}  "
                  f"{', '.join(row['targets']) or 'runs the reference: nothing to compile'}")
        return 0
    package.use_compile_only_devices()
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
                for implementation in _implementations(op, target):
                    try:
                        reports = compile_kernels(case.function(implementation), *case.args,
                                                  target=target, timeout_s=args.timeout,
                                                  implementation=implementation)
                    except NotImplementedError as declined:  # a case the kernel does not take
                        print(f"declined  {target:6}  {implementation:10}  {case.description}: "
                              f"{declined}", flush=True)
                        continue
                    for report in reports:
                        row = _row(case, report, implementation)
                        failures += row["verdict"] != "ok"
                        rows.append(row)
                        print(f"{row['verdict']:4}  {target:6}  {report.name:40}  "
                              f"{case.description:52}  grid {row['grid']:14}  "
                              f"{row['resources']}  {row['seconds']:.1f}s"
                              + (f"\n      {report.error}" if report.error else ""), flush=True)
    return _finish(rows, failures, args.json,
                   f"{len(rows)} kernel compiles, {failures} failed or over budget (compiled on "
                   "this machine for the named targets; nothing here ran on a device)")


if __name__ == "__main__":
    sys.exit(main())
