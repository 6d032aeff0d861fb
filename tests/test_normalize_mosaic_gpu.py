"""What normalize's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12) adds
to the op's shared test base (which runs it too): its plans (ragged blocks and pieces, streamed
rows, CTAs walking blocks, the backward's summed terms, the mean's correction) in Mosaic GPU's
interpreter against float64 truth, what it rejects and declines, and the real compilers: each
kernel alone for sm_90a and sm_100a (ptxas's registers and spills), whole programs on 1 and 4
GPUs, and a cuda export. On an older jax it declines with the reason."""

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
from kernels.normalize import NormalizeConfig, layer_norm
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
@pytest.mark.parametrize("shape,config,walked", [
    ((40, 128), NormalizeConfig(block_groups=1, num_partials=3), True),
    ((3, 16384), None, False)], ids=["walking", "partial-rows-per-block"])
def test_backward_dscale_and_doffset_terms(shape, config, walked):
    """The backward's two ways to dscale and doffset: 3 CTAs walking 40 one-row blocks, each
    summing its blocks' terms in shared memory before writing them (`config.num_partials`: the
    CTAs, as the Triton backward's partials); and rows whose terms do not fit (2 x 16384
    float32 accumulators), each CTA writing its block's terms as partial rows. Both against
    float64 truth."""
    from kernels.normalize.common import Problem
    from kernels.normalize.mosaic_gpu.config import plan_of

    problem = Problem(1, shape[0], shape[1], True, jnp.dtype(jnp.float32), True, 1e-5, True,
                      True)
    plan = plan_of(problem, config, backward=True)
    assert plan.accumulate == walked
    assert plan.programs == (3 if walked else plan.num_blocks)
    x = random(shape, jnp.float32, seed=13)
    scale, offset = random(shape[-1:], jnp.float32, 14), random(shape[-1:], jnp.float32, 15)

    def loss(implementation):
        return lambda x, s, o: weighted_sum(layer_norm(
            x, s, o, implementation=implementation,
            config=None if implementation == "xla" else config))

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, scale, offset)
    want = _float64_gradients(loss, x, scale, offset)
    assert_close(got[0], want[0], jnp.float32, reduction_length=shape[1])
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, jnp.float32, reduction_length=shape[0])


@needs_mosaic_gpu
def test_its_interpreter_declines_a_mesh_of_several_devices():
    """Mosaic GPU's interpreter runs through host callbacks, one simulated GPU per process: on
    a mesh of several CPU devices (Auto or Explicit axes, or inside shard_map) it declines with
    the reason, and a sequence falls through to xla; one device runs it."""
    script = (
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import AxisType, NamedSharding, PartitionSpec as P\n"
        "import kernels\n"
        "x = jnp.arange(8 * 256.0).reshape(8, 256)\n"
        "for kind in (AxisType.Auto, AxisType.Explicit):\n"
        "    mesh = jax.make_mesh((4,), ('data',), axis_types=(kind,))\n"
        "    with jax.set_mesh(mesh):\n"
        "        xs = jax.device_put(x, NamedSharding(mesh, P('data')))\n"
        "        try:\n"
        "            jax.jit(lambda x: kernels.layer_norm(x, implementation='mosaic_gpu'))(xs)\n"
        "        except NotImplementedError as e:\n"
        "            print('declined:', e)\n"
        "        y = jax.jit(lambda x: kernels.layer_norm(\n"
        "            x, implementation=('mosaic_gpu', 'xla')))(xs)\n"
        "        print('fell through:', bool(jnp.allclose(y, kernels.layer_norm(x))))\n"
        "print('one device:', bool(jnp.allclose(kernels.layer_norm(x, implementation='mosaic_gpu'),\n"
        "                                       kernels.layer_norm(x), atol=1e-5)))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum("mosaic_gpu's interpreter cannot run on a mesh of 4 devices" in line
               for line in lines if line.startswith("declined:")) == 2, proc.stdout
    assert lines.count("fell through: True") == 2 and "one device: True" in lines, proc.stdout


@needs_mosaic_gpu
@pytest.mark.parametrize("config,message", [
    (NormalizeConfig(block_reduced=0), "config.block_reduced must be a positive int"),
    (NormalizeConfig(block_groups=0), "config.block_groups must be an int in"),
    (NormalizeConfig(block_groups=17), r"config.block_groups must be an int in \[1, 16\]"),
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
    """`python -m kernels.compile` for every normalize case: Mosaic GPU's layout inference
    accepts the kernels (the interpreter does not check layouts), ptxas fits them in registers
    with no spills, and their shared memory (Mosaic GPU's dynamic allocation) is within the
    plan's budget."""
    rows = _compiled(
        "import json, dataclasses\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import CASES, compile_kernels\n"
        f"for case in [c for c in CASES['normalize'] if {target!r} == 'sm_90' or c.design\n"
        "             or c.description.startswith('layer_norm 7x129')]:\n"
        "    reports = compile_kernels(case.function('mosaic_gpu'), *case.args, "
        f"target='{target}', implementation='mosaic_gpu')\n"
        "    for r in reports:\n"
        "        print(json.dumps(dataclasses.asdict(r)))\n")
    # Every case for sm_90a; for sm_100a, the same kernels at the design shapes and an odd
    # small one (forward and backward each; the axis=(0, 2) case's transpose is XLA's).
    cases = [c for c in CASES["normalize"] if target == "sm_90" or c.design
             or c.description.startswith("layer_norm 7x129")]
    assert len(rows) == 2 * len(cases) and len(cases) >= 6
    assert {r["name"] for r in rows} == {"normalize_forward_mosaic_gpu",
                                         "normalize_backward_mosaic_gpu"}
    for r in rows:
        assert r["compiled"], r
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, r
        # Default blocks plan half an SM's shared memory (two CTAs per SM; `config.plan_of`),
        # beside the 2 KiB Pallas takes for cross-warp reductions.
        assert 4096 < r["shared_bytes"] <= r["shared_limit"] // 2 + 4096, r


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
