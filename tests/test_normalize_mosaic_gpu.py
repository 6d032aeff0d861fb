"""normalize's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12), which
has not joined the op's shared test base yet (its registry entry's `shared_tests`): the forward
and the backward in Mosaic GPU's interpreter against float64 truth, what it rejects, and the
real compilers: each kernel alone for
sm_90a and sm_100a (ptxas's registers, spills, shared memory), whole programs on 1 and 4 GPUs,
and a cuda export. On an older jax it declines with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import registry
from kernels.compile import CASES
from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm
from tests.support import assert_close, random, weighted_sum

HERE = Path(__file__).parent
MISSING = registry.unavailable("mosaic_gpu")
needs_mosaic_gpu = pytest.mark.skipif(MISSING is not None, reason=f"mosaic_gpu: {MISSING}")
pytestmark = pytest.mark.usefixtures("strict_interpret")


def _truth(x, scale, offset, subtract_mean=True, residual=None, epsilon=1e-5):
    x = np.asarray(x, np.float64) + (0 if residual is None else np.asarray(residual, np.float64))
    mean = x.mean(-1, keepdims=True) if subtract_mean else 0.0
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + epsilon)
    y = y if scale is None else y * np.asarray(scale, np.float64)
    return y if offset is None else y + np.asarray(offset, np.float64)


@pytest.mark.skipif(MISSING is None, reason="this jax has Mosaic GPU")
def test_an_older_jax_declines_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"layer_norm: mosaic_gpu: needs jax >= 0.12"):
        layer_norm(jnp.ones((4, 128)), implementation="mosaic_gpu")


@needs_mosaic_gpu
@pytest.mark.parametrize("shape", [(37, 1024), (3, 7), (5, 300), (2, 3, 256), (3, 9000)],
                         ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_layer_norm_forward_matches_float64_truth(shape, dtype):
    """A ragged last block (37 rows in blocks of 8 or 16), rows shorter than a piece and not
    a multiple of 16 bytes (7: padded in the wrapper), a ragged last piece (300), batch dims,
    and rows of 36 pieces, streamed per pass (9000); "strict" runs the interpreter with its
    race detector."""
    x = random(shape, dtype, seed=1)
    scale, offset = random(shape[-1:], jnp.float32, seed=2), random(shape[-1:], jnp.float32, 3)
    y = layer_norm(x, scale, offset, implementation="mosaic_gpu")
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, _truth(x, scale, offset), dtype, reduction_length=shape[-1])


@needs_mosaic_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rms_norm_with_residual_and_out_dtype(dtype):
    x, residual = random((6, 512), dtype, seed=4), random((6, 512), dtype, seed=5)
    scale = random((512,), jnp.float32, seed=6)
    y, summed = rms_norm(x, scale, residual=residual, out_dtype=jnp.float32,
                         implementation="mosaic_gpu", interpret=True)
    assert y.dtype == jnp.float32 and summed.dtype == dtype
    want_sum = (np.asarray(x, np.float64) + np.asarray(residual, np.float64))
    assert_close(summed, want_sum, dtype)
    # y is normalized from the float32 sum (not the rounded one), and written in float32.
    assert_close(y, _truth(x, scale, None, subtract_mean=False, residual=residual, epsilon=1e-6),
                 jnp.float32, reduction_length=512)


@needs_mosaic_gpu
def test_layer_norm_with_residual_and_without_parameters():
    x, residual = random((9, 384), jnp.float32, seed=10), random((9, 384), jnp.float32, 11)
    y, summed = layer_norm(x, residual=residual, implementation="mosaic_gpu")
    assert_close(summed, np.asarray(x, np.float64) + np.asarray(residual, np.float64),
                 jnp.float32)
    assert_close(y, _truth(x, None, None, residual=residual), jnp.float32, reduction_length=384)


@needs_mosaic_gpu
@pytest.mark.parametrize("case", ["large_mean", "small_spread"])
def test_statistics_where_epsilon_and_cancellation_matter(case):
    """A large mean with a unit spread (1e4 + N(0, 1): the mean is subtracted before the
    squares, in float32 as XLA does), and a spread of 1e-3, where epsilon (1e-5) is most of
    the variance: a kernel that dropped or misplaced epsilon is off by 30% there."""
    base = np.random.default_rng(12).standard_normal((37, 1024))
    x = jnp.asarray((1e4 + base) if case == "large_mean" else 1e-3 * base, jnp.float32)
    y = layer_norm(x, implementation="mosaic_gpu")
    # Two sums of 1024 terms reach y (the mean's, then the variance's): XLA's own float32
    # layer norm is 9.1e-4 off the float64 truth at the large mean, within that rule's 9.8e-4.
    assert_close(y, _truth(x, None, None), jnp.float32, reduction_length=2 * 1024)


def _float64_gradients(loss, *args):
    with jax.enable_x64(True):
        return jax.grad(loss("xla"), argnums=tuple(range(len(args))))(
            *[a.astype(jnp.float64) for a in args])


@needs_mosaic_gpu
@pytest.mark.parametrize("op", [layer_norm, rms_norm], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_backward_kernel_matches_float64_truth(op, dtype):
    """dx, dscale and doffset from the backward kernel over ragged row blocks (37 rows of 256:
    4 whole blocks of 8 and a CTA for the last 5), against JAX's gradient of the reference in
    float64."""
    x = random((37, 256), dtype, seed=7)
    params = [random((256,), jnp.float32, 8), random((256,), jnp.float32, 9)]
    params = params[:1] if op is rms_norm else params

    def loss(implementation):
        return lambda x, *ps: weighted_sum(op(x, *ps, implementation=implementation))

    got = jax.grad(loss("mosaic_gpu"), argnums=tuple(range(1 + len(params))))(x, *params)
    want = _float64_gradients(loss, x, *params)
    assert got[0].dtype == dtype
    assert_close(got[0], want[0], dtype, reduction_length=256)
    for g, w in zip(got[1:], want[1:]):  # a sum over the 37 rows of float32 terms
        assert_close(g, w, jnp.float32, reduction_length=37)


@needs_mosaic_gpu
def test_backward_ctas_walking_several_blocks():
    """300 one-row blocks over the H100's two waves (264 CTAs): CTAs walk one or two blocks
    and sum them in registers before writing their partial rows of dscale and doffset."""
    x = random((300, 128), jnp.float32, seed=13)
    scale, offset = random((128,), jnp.float32, 14), random((128,), jnp.float32, 15)
    config = NormalizeConfig(block_groups=1)

    def loss(implementation):
        return lambda x, s, o: weighted_sum(layer_norm(
            x, s, o, implementation=implementation,
            config=None if implementation == "xla" else config))

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, scale, offset)
    want = _float64_gradients(loss, x, scale, offset)
    assert_close(got[0], want[0], jnp.float32, reduction_length=128)
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, jnp.float32, reduction_length=300)


@needs_mosaic_gpu
def test_backward_of_the_residual_add_and_its_sum():
    """Both outputs used: the sum's cotangent reaches dx (= dresidual) in the kernel."""
    x, residual = random((20, 384), jnp.float32, 16), random((20, 384), jnp.float32, 17)
    scale = random((384,), jnp.float32, 18)

    def loss(implementation):
        def f(x, residual, scale):
            y, summed = layer_norm(x, scale, residual=residual, implementation=implementation)
            return weighted_sum(y) + weighted_sum(summed * summed)
        return f

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, residual, scale)
    want = _float64_gradients(loss, x, residual, scale)
    # x + residual is rounded to float32 before the sum's square reaches the cotangent.
    for g, w in zip(got[:2], want[:2]):
        assert_close(g, w, jnp.float32, reduction_length=384)
    assert_close(got[2], want[2], jnp.float32, reduction_length=20)


