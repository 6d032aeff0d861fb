"""The benchmark harness: rows, labels and the error column (no timing is asserted)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from bench import harness
from bench.__main__ import main, record_path
from kernels import _targets, registry
from kernels.compile import CASES
from kernels.matmul import matmul
from tests.support import needs, random, skip_without_xla_gpu_compiler, tolerance


def test_bench_harness_rows():
    a, b = random((64, 32), jnp.float32, 1), random((32, 16), jnp.float32, 2)
    case = harness.Case(op="matmul", shape="64x32 @ 32x16", dtype="float32", args=(a, b),
                        run=lambda name, interpret: lambda a, b: matmul(
                            a, b, implementation=name, interpret=interpret),
                        expected=np.asarray(a, np.float64) @ np.asarray(b, np.float64),
                        flops=2 * 64 * 32 * 16, bytes=4 * (64 * 32 + 32 * 16 + 64 * 16),
                        baselines={"numpy": np.matmul}, parts={"copy": lambda a, b: a + 0})
    rows = harness.measure(case, [("triton", True), ("mosaic", "strict"), ("xla", False)],
                           repeats=2)
    assert [r["implementation"] for r in rows] == ["triton (interpret)", "mosaic (strict)", "xla",
                                                   "numpy", "copy"]
    assert rows[0]["kind"] == "interpreted" and rows[0]["GB/s"] is None
    rows = rows[:1] + rows[2:]
    assert rows[1]["vs_xla"] == 1.0
    # The interpreted Triton kernel multiplies float32 as its GPU does, TF32 (`dot_platform`).
    tf32 = tolerance(jnp.float32, dot=True, platform="gpu")["rtol"]
    assert 1e-5 < rows[0]["max_rel_err"] < tf32
    assert all(r["max_rel_err"] < 1e-5 for r in rows[1:3])
    assert rows[3]["max_rel_err"] is None and rows[3]["GB/s"] is None
    assert "triton (interpret)" in harness.table(rows)


def test_backward_rows_differentiate_the_chosen_arguments():
    """A backward row's error column compares the kernel's gradient with the reference's."""
    a, b = random((16, 8), jnp.float32, 1), random((8, 4), jnp.float32, 2)
    forward = harness.Case(op="matmul", shape="16x8 @ 8x4", dtype="float32", args=(a, b),
                           run=lambda name, interpret: lambda a, b: matmul(
                               a, b, implementation=name, interpret=interpret),
                           expected=a @ b, flops=0, bytes=0)
    case = harness.backward(forward, lambda a, b: a @ b, wrt=(1,))
    (row, _) = harness.measure(case, [("mosaic", True), ("xla", False)], repeats=1)
    assert row["op"] == "matmul backward" and row["max_rel_err"] < 1e-5
    assert row["GB/s"] is None and row["floor_H100_us"] is None
    # The gradient is with respect to b only: a's would have a's shape.
    assert np.shape(case.expected[0]) == (8, 4)


