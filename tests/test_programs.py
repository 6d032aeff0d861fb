"""Whole programs compiled as users run them (docs/design.md, "Proof without hardware"): every op's
forward and gradient, and the examples' training steps, compiled by XLA's GPU compiler for
an H100 and by libtpu for a multi-chip v5e, on 4-device meshes with Auto and Explicit
axes (`TARGET_MESHES`), with the default implementation and with the
target's kernel.

Each target compiles in its own process (`programs_run.py`): libtpu and the CUDA plugin's
compile-only devices are per process, and several targets then compile at once under xdist.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.compile import programs
from kernels.compile import implementation_for
from tests.support import PLATFORM, kernels_of, subprocess_env

HERE = Path(__file__).parent
# The mesh kinds each target's op programs compile on: the H100's and the v5e's 4-device meshes,
# Auto and Explicit. A program on one device runs the same kernels unpartitioned, and each
# kernel compiles alone at full size in tests/test_compile.py (Mosaic GPU's programs on one
# GPU in tests/test_mosaic_gpu.py); on the other chips of a family the partitioning is the
# same code. One-device programs and the A100's, v6e's and v4's are left to `python -m
# kernels.compile --programs` (suite time: the one-device ones took about 45 s of CPU, the
# A100's 24, the v6e's 18).
TARGET_MESHES = {"sm_90": ("auto", "explicit"), "v5e": ("auto", "explicit")}
TARGETS = tuple(TARGET_MESHES)
# The README's command compiles one program of each op (a sharded contraction, normalization
# over sharded rows, a vocab-parallel table), each on the target where its kernel is a default
# (the H100's bfloat16 conv2d and gather, the TPU's normalize; matmul beside it): each mesh kind
# and each op in one program. The exhaustive tier compiles every other program on both targets.
FIRST_PROGRAMS = {"sm_90": ("conv2d", "gather_vocab"), "v5e": ("matmul_k", "layer_norm")}
PROGRAM_SETS = {(target, "first"): first for target, first in FIRST_PROGRAMS.items()} | {
    (target, "rest"): tuple(name for name in programs.PROGRAMS if name not in first)
    for target, first in FIRST_PROGRAMS.items()}
AUTO_MOSAIC = "Mosaic kernels cannot run on a TPU mesh with Auto axes"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(cpu_only=False), cwd=HERE.parent)


def _reports(mode: str, target: str, *options: str) -> list[dict]:
    proc = _run(str(HERE / "programs_run.py"), mode, target, *options)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("program_set", [
    "first", pytest.param("rest", marks=pytest.mark.exhaustive)])
def test_every_op_compiles_as_a_whole_program(target, program_set):
    """Each program compiles, holds the compiled kernels exactly where the implementation (or
    the defaults table for the target's platform) puts them, and all-gathers no operand (each
    program's sharding is one its rule runs locally). Compiled Mosaic kernels on Auto axes are
    refused before compiling, naming Explicit axes and shard_map; the default runs `xla`
    there."""
    names = PROGRAM_SETS[(target, program_set)]
    reports = _reports("ops", target, ",".join(TARGET_MESHES[target]), ",".join(names))
    assert len(reports) == len(names) * len(TARGET_MESHES[target]) * 2
    for r in reports:
        where = f"{r['program']} on {r['devices']} {target} ({r['mesh']}, {r['implementation']})"
        implementation = None if r["implementation"] == "None" else r["implementation"]
        if implementation == "mosaic" and r["mesh"] == "auto":
            assert not r["compiled"] and AUTO_MOSAIC in r["error"], (where, r["error"])
            assert "Explicit" in r["error"] and "shard_map" in r["error"], r["error"]
            continue
        assert r["compiled"], (where, r["error"])
        program = programs.PROGRAMS[r["program"]]
        if programs.expects_kernels(program, target, r["mesh"], implementation):
            assert r["kernel_calls"] >= 2, (where, r["kernel_calls"])  # forward and backward
        else:
            assert r["kernel_calls"] == 0, (where, r["kernel_calls"])
        collectives = dict(r["collectives"])
        assert collectives["all-gather"] == 0, (where, collectives)


@pytest.mark.timeout(900)
@pytest.mark.exhaustive  # the README's command compiles one program per mesh kind (above)
@pytest.mark.parametrize("target", ["sm_90", "v5e"])
def test_example_training_steps_compile(target):
    """One training step of examples/train_digits.py's CNN (Flax layers of this library) and of
    examples/sharded_training.py's model, for 8 H100s and a v5e 2x2: the default and the
    kernel compile (Mosaic on Auto axes is refused, naming what works; on Explicit axes it
    compiles)."""
    reports = _reports("models", target)
    assert {(r["program"], r["mesh"], r["implementation"]) for r in reports} == {
        ("train_digits", "auto", "None"), ("sharded_training", "auto", "None"),
        ("train_digits", "auto", implementation_for(target)),
        ("sharded_training", "auto", implementation_for(target)),
        ("sharded_training", "explicit", implementation_for(target))}
    for r in reports:
        where = f"{r['program']} on {r['devices']} {target} ({r['mesh']}, {r['implementation']})"
        if r["implementation"] == "mosaic" and r["mesh"] == "auto":
            assert not r["compiled"] and AUTO_MOSAIC in r["error"], (where, r["error"])
            continue
        assert r["compiled"], (where, r["error"])
        if r["implementation"] != "None":
            assert r["kernel_calls"] >= 10, (where, r["kernel_calls"])


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_language_model_training_step_compiles():
    """One training step of a small language model of this library's Flax layers (Embed,
    a conv stem, LayerNorm, column- and row-parallel Linear layers with replicated biases,
    RMSNorm, a tied read-out) for 4 H100s, Auto and Explicit axes, with the default and every
    GPU kernel this jax has: each compiles, and the kernels run every layer."""
    kernels = [name for name in kernels_of(None) if PLATFORM[name] == "cuda"]
    reports = _reports("language_model", "sm_90", ",".join(["None", *kernels]))
    assert {(r["mesh"], r["implementation"]) for r in reports} == {
        (mesh, name) for mesh in ("auto", "explicit") for name in ("None", *kernels)}
    for r in reports:
        assert r["compiled"], (r["mesh"], r["implementation"], r["error"])
        if r["implementation"] != "None":  # 7 layers' forward and backward kernels
            assert r["kernel_calls"] >= 14, (r["mesh"], r["implementation"], r["kernel_calls"])


@pytest.mark.timeout(600)
def test_command_line_compiles_programs():
    """`python -m kernels.compile --programs` reports per program: compiled (with its kernel
    calls and collectives) or refused before compiling, naming what works; exit status 0
    when nothing failed to compile."""
    proc = _run("-m", "kernels.compile", "--programs", "--targets", "v5e", "--mesh", "auto",
                "--ops", "gather")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "gather" in line]
    assert any(line.startswith("ok") and "None" in line and "all-reduce" in line
               for line in lines), lines
    assert any(line.startswith("refused") and "mosaic" in line for line in lines), lines
    assert "Explicit" in proc.stdout and "4 programs, 0 failed to compile, 2 refused" in proc.stdout