@needs_mosaic_gpu
def test_second_order_gradients():
    """grad of grad: the backward kernel takes the cotangents of the saved mean and 1/std."""
    x, scale = random((9, 128), jnp.float32, 19), random((128,), jnp.float32, 20)

    def loss(implementation):
        def inner(x, s):
            return weighted_sum(layer_norm(x, s, implementation=implementation))
        return lambda x, s: weighted_sum(jax.grad(inner, argnums=(0, 1))(x, s)[0])

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1))(x, scale)
    want = _float64_gradients(loss, x, scale)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32, reduction_length=2 * 128)


@needs_mosaic_gpu
@pytest.mark.parametrize("shape,axis", [((300, 37), 0), ((6, 20, 7), -2), ((4, 9, 6), (0, 2))],
                         ids=str)
def test_the_columns_layout_and_axes_apart(shape, axis):
    """Normalized axes followed by others (transposed to rows by XLA) and axes that are not
    contiguous, forward and gradient, against float64 truth."""
    axes = (axis,) if isinstance(axis, int) else axis
    x = random(shape, jnp.float32, seed=21)
    params = [random(tuple(shape[a] for a in axes), jnp.float32, seed) for seed in (22, 23)]

    def loss(implementation):
        return lambda x, s, o: weighted_sum(normalize(x, s, o, axis=axis,
                                                      implementation=implementation))

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, *params)
    want = _float64_gradients(loss, x, *params)
    n = int(np.prod([shape[a] for a in axes]))
    assert_close(got[0], want[0], jnp.float32, reduction_length=n)
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, jnp.float32, reduction_length=x.size // n)