@pytest.fixture(scope="module")
def strict_matmul_report() -> tuple[str, str]:
    """(stdout, stderr) of `python -m bench --ops matmul --interpret strict` (one run, read by
    the tests of its report and of the `--interpret` option)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["--ops", "matmul", "--interpret", "strict", "--no-design",
                     "--repeats", "1"]) == 0
    return out.getvalue(), err.getvalue()


def test_default_report_is_read_at_a_glance(strict_matmul_report):
    """The default view of the rows: per op, each case that more than xla ran in one line (xla's
    time, each kernel's ratio to it, the largest error), no line past 160 characters; xla's
    rows at CPU sizes only under `--rows all`, and a case timed by an interpreted row not timed
    again at CPU sizes."""
    out, err = strict_matmul_report
    lines = out.splitlines()
    assert max(map(len, lines)) <= 160 and len(lines) <= 60, out
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    columns = lines[header].split()  # mosaic_gpu's simulator beside mosaic's on jax >= 0.12
    assert columns[:7] == ["op", "shape", "dtype", "xla", "ms", "mosaic", "strict"], columns
    assert columns[-2:] == ["max", "err"], columns
    compared = [line for line in lines[header + 2:] if line.startswith("matmul")]
    assert len(compared) == 4 and all(re.search(r"  \d+\.\d\dx  ", line) for line in compared)
    assert not any("512x512" in line for line in lines)  # xla alone: under --rows all
    planned = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[")]
    assert len(planned) == len(set(line.split(":")[0] for line in planned))


def test_comparison_columns_are_short_labels():
    """`comparison`'s columns: an interpreted kernel by its name, a simulator's with "strict",
    a host baseline by its package, so a case with every kind still fits 160 characters."""
    def row(name, ratio):
        return {"op": "conv2d", "shape": "8x64x64x32 * 3x3x1x32 (feature_group_count=32)",
                "dtype": "bfloat16", "implementation": name, "kind": "speed",
                "median_ms": 1.0, "vs_xla": ratio, "max_rel_err": 1e-3}

    names = ["xla", "triton (interpret)", "mosaic (interpret)", "scipy.signal.convolve2d",
             "mosaic (strict)", "mosaic_gpu (strict)"]
    text = harness.comparison([row(name, 12345.67) for name in names])
    header = text.splitlines()[0].split()
    assert header == ["op", "shape", "dtype", "xla", "ms", "triton", "mosaic", "scipy", "mosaic",
                      "strict", "mosaic_gpu", "strict", "max", "err"], header
    assert max(map(len, text.splitlines())) <= 160, text


def test_interpret_option_takes_the_ops_values(capsys, strict_matmul_report):
    with pytest.raises(SystemExit):
        main(["--interpret", "fast"])
    assert "invalid choice" in capsys.readouterr().err
    out, _ = strict_matmul_report
    assert "mosaic (strict)" in out and "triton (interpret)" not in out
    assert "matmul backward" in out


def test_record_needs_a_device_and_names_its_file(capsys):
    """CPU timings are never evidence for a default; a device's record goes under bench/."""
    with pytest.raises(SystemExit):
        main(["--record", "--ops", "matmul"])
    assert "--record needs a GPU or TPU" in capsys.readouterr().err
    assert record_path("NVIDIA H100 80GB HBM3").name == "nvidia_h100_80gb_hbm3.json"
    assert record_path("TPU v5 lite").parent.name == "records"


def test_bench_report_and_csv_and_plots(capsys, tmp_path):
    """The report on stdout opens with the summary (device, timer, what is proven, then per op its
    default on each platform and why, and the design figures in a line per device); with
    `--rows all` every timing row follows, then (`--design grouped`) the design figures grouped
    per case; stderr shows progress only, never a row; --csv and --plot write every row and one
    PNG per op."""
    import csv

    csv_path, plots = tmp_path / "rows.csv", tmp_path / "plots"
    assert main(["--ops", "gather", "--no-interpret", "--repeats", "1", "--rows", "all",
                 "--design", "grouped", "--csv", str(csv_path), "--plot", str(plots)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("jax ") and lines[1] == "timer: waited per call"
    assert lines[2].startswith("proven: ")
    op_at = lines.index("gather")
    assert lines[op_at - 2].startswith("ran on a device: ")
    assert lines[op_at + 1].startswith("  default on GPU: triton, then xla "
                                       "(bench/records/nvidia_h100_80gb_hbm3.json: ")
    assert any(line.startswith("  default here (cpu): xla") for line in lines[op_at:])
    assert any(line.startswith("  design H100: triton 3 launches, fewest waves ")
               for line in lines)
    assert any(line.startswith("  design TPU v5e: mosaic 2 launches, ") for line in lines)
    assert err.splitlines()[:2] == [
        "[1/2] gather table 32000x512, 2048 ids bfloat16: xla",
        "[2/2] gather backward table 32000x512, 2048 ids bfloat16: xla"], err
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["op"] for r in rows] == ["gather", "gather backward"]
    assert not any(r["shape"] in line for r in rows for line in err.splitlines()[2:])
    table = [i for i, line in enumerate(lines) if line.startswith(rows[0]["op"].ljust(18) + "  ")]
    assert table and all(any(line.startswith(r["op"].ljust(18) + "  " + r["shape"])
                             for line in lines) for r in rows)
    design_at = lines.index("gather: table 32000x4096 bfloat16, 8192 ids, axis=0, mode=None")
    assert design_at > table[-1]
    expected = [("H100", "forward"), ("", "backward: pieces"), ("", "backward: scatter-add"),
                *([("", "forward"), ("", "backward: pieces"), ("", "backward: scatter-add")]
                  if not registry.unavailable("mosaic_gpu") else []),
                ("", "forward and backward"),  # XLA's own program of the layer
                ("TPU v5e", "forward"), ("", "backward: scatter-add")]
    launches = lines[design_at + 3:design_at + 3 + len(expected)]
    assert all(line.startswith("  " + target) and launch in line
               for line, (target, launch) in zip(launches, expected, strict=True)), launches
    assert lines[design_at + 3 + len(expected)].startswith(
        "  H100, forward and backward: triton ")
    assert float(rows[0]["bytes"]) > 0 and rows[0]["implementation"] == "xla"
    assert (plots / "gather.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_design_launches_are_labelled_with_what_they_compute():
    """Each launch says which part of the op it computes: matmul's forward, dA and dB; a
    convolution's dX (the forward's own kernel when shapes match, one launch per sub-pixel
    phase of a strided one) and dW; normalize's and gather's by kernel."""
    from bench import design

    rows = list(design.rows(["matmul", "conv2d"], compile_kernels=False))
    square = [r["launch"] for r in rows if r["case"].startswith("4096x4096 @")
              and r["target"] == "v5e"]
    assert square == ["forward", "dA", "dB"]
    for implementation in {r["implementation"] for r in rows} - {"xla", "mosaic"}:
        on_h100 = [r for r in rows if r["target"] == "sm_90"
                   and r["implementation"] == implementation]
        same = [r["launch"] for r in on_h100 if r["case"] == "32x56x56x64 * 3x3x64x64 bfloat16"]
        assert same == ["forward, dX", "dW"], implementation
        strided = [r["launch"] for r in on_h100 if "stride=2" in r["case"]]
        assert strided == ["forward", "dX phase 1", "dX phase 2", "dX phase 3", "dX phase 4",
                           "dW"], implementation
    text = design.grouped(rows)
    assert "conv2d: 32x28x28x128 * 3x3x128x256 bfloat16, stride=2" in text
    assert "dX phase 4" in design.table(rows)


def test_design_figures_show_programs_against_the_device():
    """The design table works out every launch for an H100 and a TPU v5e without a device: at
    the (1M, 64) axis-0 shape each Triton normalize kernel runs two waves of 132 SMs."""
    from bench import design

    rows = list(design.rows(["normalize"], compile_kernels=False))
    batch_norm = [r for r in rows if r["case"].startswith("normalize 1048576x64")]
    assert {r["target"] for r in batch_norm} == {"sm_90", "v5e"}
    for r in batch_norm:
        if r["implementation"] == "triton":
            assert r["programs"] >= 264 and r["waves"] >= 2.0, r
        assert r["bytes"] > 0 and r["min_bytes"] > 0
    text = design.table(rows)
    assert "normalize_moments_triton" in text and "waves" in text and "steps" in text


@needs("mosaic_gpu")
def test_design_figures_set_mosaic_gpu_beside_xla():
    """gather's design case on an H100: the Mosaic GPU launches compiled for sm_90a, stating
    within 1.2x the op's minimum traffic (the gathered rows read and written once; the
    cotangent read and the table gradient written once), beside XLA's own program of the same
    layer (forward output and gradient from a cotangent), compiled for an H100 too. (normalize's
    design cases compile in the bench, at about 20 s.)"""
    from bench import design
    from kernels.gather.common import Problem, gather_bytes, scatter_bytes

    rows = [r for r in design.rows(["gather"]) if r["target"] == "sm_90"]
    mosaic = [r for r in rows if r["implementation"] == "mosaic_gpu"]
    (xla,) = [r for r in rows if r["implementation"] == "xla"]
    assert len(mosaic) == 3 and all(r["resources"].startswith("smem ") for r in mosaic)
    p = Problem(1, 32000, 4096, 8192, jnp.dtype(jnp.bfloat16), "clip", None)
    assert sum(r["bytes"] for r in mosaic) <= 1.2 * (gather_bytes(p) + scatter_bytes(p))
    assert {r["launch"] for r in mosaic} == {"forward", "backward: pieces",
                                             "backward: scatter-add"}
    assert xla["resources"] == "XLA" and xla["grid"].endswith(" kernels"), xla
    assert xla["bytes"] >= xla["min_bytes"] / 2 > 0, xla  # it reads and writes its operands
    total = sum(r["bytes"] * r["count"] for r in mosaic)
    assert f"mosaic_gpu {total / xla['bytes']:.2f}x (training)" in (
        design.target_line(rows, "sm_90"))


@pytest.mark.parametrize("op", ["matmul", "conv2d"])
def test_fused_layer_moves_its_output_once_for_inference(op):
    """The design's fused layer (`activation(x @ w + b) + residual`; `relu(conv + b)`) compiled
    as whole programs for an H100: with the Triton kernels inference is one launch moving its
    operands and output once; XLA's own program writes the float32 pre-activation and reads it
    back (at least two more passes of the output's size). (The training step's figures:
    `test_fused_layer_training_step_moves_no_more_than_xla`.)"""
    from bench import design

    skip_without_xla_gpu_compiler()
    (case,) = [c for c in CASES[op] if c.inference]
    target = _targets.TARGETS["sm_90"]
    out = jax.eval_shape(case.forward("xla"), *case.args)
    fused = design._program_row(case, target, "inference", "triton")
    xla = design._program_row(case, target, "inference", "xla")
    assert fused["grid"] == "1 kernels" and fused["bytes"] == fused["min_bytes"], fused
    assert xla["bytes"] >= fused["bytes"] + 2 * out.size * out.dtype.itemsize, xla


# The most bytes a kernel implementation's training program of the fused layer may move against
# XLA's own (`kernels.compile.CASES`' inference cases: forward and gradients from a cotangent):
# with the 16-bit layer's rule, z and dZ in bfloat16 (`reference.epilogue.layer`), the gelu
# layer moves 0.90x on an H100 and a B200, the conv layer 0.61x with Triton and 0.58-0.59x
# with Mosaic GPU (its images read in place).
TRAINING_BYTES_VS_XLA = {("matmul", "triton", "sm_90"): 1.0, ("conv2d", "triton", "sm_90"): 1.15,
                         ("matmul", "mosaic_gpu", "sm_90"): 1.0,
                         ("matmul", "mosaic_gpu", "sm_100"): 1.0,
                         ("conv2d", "mosaic_gpu", "sm_90"): 1.0,
                         ("conv2d", "mosaic_gpu", "sm_100"): 1.0}


_TRAINING_BYTES = """
import json, sys
from kernels.compile import use_compile_only_devices
use_compile_only_devices()
from bench import design
from kernels import _targets
from kernels.compile import CASES
op, impl, target = sys.argv[1:]
(case,) = [c for c in CASES[op] if c.inference]
print(json.dumps([design._program_row(case, _targets.TARGETS[target], "training", name)["bytes"]
                  for name in (impl, "xla")]))
"""


@pytest.mark.parametrize("op,impl,target", [
    pytest.param(*key, marks=[pytest.mark.exhaustive] if key[1] == "mosaic_gpu" else [])
    for key in TRAINING_BYTES_VS_XLA])
def test_fused_layer_training_step_moves_no_more_than_xla(op, impl, target):
    """The fused layer's training program (forward and gradients from a cotangent) compiled
    for a compile-only GPU moves at most `TRAINING_BYTES_VS_XLA` times the bytes of XLA's own
    program of the same layer, every launch counted (bytes by XLA's cost analysis). Each
    target in a process of its own: Mosaic GPU keeps the first GPU generation a process
    compiled for (`kernels.compile.mosaic_gpu.OWN_PROCESS`)."""
    import json
    import subprocess
    import sys

    skip_without_xla_gpu_compiler()
    if registry.unavailable(impl):  # Mosaic GPU on jax < 0.12
        pytest.skip(f"{impl}: {registry.unavailable(impl)}")
    root = pathlib.Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-c", _TRAINING_BYTES, op, impl, target],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels_bytes, xla_bytes = json.loads(done.stdout.splitlines()[-1])
    assert kernels_bytes <= TRAINING_BYTES_VS_XLA[op, impl, target] * xla_bytes, (
        kernels_bytes, xla_bytes)


def test_xla_library_calls_count_their_operands_and_result():
    """XLA's cost analysis states -1 byte for a library call (cuBLAS, cuDNN): the design
    figures count its operands and its result instead (not its scratch), from the HLO."""
    from kernels.compile.programs import _custom_call_bytes

    entry = "\n".join([
        "ENTRY %main {",
        "  %p0 = bf16[32,8]{1,0} parameter(0)",
        "  %p1 = bf16[8,16]{1,0} parameter(1)",
        "  %fusion = f32[8,16]{1,0} fusion(%p1), kind=kLoop, calls=%fused",
        "  ROOT %gemm = (bf16[32,16]{1,0}, s8[4194304]{0}) custom-call(%p0, %fusion), "
        'custom_call_target="__cublas$gemm"',
        "}"])
    assert _custom_call_bytes(entry) == (1, 32 * 16 * 2 + 32 * 8 * 2 + 8 * 16 * 4)


def test_design_figures_of_a_strided_convolution():
    """Conv launches state their flops against the forward's: the Triton input-gradient phases
    of the stride-2 ResNet layer together execute the forward's flops, not 4x as the one
    launch over the zero-dilated dy did."""
    from bench import design

    rows = [r for r in design.rows(["conv2d"], compile_kernels=False)
            if "stride=2" in r["case"] and r["target"] == "sm_90"
            and r["implementation"] == "triton"]
    assert rows and all(r["op_flops"] for r in rows)
    # After the forward: the four phases of dX (the 1-tap one a matmul), then dW.
    phases = [r for r in rows[1:] if "weight_grad" not in r["kernel"]]
    assert len(phases) == 4 and rows[0]["kernel"] == "conv2d_triton"
    assert sum(r["flops"] for r in phases) <= 1.1 * rows[0]["op_flops"]
    assert "flops vs op" in design.table(rows)


def test_chained_program_holds_every_call_and_their_values():
    """The device timer's program (`harness.chain`): n calls that XLA neither merges nor
    hoists, the first and a loop of n - 1, each result passed whole through an optimization
    barrier, and the links leave the operands' values as they are (a CPU checks the method,
    never a timing)."""
    a, b = random((64, 32), jnp.float32, 1), random((32, 16), jnp.float32, 2)
    fn = jax.jit(lambda a, b: matmul(a, b, implementation="xla"))
    program = harness.chain(fn, 5)
    lowered = program.lower(a, b)
    assert lowered.as_text().count("optimization_barrier") == 2
    # After XLA's optimizations: the first product and the loop's, neither hoisted out of the
    # loop, merged or narrowed to the element the link reads.
    compiled = lowered.compile().as_text()
    assert compiled.count(" = f32[64,16]{1,0} dot(") == 2 and " while(" in compiled
    np.testing.assert_array_equal(np.asarray(program(a, b)), np.asarray(fn(a, b)))
    ids = jnp.asarray([3, 1, 4, 1, 5], jnp.int32)  # integer operands are linked too
    assert np.array_equal(harness.chain(lambda i: i * 2, 3)(ids), ids * 2)


def test_chained_program_launches_every_kernel_on_an_h100():
    """Compiled by XLA's GPU compiler for an H100 (compile-only), the chained program of a
    Triton kernel launches it once, then in a loop whose trip count XLA knows (its GPU runtime
    then runs the body n - 1 times with no predicate read back to the host)."""
    from kernels.compile import programs

    device = programs.devices("sm_90", 1)[0]
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))
            for shape in ((256, 128), (128, 64))]
    fn = lambda a, b: matmul(a, b, implementation="triton", interpret=False)  # noqa: E731
    with jax.default_device(device):
        text = harness.chain(fn, 4).lower(*args).compile().as_text()
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 2
    assert '"known_trip_count":{"n":"3"}' in text


def test_rows_under_the_timer_floor_are_marked():
    """Under the timer's floor: the time is the timer's. Under the roofline floor: no call can
    be that fast (the H200's Triton layer norm at 26 us against a 56 us floor)."""
    rows = [{"floor_H100_us": floor, "timer": timer, "median_ms": ms} for floor, timer, ms in
            [(2.0, "chained", 0.004), (80.0, "chained", 0.026), (None, "chained", 0.01),
             (2.0, "waited", 0.001), (56.0, "chained", float("nan"))]]
    harness.mark_timer_floor(rows, 5.0, harness.roofline_device("NVIDIA H100 80GB HBM3"))
    assert [r["below_timer_floor"] for r in rows] == [True, False, None, None, False]
    assert [r["under_roofline_floor"] for r in rows] == [False, True, None, None, None]
    assert harness.roofline_device("TPU v5 lite") == "TPU v5e"
    assert harness.roofline_device("cpu") is None
