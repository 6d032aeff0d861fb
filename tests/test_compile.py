"""Every kernel, forward and backward, compiled by the real back ends on this CPU machine:
Triton's for sm_90 and sm_80 (within shared memory, no register spills) and libtpu's for v5e,
v6e and v4 (within VMEM), at the bench's device shapes, realistic model shapes and odd small
ones (`kernels.compile.CASES`). Oversized configs are declined before compiling."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from bench import conv2d as conv2d_bench
from bench import gather as gather_bench
from bench import matmul as matmul_bench
from kernels import MatmulConfig, _targets
from kernels._blocks import K_MAJOR_MIN_REUSE
from kernels._pallas import mosaic_call, on_target, pl, pltpu, triton_call
from kernels.compile import CASES, compile_kernels, implementation_for

TARGETS = ("sm_90", "sm_80", "v5e", "v6e", "v4")
# The README's command compiles, for each compiler's first target (`EVERY_CASE_TARGETS`), each
# op's design cases (the bench's device shapes) and its odd smallest one, whose padding and
# ragged blocks are where a target's configs part; for the other targets (the A100's smaller
# shared memory and mma.sync, the v6e's and v4's VMEM) the smallest and the op's largest design
# case, whose blocks press hardest on a target's memory. The exhaustive tier (`-m exhaustive`,
# CI's once) compiles every other case for the first targets and every design case for the
# others; `python -m kernels.compile` compiles every case everywhere.
EVERY_CASE_TARGETS = ("sm_90", "v5e")
TIMEOUT_S = 240
# Kernels a case's forward and backward launch at least: matmul 3 (C, dA, dB), conv2d 3
# (y, dX, dW), normalize 2, gather 2 (the gather and its scatter-add).
MIN_KERNELS = {"matmul": 3, "conv2d": 3, "normalize": 2, "gather": 2}


def _compiled_cases() -> list:
    """(op, case index, target) params, tiered as the comment above `EVERY_CASE_TARGETS` says."""
    params = []
    for op, cases in CASES.items():
        def size(i):
            return sum(a.size for a in cases[i].args)

        smallest = min(range(len(cases)), key=size)
        largest_design = max((i for i, case in enumerate(cases) if case.design), key=size)
        for i, case in enumerate(cases):
            for target in TARGETS:
                first = target in EVERY_CASE_TARGETS
                readme = i == smallest or case.design and (first or i == largest_design)
                if readme or first or case.design:
                    params.append(pytest.param(op, i, target, id=f"{op}-{case.description}-"
                                               f"{target}", marks=() if readme
                                               else pytest.mark.exhaustive))
    return params


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("op,index,target", _compiled_cases())
def test_every_kernel_compiles_and_fits(op, index, target):
    case = CASES[op][index]
    reports = compile_kernels(case.function(implementation_for(target)), *case.args,
                              target=target, timeout_s=TIMEOUT_S)
    # Forward and backward kernels, each distinct one compiled once (a square float32
    # product's three launches are one kernel: every operand is read K-major).
    assert reports
    failures = [r.error for r in reports if not r.fits]
    assert not failures, "\n".join(failures)
    for r in reports:
        if r.shared_limit is not None:  # Triton: the figures the verdict rests on
            assert 0 <= r.shared_bytes <= r.shared_limit and r.spill_bytes == 0
            assert 0 < r.registers <= 255 and r.ctas_per_sm >= 1
            _assert_triton_design(case, r)
        else:
            assert r.memory["argument"] > 0


def _assert_triton_design(case, r) -> None:
    """What the compiled PTX shows of the kernels' design. bfloat16 conv2d at device shapes
    (ResNet, MobileNet, ConvNeXt): every global load is a 16-byte vector or cp.async copy (patch
    rows are channel runs of one tap; a K block spanning taps compiled to 2-byte scalar loads).
    float32 matmuls of device size multiply on the tensor cores as TF32 (on sm_90 Hopper's
    wgmma), their tiles and conv's loaded K-major, 16 bytes at a time (the weight gradient's
    from pixel-major copies where the batch is a multiple of 4). Every kernel whose PTX has a
    TF32 instruction rounds its float32 tiles first (TF32's mask in the PTX), and no other
    kernel does. normalize's kernels at device shapes run two CTAs or more an SM, so one
    CTA's loads are in flight while another computes (`_BACKWARD_MAX_CHUNK`)."""
    x = case.args[0]
    if case.op == "normalize" and case.design:
        assert r.ctas_per_sm >= 2, (r.name, r.operands, r.registers, r.num_warps)
    if case.op == "conv2d" and x.dtype == jnp.bfloat16 and x.shape[-1] % 8 == 0:
        # A fused bias is one vector of block_n channels a program, loaded once after the
        # main loop at whatever width Triton lays it out (4 bytes on sm_90 and sm_80).
        widths = set(r.load_bytes) - ({4} if len(case.args) > 2 else set())
        assert widths == {16}, (r.name, r.operands, r.load_bytes)
    if case.op == "matmul" and x.dtype == jnp.float32 and min(
            d for a in case.args for d in a.shape[-2:]) >= 64:
        instruction = "wgmma.mma_async" if r.target == "sm_90" else "mma.sync"
        assert r.mma and all(i.startswith(instruction) and "tf32" in i for i in r.mma), (
            r.name, r.operands, r.mma)
    tf32 = any(".tf32" in i for i in r.mma or ())
    assert bool(r.tf32_masks) == tf32, (r.name, r.operands, r.mma, r.tf32_masks)
    # TF32 takes K-major tiles: the MN-major float32 operands (matmul's B, and A and dC of
    # dB = Aᵀ @ dC; conv's weights) are copied K-major first, so every tile loads 16 bytes.
    if x.dtype == jnp.float32 and (
            case.op == "matmul" and min(d for a in case.args[:2] for d in a.shape[-2:])
            >= K_MAJOR_MIN_REUSE
            or r.name == "conv2d_triton" and x.shape[-1] % 4 == 0 and x.shape[0] * x.shape[1]
            * x.shape[2] >= K_MAJOR_MIN_REUSE  # conv: each weight meets every pixel
            # dW: x and dy copied pixel-major (`conv2d.triton.config.pixel_major`)
            or r.name == "conv2d_weight_grad_triton" and x.shape[0] % 4 == 0
            and min(x.shape[-1], case.args[1].shape[-1]) >= 64):
        assert set(r.load_bytes) == {16}, (r.name, r.operands, r.load_bytes)


@pytest.mark.parametrize("threads,registers,shared_bytes,ctas", [
    (512, 123, 16_384, 1),  # 16 warps of 128 registers (123 rounded to 8s): all 65,536
    (512, 64, 16_384, 2),
    (256, 128, 8_192, 2),
    (128, 32, 100_000, 2),  # by shared memory: 233,472 bytes, 1 KB reserved a CTA
    (1_024, 32, 0, 2),  # by threads: 2,048 an SM
    (64, 16, 0, 32),  # by CTAs: 32 an SM
    (1_024, 255, 0, 0),  # 32 warps of 256 registers: none fits
])
def test_ctas_per_sm_is_cudas_occupancy(threads, registers, shared_bytes, ctas):
    """An H100 SM's resident CTAs of a kernel, as CUDA's occupancy calculator gives them: the
    figure the compile reports and design rows state for every Triton kernel."""
    assert _targets.TARGETS["sm_90"].ctas_per_sm(threads, registers, shared_bytes) == ctas


def test_a_case_compiles_every_kernel_of_forward_and_backward():
    case = CASES["matmul"][-1]  # 7x5 @ 5x13: forward, dA and dB all differ in shape
    names = [r.name for r in compile_kernels(case.function("triton"), *case.args,
                                             target="sm_80")]
    assert names == ["matmul_triton"] * MIN_KERNELS["matmul"]


def test_cases_include_the_bench_device_shapes():
    described = {op: " | ".join(c.description for c in cases) for op, cases in CASES.items()}
    for m, n, k in matmul_bench.SHAPES["native"]:
        assert f"{m}x{k} @ {k}x{n}" in described["matmul"]
    for x_shape, w_shape, _ in conv2d_bench.SHAPES["native"]:
        assert f"{'x'.join(map(str, x_shape))} * {'x'.join(map(str, w_shape))}" in described[
            "conv2d"]
    for vocabulary, features, ids in gather_bench.SHAPES["native"]:
        assert f"table {vocabulary}x{features} bfloat16, {ids} ids" in described["gather"]


# ----------------------------------------------------------------------------- budgets


def test_oversized_triton_config_is_declined_naming_the_budget():
    a = jnp.ones((64, 64), jnp.bfloat16)
    big = MatmulConfig(block_m=256, block_n=256, block_k=256, num_stages=4)
    with pytest.raises(NotImplementedError, match=r"1048576 bytes of shared memory.*sm_90.*232448"):
        kernels.matmul(a, a, implementation="triton", config=big)
    with on_target(_targets.TARGETS["sm_80"]), pytest.raises(NotImplementedError,
                                                              match="sm_80.*166912"):
        jax.eval_shape(lambda a: kernels.matmul(a, a, implementation="triton", config=big), a)
    # A default sequence falls through to xla instead of failing.
    out = kernels.matmul(a, a, implementation=("triton", "xla"), config=big)
    np.testing.assert_allclose(np.asarray(out, np.float32), 64.0)


@pytest.mark.parametrize("target", ["v5e", "v6e", "v4"])
def test_oversized_mosaic_config_is_declined_naming_the_budget(target):
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    big = MatmulConfig(block_m=2048, block_n=2048, block_k=2048)
    with on_target(_targets.TARGETS[target]), pytest.raises(
            NotImplementedError, match=f"VMEM a step, over {target}'s budget"):
        jax.eval_shape(lambda a: kernels.matmul(a, a, implementation="mosaic", interpret=False,
                                                config=big), a)


@pytest.mark.timeout(TIMEOUT_S)
def test_large_mosaic_config_within_budget_raises_the_vmem_limit_and_compiles():
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    config = MatmulConfig(block_m=1024, block_n=1024, block_k=1024)  # ~28 MiB of VMEM a step
    (report,) = compile_kernels(
        lambda a: kernels.matmul(a, a, implementation="mosaic", interpret=False, config=config),
        a, target="v5e")
    assert report.fits, report.error
    assert report.vmem_limit > _targets.TARGETS["v5e"].scoped_vmem


# One VMEM policy for every Mosaic kernel (`Target.vmem_budget`): a step over a v4's 16 MiB is
# declined there, and compiles for a v5e with its scoped limit raised.
# conv2d: tiles of about 33 MiB; libtpu clamps a higher `vmem_limit_bytes` to the physical
# VMEM, so under the old fixed 48 MiB cap the kernel was accepted for a v4 and then failed to
# compile ("Used 22.25M of 16.00M vmem").
# gather: a bfloat16 table of 32768 columns puts about 33 MiB in a forward step (its (128,
# columns) rows scratch and output blocks), which failed to compile for a v5e at the default
# scoped limit ("CompileTimeScopedVmemOom").
_OVER_A_V4 = {
    "conv2d": (lambda x, w: kernels.conv2d(x, w, implementation="mosaic", interpret=False),
               [((1, 16, 2048, 256), jnp.float32), ((3, 3, 256, 256), jnp.float32)],
               "tiles need .* VMEM, over v4's budget"),
    "gather": (lambda x, ids: kernels.gather(x, ids, implementation="mosaic", interpret=False),
               [((1024, 32768), jnp.bfloat16), ((256,), jnp.int32)],
               "gather kernel's step needs .* VMEM .* over v4's budget"),
}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("op", sorted(_OVER_A_V4))
def test_mosaic_steps_are_budgeted_by_the_targets_vmem(op):
    forward, shapes, declined = _OVER_A_V4[op]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    with on_target(_targets.TARGETS["v4"]), pytest.raises(NotImplementedError, match=declined):
        jax.eval_shape(forward, *args)
    (report,) = compile_kernels(forward, *args, target="v5e")
    assert report.fits, report.error
    assert report.vmem_limit > _targets.TARGETS["v5e"].scoped_vmem


def test_blocks_are_chosen_for_the_target_the_call_runs_on():
    x = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    assert _targets.current("gpu") is _targets.DEFAULT["gpu"]  # no GPU here: H100's budget
    for name in TARGETS:
        with on_target(_targets.TARGETS[name]):
            assert _targets.current(_targets.TARGETS[name].platform).name == name
    from kernels.normalize import common, mosaic
    _, (outer, groups, reduced, rows) = common.plan(x.shape, (0,))
    p = common.Problem(outer, groups, reduced, rows, jnp.dtype(x.dtype), True, 1e-5, False,
                       False)
    for name in ("v5e", "v6e", "v4"):
        with on_target(_targets.TARGETS[name]):
            config = mosaic.resolve_config(p, None)
            assert mosaic.vmem_bytes(p, config) <= _targets.TARGETS[name].scoped_vmem // 2


# ----------------------------------------------------------------------------- verdicts


def _huge_block_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


@pytest.mark.timeout(TIMEOUT_S)
def test_compile_only_environment_is_set_by_entry_points_not_on_import(monkeypatch):
    """Importing kernels.compile changes no variable; use_compile_only_devices() sets them,
    and once jax has started (too late for them to take effect) names the one missing."""
    import subprocess
    import sys

    from kernels.compile.environment import COMPILE_ONLY_VARIABLES, use_compile_only_devices

    clean = {k: v for k, v in os.environ.items() if k not in COMPILE_ONLY_VARIABLES}
    script = ("import os, kernels.compile, kernels.compile.programs; "
              f"print(sorted(set({sorted(COMPILE_ONLY_VARIABLES)}) & set(os.environ)))")
    out = subprocess.run([sys.executable, "-c", script], env=clean, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
    jax.devices()
    monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD")
    with pytest.raises(RuntimeError, match="ALLOW_MULTIPLE_LIBTPU_LOAD would take no effect"):
        use_compile_only_devices()


@pytest.mark.parametrize("target,level", [("sm_90", 3), ("v5e", 3), ("cpu", 0)])
def test_devices_compile_with_their_compilers_defaults_and_the_cpu_quickly(target, level):
    """What this suite reads of a GPU or TPU compile (registers, spills, VMEM) is what their
    compilers give by default, LLVM's optimization level 3; only XLA:CPU's compiles of the
    suite's own programs run at level 0 (tests/conftest.py, `_cpu_programs_compiled_quickly`)."""
    from jax._src import compiler

    from kernels.compile.programs import devices

    backend = jax.devices("cpu")[0].client if target == "cpu" else devices(target, 1)[0].client
    options = compiler.get_compile_options(1, 1, backend=backend)
    debug = options.executable_build_options.debug_options
    assert debug.xla_backend_optimization_level == level
    assert debug.xla_llvm_disable_expensive_passes == (level == 0)
    assert (("xla_cpu_parallel_codegen_split_count", "1") in options.env_option_overrides) == (
        level == 0)


def test_a_compiler_error_names_the_kernel_the_target_and_the_diagnostic():
    x = jax.ShapeDtypeStruct((8192, 4096), jnp.float32)  # one 128 MiB block, double-buffered

    def too_big(x):
        spec = pl.BlockSpec((8192, 4096), lambda i: (0, 0))
        return mosaic_call(_huge_block_kernel, out_shape=x, dimension_semantics=("parallel",),
                           grid_spec=pltpu.PrefetchScalarGridSpec(
                               num_scalar_prefetch=0, grid=(1,), in_specs=[spec],
                               out_specs=spec),
                           interpret=False, name="huge_block")(x)

    (report,) = compile_kernels(too_big, x, target="v4")
    assert not report.compiled and not report.fits
    assert report.error.startswith("huge_block for v4: ")
    assert "vmem" in report.error.lower()


def _tile_product_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def test_triton_shared_memory_over_the_limit_is_reported():
    a = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    b = jax.ShapeDtypeStruct((512, 256), jnp.float32)

    def whole_tiles(a, b):  # 1 MiB of operand tiles: no GPU can hold it in shared memory
        return triton_call(_tile_product_kernel, out_shape=jax.ShapeDtypeStruct(
            (256, 256), jnp.float32), grid=(1,), num_warps=8, num_stages=1, interpret=False,
            name="whole_tiles")(a, b)

    (report,) = compile_kernels(whole_tiles, a, b, target="sm_90")
    assert report.compiled and not report.fits
    assert report.shared_bytes > report.shared_limit == 232_448
    assert report.error.startswith("whole_tiles for sm_90: needs ")


def _value_and_gradient(op, **kwargs):
    def loss(*arrays):
        return jnp.sum(jnp.sin(op(*arrays, implementation="mosaic", interpret=False, **kwargs)))
    return lambda *arrays: jax.value_and_grad(loss, argnums=tuple(range(len(arrays))))(*arrays)


@pytest.mark.parametrize("name,fn,shapes", [
    ("layer norm, chunked rows", _value_and_gradient(
        kernels.layer_norm, config=kernels.NormalizeConfig(block_groups=8, block_reduced=512)),
     [((24, 1500), jnp.float32), ((1500,), jnp.float32), ((1500,), jnp.float32)]),
    ("standardize over axis 0", _value_and_gradient(kernels.normalize, axis=0),
     [((600, 300), jnp.bfloat16)]),
    ("conv 3x3", _value_and_gradient(kernels.conv2d, padding="SAME"),
     [((2, 16, 16, 32), jnp.bfloat16), ((3, 3, 32, 256), jnp.bfloat16)]),
    ("depthwise 3x3 stride 2", _value_and_gradient(kernels.conv2d, stride=2,
                                                    padding="SAME", feature_group_count=128),
     [((2, 16, 16, 128), jnp.float32), ((3, 3, 1, 128), jnp.float32)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_mosaic_cost_estimates_state_the_pipeline_traffic(name, fn, shapes):
    """Each Mosaic launch's cost estimate (the design table's HBM figure) states the bytes its
    BlockSpec pipeline moves, re-reads included (x twice for chunked rows, the input once per
    output-channel block), as walking its grid step by step counts them."""
    from kernels.compile import launches
    from tests.support import walked_pipeline_bytes

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    calls = launches(fn, *args, target=_targets.TARGETS["v5e"])
    assert len(calls) >= 2
    for eqn in calls:
        assert eqn.params["cost_estimate"].bytes_accessed == walked_pipeline_bytes(eqn), \
            eqn.params["name"]