@needs_mosaic_gpu
@pytest.mark.parametrize("config,message", [
    (NormalizeConfig(block_reduced=128), "config.block_reduced: the Mosaic GPU kernels take "
                                         "whole rows"),
    (NormalizeConfig(block_groups=0), "config.block_groups must be an int in"),
    (NormalizeConfig(block_groups=300), "config.block_groups must be an int in"),
    (NormalizeConfig(block_groups=200), "bytes of shared memory a CTA plans"),
])
def test_a_config_it_cannot_run_is_rejected(config, message):
    with pytest.raises(ValueError, match=message):
        layer_norm(jnp.ones((256, 4096)), implementation="mosaic_gpu", config=config)


@needs_mosaic_gpu
def test_float64_declines_and_a_sequence_falls_through():
    with jax.enable_x64(True):
        x = jnp.ones((4, 128), jnp.float64)
        with pytest.raises(NotImplementedError, match="float64 is not supported on Mosaic GPU"):
            layer_norm(x, implementation="mosaic_gpu")
        assert layer_norm(x, implementation=("mosaic_gpu", "xla")).dtype == jnp.float64


def _compiled(script: str) -> list[dict]:
    """Runs `script` in a process of its own (compile-only GPUs are per process, and Mosaic
    GPU compiles for one GPU generation per process: `kernels.compile.mosaic_gpu.OWN_PROCESS`)
    and returns the JSON lines it prints."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@needs_mosaic_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_every_kernel_compiles_without_spills(target):
    """`python -m kernels.compile` for the normalize cases Mosaic GPU takes: Mosaic GPU's
    layout inference accepts the kernel (the interpreter does not check layouts), and ptxas
    fits it in registers with no spills."""
    rows = _compiled(
        "import json, dataclasses\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import CASES, compile_kernels\n"
        "for case in CASES['normalize']:\n"
        "    reports = compile_kernels(case.function('mosaic_gpu'), *case.args, "
        f"target='{target}', implementation='mosaic_gpu')\n"
        "    for r in reports:\n"
        "        print(json.dumps(dataclasses.asdict(r)))\n")
    # Every case (forward and backward kernels; the axis=(0, 2) case's transpose is XLA's).
    assert len(rows) == 2 * len(CASES["normalize"])
    assert {r["name"] for r in rows} == {"normalize_forward_mosaic_gpu",
                                         "normalize_backward_mosaic_gpu"}
    for r in rows:
        assert r["compiled"], r
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, r
        assert r["shared_bytes"] <= r["shared_limit"], r


@needs_mosaic_gpu
@pytest.mark.timeout(600)
def test_whole_programs_and_an_export_carry_the_kernel():
    """The layer_norm and rms_norm programs (forward and gradient) compiled for H100s on one
    device and on 4-device meshes with Auto and Explicit axes: the kernel's custom call in each
    and its backward's, no operand all-gathered; and a cuda export
    needs no disabled safety check (Mosaic GPU's custom call is on JAX's stable list)."""
    reports = _compiled(
        "import dataclasses, json\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import programs\n"
        "for r in programs.compile_ops('sm_90', 4, implementations=('mosaic_gpu',), "
        "programs=['layer_norm', 'rms_norm']):\n"
        "    print(json.dumps(dataclasses.asdict(r)))\n"
        "import jax, jax.numpy as jnp, kernels\n"
        "from kernels._pallas import on_target\n"
        "from kernels._targets import TARGETS\n"
        "x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)\n"
        "fn = jax.jit(lambda x: kernels.layer_norm(x, implementation='mosaic_gpu'))\n"
        "with on_target(TARGETS['sm_90']):\n"
        "    text = jax.export.export(fn, platforms=('cuda',))(x).mlir_module()\n"
        "print(json.dumps({'export_calls': text.count('mosaic_gpu_v2')}))\n")
    programs, (export,) = reports[:-1], reports[-1:]
    assert len(programs) == 6
    for r in programs:
        assert r["compiled"] and r["kernel_calls"] >= 2, r
        assert dict(r["collectives"])["all-gather"] == 0, r
    assert export["export_calls"] == 1
