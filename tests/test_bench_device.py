"""`python -m bench.device`, the one command a lent GPU runs: its plan, its records, and what
a run cut off leaves, proven on a CPU (bench/device.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bench import device, harness
from bench.__main__ import record_path
from tests.support import subprocess_env

ROOT = Path(__file__).parent.parent


def _case(op, shape, dtype):
    return types.SimpleNamespace(op=op, shape=shape, dtype=dtype)


def test_rows_run_in_order_of_need_each_op_in_turn():
    """What the device kind's record lacks runs first: an (op, implementation, dtype) with no row
    at all, then a shape not recorded, then rows of another jax, then the recorded; within a
    rank the ops take turns."""
    cases = [_case("matmul", "a", "float32"), _case("matmul", "b", "float32"),
             _case("matmul", "a", "bfloat16"), _case("normalize", "c", "float32"),
             _case("normalize", "d", "float32")]
    recorded = [
        {"op": "matmul", "shape": "a", "dtype": "float32", "implementation": name, "jax": "0.12"}
        for name in ("triton", "xla")] + [
        {"op": "normalize", "shape": "c", "dtype": "float32", "implementation": name,
         "jax": "0.11"} for name in ("triton", "xla")]
    steps = device.row_plan(cases, ["triton", "xla"], recorded, "0.12", print, repeats=1)
    assert [(s.op, s.label, s.need) for s in steps] == [
        ("matmul", "a bfloat16", 0),  # no bfloat16 matmul row
        ("matmul", "b float32", 1), ("normalize", "d float32", 1),  # shapes not recorded
        ("normalize", "c float32", 2),  # recorded by another jax
        ("matmul", "a float32", 3)]
    # A kernel the record lacks makes the case needed, whatever xla has.
    assert device.need(cases[0], ["mosaic_gpu", "xla"], recorded, "0.12") == 0
    # A row faster than its roofline floor is the timer's error: the shape is timed again.
    recorded[0]["under_roofline_floor"] = True
    assert device.need(cases[0], ["triton", "xla"], recorded, "0.12") == 1


def test_a_short_call_is_chained_until_its_program_outlasts_the_round_trips_jitter():
    """n per call (`harness.chain_calls`): the shorter program lasts about 2.5 ms (a program
    of 2 calls of 3-120 us is shorter than a waited round trip's jitter), within
    [2, MAX_CHAINED_CALLS]; the expected time is the call's latest row, else a multiple of its
    roofline floor."""
    assert harness.chain_calls(1e-2) == 2
    assert harness.chain_calls(1e-5) == 250
    assert harness.chain_calls(1e-9) == harness.MAX_CHAINED_CALLS
    case = types.SimpleNamespace(op="matmul", shape="a", dtype="bfloat16", flops=2e9, bytes=6e6)
    row = {"op": "matmul", "shape": "a", "dtype": "bfloat16", "implementation": "xla",
           "median_ms": 0.25}
    assert device.expected_seconds(case, "xla", [row]) == (0.25e-3, "recorded")
    seconds, source = device.expected_seconds(case, "triton", [row])
    assert source.endswith("roofline floor") and 0 < seconds < 1e-4


def test_merging_two_partial_records_keeps_every_row_with_its_run():
    legacy = {"device_kind": "NVIDIA H200", "jax": "0.11.2",
              "rows": [{"op": "matmul", "shape": "a", "implementation": "xla"}]}
    first = {"started": "2026-11-28T10:00:00+00:00", "device_kind": "NVIDIA H200",
             "jax": "0.12.0.1", "jaxlib": "0.12.0"}
    second = dict(first, started="2026-11-29T10:00:00+00:00")
    record = device.merge(legacy, [{"op": "gather", "implementation": "triton"}], first)
    record = device.merge(record, [{"op": "gather", "implementation": "xla"}], first)
    record = device.merge(record, [{"op": "gather", "implementation": "triton"}], second)
    record = device.merge(record, [{"case": "7x5", "ok": True}], second, key="smoke")
    assert record["runs"] == [first, second]
    assert [r.get("run") for r in record["rows"]] == [None, first["started"], first["started"],
                                                      second["started"]]
    assert record["rows"][0] == legacy["rows"][0] and record["jax"] == "0.11.2"
    assert record["smoke"] == [{"case": "7x5", "ok": True, "run": second["started"]}]


def test_a_step_that_would_pass_the_deadline_is_not_started(capsys):
    ran = []

    def step(name, seconds):
        def run():
            time.sleep(seconds)
            ran.append(name)
            return []
        return device.Step("rows", "matmul", name, ["xla"], run), None

    plan = [step("first", 0.2), step("second", 0.2), step("third", 0.0)]
    assert device._run(plan, budget_s=0.5, record=lambda *a: None) == 0
    # After 0.2 s the second (expected: 0.2 s, the mean so far) fits; after 0.4 s the third
    # does not, however short it would have been.
    assert ran == ["first", "second"]
    assert "[3/3] skipped rows matmul third: would end past 0.5 s" in capsys.readouterr().out


def test_a_cpu_runs_it_only_as_a_dry_run_or_a_test(tmp_path):
    with pytest.raises(SystemExit):
        device.main(["--phases", "rows", "--ops", "gather"])
    with pytest.raises(SystemExit):
        device.main(["--allow-cpu", "--ops", "gather"])  # would write CPU rows to the records


def test_it_runs_in_a_bare_working_tree(tmp_path):
    """A lent GPU runs the command in the working tree with nothing installed: without the
    site's packages' `.pth` hooks (`-S`, which drops an editable install's mapping), the
    repository's `reference/` is still imported as `kernels.reference`, so the command gets as
    far as finding no GPU here."""
    import shutil
    import site

    for folder in ("kernels", "bench", "reference"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(subprocess_env(cpu_only=True),
               PYTHONPATH=":".join([str(tmp_path), *site.getsitepackages()]))
    proc = subprocess.run([sys.executable, "-S", "-m", "bench.device"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert "needs a GPU" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_run_cut_off_keeps_the_rows_it_finished(tmp_path):
    """The command killed (as a lease ends: SIGKILL, no clean-up) after its first row: the
    record holds each finished row whole, with its run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.device", "--allow-cpu", "--ops", "gather", "--phases",
         "rows", "--records", str(tmp_path), "--repeats", "1"],
        cwd=ROOT, env=subprocess_env(cpu_only=False), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    path = record_path("cpu", tmp_path)  # the device kind of a CPU
    deadline = time.time() + 240
    while not path.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    record = json.loads(path.read_text())
    assert 1 <= len(record["rows"]) <= 4, record  # 2 cases (forward, backward), xla only
    started = record["runs"][0]["started"]
    for row in record["rows"]:
        assert row["run"] == started and row["implementation"] == "xla"
        assert row["median_ms"] > 0 and row["max_rel_err"] < 1e-2, row


@pytest.mark.exhaustive  # about a minute: it compiles each row's programs for an H100
@pytest.mark.timeout(600)
def test_dry_run_lists_every_row_with_its_estimate_and_basis(capsys):
    """The plan of one op's rows as a lent GPU would run it: each implementation the GPU runs
    (Triton, and Mosaic GPU on jax >= 0.12) beside xla, each step's estimate resting on its
    programs compiled here for a compile-only H100 and on the H100 record's timings."""
    assert device.main(["--dry-run", "--ops", "gather", "--phases", "rows"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4].startswith("  0 setup: the bench's device cases built here in")
    steps = [line for line in out if line.lstrip()[:1].isdigit() and " rows " in line]
    assert len(steps) == 2  # gather forward and backward at the bench's device shape
    for line in steps:
        assert "triton" in line and "xla" in line and "compiled here" in line, line
        assert "recorded" in line, line  # the H100 record has both gather rows
    summary = out[-1]
    assert summary.startswith("estimate: ") and "budget of 480 s" in summary
    assert "records of NVIDIA H100" in summary


def test_the_smoke_passes_a_right_kernel_and_fails_a_wrong_one():
    """The smoke's bar (`SMOKE_FACTOR` times XLA's own error against float64 truth), on a CPU
    with the Triton kernel interpreted (on a device the compile cases run it natively): met by
    the kernel, missed by the same kernel with one output element off by 64 units of its
    dtype's rounding, or with its gradient's sign flipped. In bfloat16: the interpreted
    kernel's float32 products are TF32, as on its GPU, where XLA's on this CPU are not."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import kernels
    from kernels.compile import CASES

    smallest = min(CASES["matmul"], key=lambda c: sum(a.size for a in c.args))  # 7x5 @ 5x13
    case = dataclasses.replace(
        smallest, call=lambda implementation, a, b: kernels.matmul(
            a, b, implementation=implementation),
        args=tuple(jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in smallest.args))
    [result] = device.smoke(case, ["triton", "xla"])
    assert result["ok"] and result["forward_error"] <= result["xla_errors"][0], result

    def wrong(forward):
        def call(implementation, *arrays):
            out = case.call(implementation, *arrays)
            if implementation != "triton":
                return out
            if forward:
                return out.at[3, 5].add(64 * jnp.finfo(out.dtype).eps * jnp.max(jnp.abs(out)))
            return _flipped_gradient(out)
        return call

    for forward in (True, False):
        [result] = device.smoke(dataclasses.replace(case, call=wrong(forward)), ["triton", "xla"])
        assert not result["ok"], result


def _flipped_gradient(y):
    """`y`, whose gradient is the cotangent's negative (a wrong sign in a backward)."""
    import jax

    @jax.custom_vjp
    def identity(y):
        return y

    identity.defvjp(lambda y: (y, None), lambda _, g: (-g,))
    return identity(y)
