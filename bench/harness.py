"""The one benchmark harness: a timer, a row per (case, implementation), the tables a person
reads (`comparison`, the rows a person compares; `table`, every row with every column), a
progress display, and the rows for JSON and CSV.

Every op's bench module returns `Case`s; the harness times each case with every implementation
available here, next to the `xla` reference measured in the same run.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels import registry

# Peak figures for the roofline floor: dense matrix throughput per input dtype (FLOP/s; float32
# at each platform's default matmul precision: TF32 on H100, one bfloat16 pass on TPU) and HBM
# bandwidth (B/s). H100 SXM5, H200 SXM (the H100's tensor cores, 4.8 TB/s of HBM3e) and TPU v5e
# data sheets.
DEVICES = {
    "H100": {"flops": {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12,
                       "float64": 67e12}, "bandwidth": 3.35e12},
    "H200": {"flops": {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12,
                       "float64": 67e12}, "bandwidth": 4.8e12},
    "TPU v5e": {"flops": {"bfloat16": 197e12, "float16": 197e12, "float32": 197e12},
                "bandwidth": 0.819e12},
}


# The chained timer (`chained_seconds`): a program of n dependent calls lasts about
# _CHAIN_SECONDS, n within [2, MAX_CHAINED_CALLS]. The calls are a loop (`chain`), so n costs
# no compile time; the cap bounds the device time of a call much shorter than expected.
_CHAIN_SECONDS = 0.0025
MAX_CHAINED_CALLS = 1024

# Shape sets run interpreted on a CPU: model-test sizes with the default (fast) interpreter,
# small grids with the "strict" simulator.
INTERPRETED = ("interpret", "strict")
# Shape sets where a kernel is timed (natively on a device, or interpreted): these also get the
# gradient's rows, since a training step runs the backward kernels too.
WITH_BACKWARD = ("native",) + INTERPRETED


@dataclasses.dataclass
class Case:
    """One benchmark problem.

    run(implementation, interpret) returns the op as a function of `args`; `expected` is the
    reference result in float32 or wider, for the error column; `flops` and `bytes` are the
    op's minimum work and traffic (None where not worked out: no throughput or floor columns);
    `baselines` are other
    programs (NumPy, SciPy) timed on the same inputs; `parts` are pieces of an implementation
    (a wrapper's copy, say) timed alone on the same inputs, with no error column.
    """

    op: str
    shape: str
    dtype: str
    args: tuple[Any, ...]
    run: Callable[[str, bool | str], Callable[..., Any]]
    expected: Any
    flops: int | None
    bytes: int | None
    baselines: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    parts: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 2,
                   chained: bool = False, calls: int | None = None) -> tuple[float, Any]:
    """Median time of one `fn(*args)` call, and one call's result (for the error column).

    On a CPU (`chained=False`) each call is waited for (JAX dispatches asynchronously: without
    the wait a benchmark times only the dispatch); that is what a test pays. On a GPU or TPU
    (`chained`) see `chained_seconds`: a waited call costs the host's round trip (0.04-0.15 ms
    on an H100 with jax 0.11), which hid every kernel under about 40 µs in the first H100
    record."""
    if chained:
        return chained_seconds(fn, *args, repeats=repeats, warmup=warmup, calls=calls)
    for _ in range(max(1, warmup)):  # at least one: its result is the error column's
        result = jax.block_until_ready(fn(*args))
    return statistics.median(_waited_seconds(fn, args) for _ in range(repeats)), result


def _waited_seconds(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def chain_calls(seconds: float) -> int:
    """n for a call of about `seconds`: the n-call program lasts about `_CHAIN_SECONDS`."""
    return max(2, min(MAX_CHAINED_CALLS, round(_CHAIN_SECONDS / seconds)))


def chained_seconds(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 1,
                    calls: int | None = None) -> tuple[float, Any]:
    """One call's time on a device, resolved to microseconds, and the result of one call:
    `chain(fn, n)` and `chain(fn, 2n)` are each timed as one waited program, and a call costs
    the difference over n, which cancels what a program pays once (its dispatch and round trip,
    the first link's copy of each operand, a parameter it may not update in place). n: `calls`,
    else `chain_calls` of one waited call of `fn` (so the shorter program lasts about
    `_CHAIN_SECONDS`). What remains per call beside the op is the chain's own link
    (`timer_floor_seconds`). NaN where noise leaves the longer program no slower: unresolved.
    The result is the shorter program's (its links leave the operands' values unchanged)."""
    if calls is None:
        calls = chain_calls(min(_waited_seconds(fn, args) for _ in range(warmup + 1)))
    programs = [chain(fn, calls), chain(fn, 2 * calls)]
    for program in reversed(programs):  # the shorter program's result is the one kept
        for _ in range(max(1, warmup)):
            result = jax.block_until_ready(program(*args))
    short, long = [], []
    for _ in range(repeats):  # interleaved: a drift of the device's clocks reaches both alike
        short.append(_waited_seconds(programs[0], args))
        long.append(_waited_seconds(programs[1], args))
    difference = statistics.median(long) - statistics.median(short)
    return (difference / calls if difference > 0 else math.nan), result


def chain(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
    """One compiled program of `calls` calls of `fn`, each depending on the one before through
    a scalar, so XLA can neither merge the calls nor hoist them: each result passes an
    optimization barrier (computed whole, not only the element read), its first element's bits
    are read, and the next call's operands are the same arrays with their first element
    rewritten by a select on those bits (`_linked`; the value is unchanged unless they are one
    arbitrary pattern). A rewrite updates the array in place, one element: a dependency through
    a whole operand (x + 0 * result) would add a pass as large as the op. Every operand is
    linked, so no part of a call (a wrapper's work on one operand) is shared between calls.
    The first call precedes a loop of the other `calls - 1`: a trip count XLA knows, which its
    GPU runtime runs without reading a predicate back each iteration, and which compiles one
    call whatever n. The program returns the last result."""
    def program(*args):
        def call(_, carry):
            args, result = carry
            args = _linked(args, _first_element(result))
            return args, lax.optimization_barrier(fn(*args))

        result = lax.optimization_barrier(fn(*args))
        return lax.fori_loop(1, calls, call, (tuple(args), result))[1]

    return jax.jit(program)


# A bit pattern the link compares a result's first element with: any constant XLA cannot
# prove unequal to a value it does not know (a comparison of a float with itself, or of a
# converted integer with NaN, it might fold).
_LINK_PATTERN = 0x5A5A5A5A


def _first_element(result: Any) -> jax.Array:
    """The bits of `result`'s first element (of its first non-empty leaf) as uint32."""
    leaf = next((x for x in jax.tree.leaves(result) if jnp.size(x)), jnp.zeros((1,), jnp.uint32))
    element = jnp.ravel(leaf)[0]
    if element.dtype == jnp.bool_ or element.dtype.itemsize != 4:
        element = element.astype(jnp.float32)
    return lax.bitcast_convert_type(element, jnp.uint32)


def _linked(args: Sequence[Any], bits: jax.Array) -> tuple[Any, ...]:
    """`args` with the first element of each array set to itself, or to its neighbour along the
    first axis when `bits` match `_LINK_PATTERN`: a value XLA cannot know, so the next call
    waits for it."""
    arbitrary = bits == _LINK_PATTERN

    def link(x):
        if not isinstance(x, jax.Array) or not x.size:
            return x
        first = (0,) * x.ndim
        neighbour = (min(1, x.shape[0] - 1),) + first[1:] if x.ndim else first
        return x.at[first].set(jnp.where(arbitrary, x[neighbour], x[first]))
    return tuple(jax.tree.map(link, tuple(args)))


def timer_floor_seconds(repeats: int = 10) -> float:
    """The chained timer's floor on this device: one link of the chain with an op that does
    nothing (the first of two small arrays: a link rewrites each operand, and the ops here
    take one to four). Rows whose roofline floor is under it measure the link (a few tiny
    launches), not the op (`below_timer_floor`)."""
    small = jnp.zeros((8, 128), jnp.float32)
    return chained_seconds(lambda x, y: x, small, small, repeats=repeats)[0]


def max_relative_error(actual: Any, expected: Any) -> float:
    """The largest error relative to each array's largest magnitude, over a pytree's leaves."""
    worst = 0.0
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = np.max(np.abs(want), initial=0.0)
        error = np.max(np.abs(got - want), initial=0.0)
        worst = max(worst, float(error / scale) if scale else float(error))
    return worst


def backward(case: Case, reference: Callable[..., Any], wrt: Sequence[int]) -> Case:
    """`case`'s gradient with respect to its args `wrt`: the vjp of a fixed cotangent through
    the forward, as a model's training step runs it, against `reference`'s in float32."""
    forward = case.expected
    cotangent = np.random.default_rng(0).standard_normal(np.shape(forward))

    def gradient(fn, args, dtype):
        def of_wrt(*differentiated):
            full = list(args)
            for i, value in zip(wrt, differentiated):
                full[i] = value
            return fn(*full)
        ct = jax.numpy.asarray(cotangent, dtype)
        return jax.vjp(of_wrt, *(args[i] for i in wrt))[1](ct)

    as_f32 = [a.astype(np.float32) if i in wrt else a for i, a in enumerate(case.args)]
    return Case(op=case.op + " backward", shape=case.shape, dtype=case.dtype, args=case.args,
                run=lambda name, interpret: lambda *args: gradient(
                    case.run(name, interpret), args, case.dtype),
                expected=gradient(reference, as_f32, np.float32), flops=None, bytes=None)


# DEVICES' names as JAX's device kinds spell them.
_DEVICE_KINDS = {"H100": ("H100",), "H200": ("H200",), "TPU v5e": ("TPU v5 lite", "TPU v5e")}


def roofline_device(device_kind: str) -> str | None:
    """The key of `DEVICES` for a JAX device kind ("NVIDIA H100 80GB HBM3" -> "H100")."""
    return next((name for name, kinds in _DEVICE_KINDS.items()
                 if any(kind in device_kind for kind in kinds)), None)


def mark_timer_floor(rows: list[dict], floor_us: float, device: str | None,
                     timer: str = "chained") -> None:
    """Sets each row's `below_timer_floor`: its roofline floor on `device` (this machine's) is
    under the floor of the timer that timed it (`timer`), so its time is the timer's own, not
    the op's; and `under_roofline_floor`: its time is under its roofline floor, which no call
    can be, so the time is the timer's error (each None where a figure is unknown, or another
    timer timed the row: a host baseline)."""
    for row in rows:
        floor = row.get(f"floor_{device}_us") if device and row.get("timer") == timer else None
        row["below_timer_floor"] = None if floor is None else floor < floor_us
        median = row.get("median_ms")
        row["under_roofline_floor"] = (None if floor is None or median is None
                                       or math.isnan(median) else median * 1e3 < floor)


def roofline_floor_us(case: Case, device: str) -> float | None:
    spec = DEVICES[device]
    peak = spec["flops"].get(case.dtype)
    if peak is None or case.flops is None or case.bytes is None:
        return None
    return max(case.flops / peak, case.bytes / spec["bandwidth"]) * 1e6


def label(implementation: str, interpret: bool | str) -> str:
    """A row's implementation column: interpreted rows say how (the fast HLO interpreter, or
    the "strict" TPU simulator)."""
    return implementation + {False: "", True: " (interpret)", "strict": " (strict)"}[interpret]


def measure(case: Case, implementations: Sequence[tuple[str, bool | str]],
            repeats: int, chained: bool = False,
            calls: int | None = None) -> list[dict]:
    """Rows for `case`: each (implementation, interpret) pair, then the baselines, timed by
    `median_seconds` (`chained` on a GPU or TPU, for the kernels and `xla` alike; `calls`: the
    chained timer's n, else chosen per program)."""
    rows, xla_seconds = [], None
    programs = [(name, interpret, jax.jit(case.run(name, interpret)))
                for name, interpret in implementations]
    programs += [(name, False, fn) for name, fn in case.baselines.items()]
    programs += [(name, False, fn) for name, fn in case.parts.items()]
    for name, interpret, fn in programs:
        part = name in case.parts
        # Host baselines (NumPy, SciPy) cannot be chained inside a compiled program.
        chain_it = chained and not interpret and name not in case.baselines
        try:
            seconds, result = median_seconds(fn, *case.args, repeats=repeats,
                                             chained=chain_it, calls=calls)
        except Exception as error:  # noqa: BLE001 - a kernel that fails is a row, not a crash
            if name == registry.REFERENCE:
                raise
            # Kept in the JSON and the record, so the table never silently drops a kernel; a
            # kernel that does not take the case says so (it is not a failure).
            message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            kind = "declined" if isinstance(error, NotImplementedError) else "failed"
            rows.append(_row(case, label(name, interpret), kind, {"error": message}))
            continue
        if name == registry.REFERENCE:
            xla_seconds = seconds
        rows.append(_row(case, label(name, interpret), "interpreted" if interpret else "speed", {
            **({"part": True} if part else {}), "median_ms": seconds * 1e3,
            "timer": "chained" if chain_it else "waited",
            # Interpreted rows are correctness rows, and a part does not do the op's work:
            # throughput, error and roofline figures would mislead there.
            "GB/s": None if interpret or part or case.bytes is None or not seconds > 0
            else case.bytes / seconds / 1e9,
            "TFLOP/s": None if interpret or part or case.flops is None or not seconds > 0
            else case.flops / seconds / 1e12,
            "max_rel_err": None if part else max_relative_error(result, case.expected),
            **{f"floor_{d}_us": None if part else roofline_floor_us(case, d) for d in DEVICES},
        }))
    for row in rows:
        # On an interpreted row the ratio is what a model author testing on a CPU pays for
        # running the kernel's code instead of XLA (the goal: within 20x with the default
        # interpreter, at model-test sizes), not a speed figure of the kernel.
        if row["median_ms"] is not None and xla_seconds and row["implementation"] not in case.parts:
            row["vs_xla"] = row["median_ms"] / (xla_seconds * 1e3)
    return rows


def _row(case: Case, implementation: str, kind: str, figures: dict) -> dict:
    """One row: the case, the implementation and its kind ("speed", "interpreted", "failed" or
    "declined"), then `figures`; a figure not given is None ('-' in the table)."""
    empty = {"median_ms": None, "GB/s": None, "TFLOP/s": None, "max_rel_err": None,
             **{f"floor_{d}_us": None for d in DEVICES}, "vs_xla": None}
    return {"op": case.op, "shape": case.shape, "dtype": case.dtype, "flops": case.flops,
            "bytes": case.bytes, "implementation": implementation, "kind": kind,
            **empty, **figures}


# (column, format, width): `table`'s columns.
_COLUMNS = [("op", "{}", 18), ("shape", "{}", 46), ("dtype", "{}", 9),
            ("implementation", "{}", 24), ("median_ms", "{:.3f}", 10), ("vs_xla", "{:.2f}x", 9),
            ("GB/s", "{:.1f}", 7), ("TFLOP/s", "{:.3f}", 8), ("max_rel_err", "{:.1e}", 11),
            ("floor_H100_us", "{:.3g}", 13), ("floor_TPU v5e_us", "{:.3g}", 16)]


def header() -> str:
    """The table's header and rule."""
    line = "  ".join(name.ljust(width) for name, _, width in _COLUMNS).rstrip()
    return line + "\n" + "-" * len(line)


def format_row(row: dict) -> str:
    """One row of the table; '-' where a figure does not apply, and why a failed or declined
    row has none."""
    line = "  ".join(("-" if row[name] is None else fmt.format(row[name])).ljust(width)
                     for name, fmt, width in _COLUMNS).rstrip()
    if row.get("below_timer_floor"):
        line += "  (roofline under the timer's floor)"
    return line + (f"  {row['kind'].upper()}: {row['error']}" if "error" in row else "")


def table(rows: list[dict]) -> str:
    """The rows under the header, a blank line between ops."""
    lines = [header()]
    for previous, row in zip([None, *rows], rows):
        if previous is not None and previous["op"].split()[0] != row["op"].split()[0]:
            lines.append("")
        lines.append(format_row(row))
    return "\n".join(lines)


def comparison(rows: list[dict]) -> str:
    """The rows a person compares, a table per op: each case that more than xla ran, in a line:
    xla's median time, each other implementation's time against it, the largest error against
    the reference among them; then why a kernel failed or declined. (Timed parts of an
    implementation and cases xla ran alone are left to `table`.)"""
    cases: dict[tuple[str, str, str], dict[str, dict]] = {}
    for r in rows:
        if not r.get("part"):
            cases.setdefault((r["op"], r["shape"], r["dtype"]), {})[r["implementation"]] = r
    blocks, notes = [], []
    for op in dict.fromkeys(op.split()[0] for op, _, _ in cases):
        lines = {key: by_name for key, by_name in cases.items()
                 if key[0].split()[0] == op and set(by_name) - {"xla"}}
        names = list(dict.fromkeys(n for by_name in lines.values() for n in by_name if n != "xla"))
        if not lines:
            continue
        cells = []
        for (case_op, shape, dtype), by_name in lines.items():
            xla = by_name.get("xla", {}).get("median_ms")
            errors = [by_name[n]["max_rel_err"] for n in names
                      if n in by_name and by_name[n]["max_rel_err"] is not None]
            cells.append([case_op, shape, dtype, "-" if xla is None else f"{xla:.3f}",
                          *(_versus(by_name.get(n)) for n in names),
                          f"{max(errors):.1e}" if errors else "-"])
            notes += [f"{case_op} {shape} {dtype}, {n}: {by_name[n]['kind']}, "
                      f"{by_name[n]['error']}" for n in names
                      if n in by_name and "error" in by_name[n]]
        # The rows' labels, shorter: "mosaic (interpret)" is "mosaic", "(strict)" "strict", a
        # baseline its package ("scipy.signal.convolve2d" is "scipy").
        headers = [name.replace(" (interpret)", "").replace(" (strict)", " strict").split(".")[0]
                   for name in names]
        blocks.append(aligned(["op", "shape", "dtype", "xla ms", *headers, "max err"], cells))
    if not blocks:
        return "Nothing but xla ran here: --rows all prints its rows."
    failures = "\n".join(textwrap.shorten(note, 160) for note in notes)
    return "\n\n".join(blocks + [failures] if notes else blocks)


def _versus(row: dict | None) -> str:
    """A row's cell in `comparison`: its time against xla's, or what kept it from one."""
    if row is None:
        return "-"
    if row["kind"] in ("failed", "declined"):
        return row["kind"]
    ratio = row["vs_xla"]
    return "unresolved" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}x"


class Progress:
    """What is being measured, on stderr: one line rewritten in place on a terminal (a line a
    step elsewhere), never a second copy of the rows."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.in_place = self.stream.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.in_place:
            text = text[:shutil.get_terminal_size().columns - 1]
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.in_place and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def csv_text(rows: list[dict]) -> str:
    """Rows as CSV: every field of every row, empty where a figure does not apply."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def aligned(header: list[str], cells: list[list[str]]) -> str:
    """A header and rows of strings as left-aligned columns under a rule."""
    lines = [header, *cells]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)
