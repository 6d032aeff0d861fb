"""How an implementation is chosen (docs/design.md, "Choosing an implementation")."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _dispatch, defaults, registry
from kernels.matmul import matmul
from tests.support import MARKER, x64


def test_default_on_this_cpu_is_xla(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert jax.default_backend() == "cpu"
    assert _dispatch.implementations(None) == ("xla",)


def test_kernels_are_interpreted_off_their_platform():
    assert _dispatch.resolve_interpret("triton", None, "cpu") is True
    assert _dispatch.resolve_interpret("mosaic", None, "cuda") is True
    assert _dispatch.resolve_interpret("triton", None, "cuda") is False
    assert _dispatch.resolve_interpret("mosaic", None, "tpu") is False
    assert _dispatch.resolve_interpret("triton", False, "cpu") is False
    assert _dispatch.resolve_interpret("xla", None, "cpu") is False


@pytest.mark.parametrize("interpret,strict_env,platform,triton,mosaic", [
    (None, False, "cpu", True, True),          # the fast interpreter off the platform
    (None, False, "tpu", True, False),         # the kernel's own platform: compiled
    (None, True, "cpu", "strict", "strict"),   # $KERNELS_INTERPRET=strict replaces None
    (None, True, "cuda", False, "strict"),
    (True, True, "tpu", True, True),           # explicit values win over the environment
    ("strict", False, "cuda", "strict", "strict"),
    (False, True, "cpu", False, False),
])
def test_interpret_modes(monkeypatch, interpret, strict_env, platform, triton, mosaic):
    if strict_env:
        monkeypatch.setenv(_dispatch.INTERPRET_ENV_VAR, "strict")
    else:
        monkeypatch.delenv(_dispatch.INTERPRET_ENV_VAR, raising=False)
    for name, expected in (("triton", triton), ("mosaic", mosaic)):
        resolved = _dispatch.resolve_interpret(name, interpret, platform)
        assert resolved == expected and type(resolved) is type(expected), name


@pytest.mark.parametrize("interpret", ["yes", "fast", 1, 0, np.bool_(True)])
def test_interpret_must_be_none_true_false_or_strict(interpret):
    with pytest.raises(TypeError, match="matmul: interpret must be None, True, False or 'strict'"):
        matmul(jnp.ones((8, 8)), jnp.ones((8, 8)), implementation="mosaic", interpret=interpret)


def test_bad_interpret_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv(_dispatch.INTERPRET_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=_dispatch.INTERPRET_ENV_VAR):
        matmul(jnp.ones((8, 8)), jnp.ones((8, 8)), implementation="mosaic")


def _mosaic_reading_past_its_block(interpret):
    """A deliberately wrong Mosaic kernel: it reads rows 8..15 of its 8-row input block."""
    from jax.experimental import pallas as pl

    from kernels import _pallas

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) + 8, 8), :]

    block = pl.BlockSpec((8, 128), lambda i: (0, 0))
    return _pallas.mosaic_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid_spec=pl.GridSpec(grid=(1,), in_specs=[block], out_specs=block),
        dimension_semantics=("arbitrary",), interpret=interpret)


def test_strict_mode_catches_an_out_of_bounds_read():
    """What "strict" is for: TPU interpret mode raises on the read that the fast interpreter
    (like the hardware) lets through silently."""
    x = jnp.ones((8, 128), jnp.float32)
    jax.block_until_ready(_mosaic_reading_past_its_block(True)(x))  # no error, wrong values
    with pytest.raises(Exception, match="Out-of-bounds read"):
        jax.block_until_ready(_mosaic_reading_past_its_block("strict")(x))


@pytest.mark.parametrize("op", ["matmul", "layer_norm", "gather"])
def test_strict_reaches_the_mosaic_kernels_of_public_ops(monkeypatch, op):
    """Only "strict" (or the environment's) runs the simulator, whose host callbacks show in
    the lowered program; the default and True run the HLO interpreter, which has none."""
    import kernels

    x = jnp.ones((16, 128), jnp.float32)
    calls = {"matmul": lambda x, interpret: kernels.matmul(x, x.T, implementation="mosaic",
                                                           interpret=interpret),
             "layer_norm": lambda x, interpret: kernels.layer_norm(
                 x, implementation="mosaic", interpret=interpret),
             "gather": lambda x, interpret: kernels.gather(
                 x, jnp.arange(4), implementation="mosaic", interpret=interpret)}

    def text(interpret):
        return jax.jit(lambda x: calls[op](x, interpret)).lower(x).as_text()

    monkeypatch.delenv(_dispatch.INTERPRET_ENV_VAR, raising=False)
    assert "callback" not in text(None) and "callback" not in text(True)
    assert "callback" in text("strict")
    monkeypatch.setenv(_dispatch.INTERPRET_ENV_VAR, "strict")
    assert "callback" in text(None)



def _loop_computations(hlo: str) -> dict[str, str]:
    """The computations of compiled HLO text that run inside a while loop (its bodies and
    everything they call), by name."""
    import re

    bodies = {}
    for block in re.split(r"\n(?=\S)", hlo):
        match = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if match:
            bodies[match.group(1)] = block
    called = {name: set(re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", text))
              for name, text in bodies.items()}
    inside = {name for text in bodies.values()
              for name in re.findall(r"body=%?([\w.\-]+)", text)}
    frontier = set(inside)
    while frontier:
        frontier = {c for name in frontier for c in called.get(name, ())} - inside
        inside |= frontier
    return {name: bodies[name] for name in inside if name in bodies}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpreted_triton_kernel_updates_16_bit_outputs_in_place(dtype):
    """Interpreted, each Triton program updates its tile of the output in place: no loop body
    converts the whole output (jax 0.10's CPU backend did so for 16-bit floats at every
    program, making a 4096x1024 bfloat16 layer norm 40x slower than on jax 0.12)."""
    from kernels import layer_norm

    x = jnp.ones((512, 256), dtype)
    # "strict": the device's schedule, many programs (the fast interpreter's is one).
    hlo = jax.jit(lambda x: layer_norm(x, implementation="triton", interpret="strict")).lower(
        x).compile().as_text()
    loops = _loop_computations(hlo)
    assert loops, "the interpreted kernel runs as a loop over its programs"
    whole_output = "[1,512,256]"
    for name, text in loops.items():
        converts = [line for line in text.splitlines()
                    if " convert(" in line and whole_output in line.split("=")[1].split(" ")[1]]
        assert not converts, (name, converts[:2])

def _store_twice_kernel(x_ref, out_ref, *, rows: int):
    """Writes x + 1 to its (4, 8) tile, then x + 2 on a checkerboard: both stores masked to
    the array's rows (the last tile passes the edge)."""
    from kernels._pallas import pl, triton_load, triton_store

    tile_rows = pl.program_id(0) * 4 + jnp.arange(4)
    in_array = (tile_rows < rows)[:, None]
    checkerboard = (tile_rows[:, None] + jnp.arange(8)[None, :]) % 2 == 0
    tile = out_ref.at[pl.ds(pl.program_id(0) * 4, 4), pl.ds(0, 8)]
    x = triton_load(x_ref.at[pl.ds(pl.program_id(0) * 4, 4), pl.ds(0, 8)], mask=in_array,
                    other=0.0)
    triton_store(tile, x + 1, mask=in_array)
    triton_store(tile, x + 2, mask=in_array & checkerboard)


@pytest.mark.parametrize("interpret", [True, "strict"])
def test_interpreted_triton_store_writes_only_its_unmasked_lanes(interpret):
    """Eight programs: the interpreter reaches their tiles by int arrays and drops a masked
    lane's write by moving it past the array (kernels._pallas.tiles._masked_lanes_dropped), not by a
    gather and a select; a lane masked off inside the array must keep what it held."""
    from kernels._pallas import triton_call

    x = jnp.arange(30 * 8, dtype=jnp.float32).reshape(30, 8)
    out = triton_call(functools.partial(_store_twice_kernel, rows=30),
                      out_shape=jax.ShapeDtypeStruct((30, 8), jnp.float32), grid=(8,),
                      num_warps=1, num_stages=1, interpret=interpret)(x)
    rows, columns = np.indices((30, 8))
    expected = np.where((rows + columns) % 2 == 0, np.asarray(x) + 2, np.asarray(x) + 1)
    np.testing.assert_array_equal(out, expected)


def test_environment_variable_replaces_the_default(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "mosaic, xla")
    assert _dispatch.implementations(None) == ("mosaic", "xla")
    # The environment's single choice is explicit: a declining kernel says why.
    monkeypatch.setenv(_dispatch.ENV_VAR, "mosaic")
    with x64(), pytest.raises(NotImplementedError, match="mosaic: float64 is not supported"):
        matmul(jnp.ones((2, 2), jnp.float64), jnp.ones((2, 2), jnp.float64))
    # An explicit argument still wins over the environment.
    out = matmul(jnp.ones((2, 3)), jnp.ones((3, 2)), implementation="xla")
    np.testing.assert_array_equal(out, np.full((2, 2), 3.0))


def test_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton,gpu")
    with pytest.raises(ValueError, match=_dispatch.ENV_VAR):
        matmul(jnp.ones((2, 2)), jnp.ones((2, 2)))


def test_sequence_tries_in_order_and_reports_every_reason():
    calls = []

    def declines(reason):
        def check():
            calls.append(reason)
            raise NotImplementedError(reason)
        return check

    checks = {"triton": declines("no triton"), "mosaic": declines("no mosaic")}
    assert _dispatch.choose("op", ("triton", "mosaic", "xla"), None, checks) == ("xla", False)
    assert calls == ["no triton", "no mosaic"]
    with pytest.raises(NotImplementedError, match="op: triton: no triton; mosaic: no mosaic"):
        _dispatch.choose("op", ("triton", "mosaic"), None, checks)


@pytest.mark.parametrize("backend,device_kind,dtype,expected", [
    # Measured on an H100 (kernels/defaults.py): the Triton gather, and the Triton conv2d in
    # bfloat16, are at or ahead of XLA both forward and in a training step.
    ("cuda", "NVIDIA H100 80GB HBM3", jnp.bfloat16, {
        **dict.fromkeys(("matmul", "normalize", "layer_norm", "rms_norm"), ("xla",)),
        "conv2d": ("triton", "xla"), "gather": ("triton", "xla")}),
    ("cuda", "NVIDIA H100 80GB HBM3", jnp.float32, {
        **dict.fromkeys(("matmul", "conv2d", "normalize"), ("xla",)),
        "gather": ("triton", "xla")}),
    # No record covers an A100, a B200, an AMD GPU, or a program whose device tracing cannot
    # tell: every op runs xla there.
    *[("cuda", kind, jnp.bfloat16, dict.fromkeys(("matmul", "conv2d", "normalize", "gather"),
                                                 ("xla",)))
      for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA B200", None)],
    ("rocm", "AMD Instinct MI300X", jnp.bfloat16, dict.fromkeys(("conv2d", "gather"), ("xla",))),
    ("tpu", "TPU v5 lite", jnp.bfloat16, {
        "matmul": ("xla",), "conv2d": ("xla",), "normalize": ("mosaic", "xla"),
        "layer_norm": ("mosaic", "xla"), "rms_norm": ("mosaic", "xla"), "gather": ("xla",)}),
    ("cpu", None, jnp.bfloat16, dict.fromkeys(("matmul", "conv2d", "normalize", "gather"),
                                              ("xla",))),
])
def test_defaults_come_from_the_table(monkeypatch, backend, device_kind, dtype, expected):
    """The table: a kernel first only where its record (or, unmeasured, its design) has it at
    or ahead of XLA, and only for the device kinds (and, where the record splits so, the
    dtypes) the record covers; on TPUs normalization defaults to the kernel, then xla."""
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    for op, names in expected.items():
        assert _dispatch.implementations(None, op, backend, dtype, device_kind) == names, op
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")  # the environment still forces a kernel
    assert _dispatch.implementations(None, "matmul", backend, dtype, device_kind) == ("triton",)


def test_every_default_cites_its_evidence():
    records = Path(__file__).parent.parent / "bench" / "records"
    for (op, platform), entries in defaults.TABLE.items():
        for entry in entries:
            assert entry.implementations[-1] == "xla", (op, platform)  # a default never fails
            if entry.evidence.startswith("bench/records/"):
                record, figures = entry.evidence.split(": ", 1)
                assert (records.parent.parent / record).is_file(), entry.evidence
                assert len(figures) > 40, entry  # the figures the entry relies on
                # A record covers the device kinds it was measured on, no others.
                kind = json.loads((records.parent.parent / record).read_text())["device_kind"]
                assert entry.device_kinds and kind.startswith(entry.device_kinds), entry
            else:
                assert entry.evidence.startswith("design: ") and len(entry.evidence) > 40, entry


@pytest.mark.parametrize("target,dtype,kernels_expected", [
    ("sm_90", jnp.bfloat16, 3), ("sm_90", jnp.float32, 0), ("sm_80", jnp.bfloat16, 0)])
def test_conv_layer_default_follows_the_record_by_dtype_and_device_kind(
        monkeypatch, target, dtype, kernels_expected):
    """A bfloat16 conv layer's training program built for an H100 runs the Triton kernels by
    default (forward, input and weight gradients); a float32 one, and one for an A100 (which no
    record covers), run XLA's convolutions."""
    from kernels import _pallas, _targets, conv2d

    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    x, w, bias = (jnp.ones(shape, dtype) for shape in ((2, 8, 8, 16), (3, 3, 16, 32), (32,)))

    def step(x, w, bias):
        loss = lambda *a: conv2d(*a[:2], bias=a[2], activation="relu").astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, bias)

    text = _pallas.lower(step, x, w, bias, target=_targets.TARGETS[target]).as_text()
    assert text.count("__gpu$xla.gpu.triton") == kernels_expected, text.count("__gpu$xla.gpu.triton")
    assert ("stablehlo.convolution" in text) == (kernels_expected == 0)


def test_default_call_on_a_gpu_backend_runs_xla_for_matmul(monkeypatch):
    """The public op asks the table with its own name (a kernel declining is not needed)."""
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    checks = {"triton": lambda: None, "mosaic": lambda: None}
    assert _dispatch.choose("matmul", None, None, checks, "cuda") == ("xla", False)
    assert _dispatch.choose("layer_norm", None, None, checks, "tpu") == ("mosaic", False)
    assert _dispatch.choose("layer_norm", None, None, checks, "cpu") == ("xla", False)


@pytest.mark.parametrize("platform,marker", [("cuda", "__gpu$xla.gpu.triton"),
                                             ("tpu", "tpu_custom_call")])
def test_defaults_are_decided_for_the_lowering_platform(monkeypatch, platform, marker):
    """A program traced on this CPU and lowered for a GPU or TPU gets that platform's default
    (implementation=None, interpret=None): its compiled kernel where the table puts one first
    (TPU), XLA where it does not (GPU), never an interpreted kernel. Lowered for the CPU, the
    same traced program runs XLA."""
    from kernels import _pallas, _targets, layer_norm

    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    x = jnp.ones((64, 256), jnp.bfloat16)
    target = _targets.DEFAULT["gpu" if platform == "cuda" else "tpu"]
    text = _pallas.lower(lambda x: jax.grad(lambda x: layer_norm(x).astype(jnp.float32).sum())(x),
                         x, target=target).as_text()
    kernels_expected = 0 if defaults.default("layer_norm", platform)[0] == "xla" else 2
    assert kernels_expected == (2 if platform == "tpu" else 0)  # the table as it stands
    assert text.count(marker) == kernels_expected, text.count(marker)  # forward and backward
    assert "stablehlo.while" not in text  # no interpreted kernel
    on_cpu = jax.jit(layer_norm).lower(x).as_text()
    assert "__gpu$xla.gpu.triton" not in on_cpu and "tpu_custom_call" not in on_cpu
    assert "stablehlo.while" not in on_cpu


def test_explicit_kernel_is_compiled_for_its_platform_and_interpreted_elsewhere():
    """interpret=None: the Triton kernel is a kernel call when lowered for cuda and the
    interpreter's loop when lowered for this CPU, from one traced function."""
    from kernels import _pallas, _targets, layer_norm

    x = jnp.ones((64, 256), jnp.float32)
    fn = lambda x: layer_norm(x, implementation="triton")  # noqa: E731
    cuda = _pallas.lower(fn, x, target=_targets.DEFAULT["gpu"]).as_text()
    assert "__gpu$xla.gpu.triton" in cuda and "stablehlo.while" not in cuda
    cpu = jax.jit(fn).lower(x).as_text()
    assert "__gpu$xla.gpu.triton" not in cpu and "stablehlo.while" in cpu


def _every_op(implementation):
    """(function, operand specs) per op: forward and gradient, out-of-range gather ids filled."""
    import kernels

    f32 = jnp.float32
    ops = {
        "matmul": (lambda a, b: kernels.matmul(a, b, implementation=implementation),
                   [(64, 32), (32, 48)]),
        "conv2d": (lambda x, w: kernels.conv2d(x, w, stride=2, feature_group_count=8,
                                               implementation=implementation),
                   [(2, 16, 16, 8), (3, 3, 1, 8)]),
        "layer_norm": (lambda x, s, o: kernels.layer_norm(x, s, o, implementation=implementation),
                       [(64, 256), (256,), (256,)]),
        "normalize": (lambda x: kernels.normalize(x, axis=0, implementation=implementation),
                      [(512, 64)]),
        "gather": (lambda t, i: kernels.gather(t, i.astype(jnp.int32) - 4, mode="fill",
                                               implementation=implementation),
                   [(128, 64), (16,)]),
    }
    for name, (op, shapes) in ops.items():
        def loss(*arrays, op=op):
            return jnp.sum(op(*arrays).astype(f32))
        yield name, jax.value_and_grad(loss), [jax.ShapeDtypeStruct(s, f32) for s in shapes]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_tracing_and_lowering_execute_nothing(monkeypatch, platform):
    """Tracing an op and lowering it for another platform execute no XLA computation (gather's
    fill value is converted in NumPy), so they work where nothing can execute: compile-only
    devices, abstract meshes, jax.export for a platform the host lacks."""
    from jax._src import dispatch

    from kernels import _pallas, _targets

    def executed(*args, **kwargs):
        raise AssertionError(f"executed while tracing: {args[0]}")

    target = _targets.DEFAULT["gpu" if platform == "cuda" else "tpu"]
    kernel = "triton" if platform == "cuda" else "mosaic"
    for implementation in (None, kernel):
        for name, fn, specs in _every_op(implementation):
            monkeypatch.setattr(dispatch, "apply_primitive", executed)
            text = _pallas.lower(fn, *specs, target=target).as_text()
            monkeypatch.undo()
            if implementation == kernel:
                assert _pallas.TRITON_CALL_MARKER in text or _pallas.MOSAIC_CALL_MARKER in text, \
                    name


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_export_for_a_platform_this_host_lacks(platform):
    """jax.export from this CPU host, operands sharded on an abstract 4-device mesh of the
    target (no device anywhere): the default implementation exports, with the kernels the
    defaults table gives that platform (on TPUs normalize's; on GPUs none), and so does the
    platform's kernel asked for by name."""
    from jax.sharding import AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels import _pallas, _targets, layer_norm

    target = _targets.DEFAULT["gpu" if platform == "cuda" else "tpu"]
    mesh = AbstractMesh((4,), ("data",), axis_types=(AxisType.Explicit,),
                        abstract_device=_targets.abstract_device(target))
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    kernel = registry.native(platform, target)
    marker = MARKER[kernel]
    # jax.export refuses custom calls without compatibility guarantees unless told (Triton's).
    checks = [jax.export.DisabledSafetyCheck.custom_call(marker)] if platform == "cuda" else []
    default_is_kernel = defaults.default("layer_norm", platform)[0] == kernel
    for implementation, kernels_expected in ((None, 2 * default_is_kernel), (kernel, 2)):
        fn = jax.jit(jax.grad(lambda x, i=implementation: jnp.sum(
            layer_norm(x, implementation=i).astype(jnp.float32))))
        with _pallas.on_target(target):
            exported = jax.export.export(fn, platforms=(platform,), disabled_checks=checks)(x)
        text = exported.mlir_module()
        assert text.count(marker) == kernels_expected, (implementation, text.count(marker))


def test_a_platform_that_declines_fails_only_where_lowered_for(monkeypatch):
    """A choice declined on one platform only (an explicit Mosaic kernel on Auto TPU axes, say)
    leaves the op working, eagerly, jitted and differentiated, for the others; a program
    lowered for the declining platform raises the reason, gradient programs included."""
    real_choose = _dispatch.choose

    def choose(op, implementation, interpret, checks, platform="cpu", operands=(), config=None,
               dtype=None):
        if platform == "tpu":
            raise NotImplementedError("op: mosaic: not on this mesh")
        return real_choose(op, implementation, interpret, checks, platform, operands, config,
                           dtype)

    monkeypatch.setattr(_dispatch, "choose", choose)
    def fn(x):
        return _dispatch.run("op", "xla", None, {},
                             lambda name, interpret, out_sharding, x: jnp.sin(x), x)

    def loss(x):
        return jnp.sum(fn(x))

    x = jnp.linspace(0.0, 1.0, 8)
    np.testing.assert_allclose(fn(x), np.sin(np.linspace(0.0, 1.0, 8)), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), np.cos(np.asarray(x)), rtol=1e-6)
    for program in (fn, jax.grad(loss)):
        with pytest.raises(NotImplementedError, match="not on this mesh"):
            jax.jit(program).trace(x).lower(lowering_platforms=("tpu",))


def test_backward_kernels_are_sized_for_the_operands_device(monkeypatch):
    """A custom_vjp's backward is traced after the op's call returned, outside the dispatch's
    scope: its kernels still see the device kind of the mesh the operands live on (a TPU v4,
    16 MiB of VMEM, not the default v5e's 128 MiB)."""
    import importlib

    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

    import kernels
    from kernels import _targets

    package = "kernels.normalize.mosaic"
    seen, real = [], importlib.import_module(package).resolve_config

    def spy(p, config):
        seen.append(_targets.current("tpu").name)
        return real(p, config)

    for name in (package, f"{package}.forward", f"{package}.backward"):
        monkeypatch.setattr(importlib.import_module(name), "resolve_config", spy)
    mesh = AbstractMesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                        abstract_device=_targets.abstract_device(_targets.TARGETS["v4"]))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec()))
    loss = lambda x: jnp.sum(kernels.layer_norm(x, implementation="mosaic",  # noqa: E731
                                                interpret=False))
    jax.jit(jax.grad(loss)).trace(x)
    assert len(seen) > 2 and set(seen) == {"v4"}, seen


def test_an_unknown_tpu_kind_keeps_its_own_cores():
    """A TPU this library has no target for (a v5p: 2 TensorCores a chip) gets the default
    target's blocks but its own core count, so kernels that give each core a range of blocks
    (the normalize backward's partial rows, the gather ring) use both cores."""
    from jax.sharding import AbstractMesh, AxisType

    from kernels import _targets
    from kernels._blocks import core_ranges

    device = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=2, platform="tpu")
    mesh = AbstractMesh((1,), ("data",), axis_types=(AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        target = _targets.current("tpu")
        assert (target.name, target.num_cores) == ("v5e", 2)
        assert core_ranges(5) == (2, 3)
    v4 = jax.sharding.AbstractDevice(device_kind="TPU v4", num_cores=2, platform="tpu")
    mesh = AbstractMesh((1,), ("data",), axis_types=(AxisType.Explicit,), abstract_device=v4)
    with jax.sharding.use_abstract_mesh(mesh):
        assert _targets.current("tpu") is _targets.TARGETS["v4"]


@pytest.mark.parametrize("threads,warns", [("2", True), ("16", False)])
def test_mosaic_gpu_interpreter_warns_once_with_too_few_cpu_threads(monkeypatch, threads, warns):
    """Interpreting Mosaic GPU with fewer XLA CPU threads than its interpreter needs (the
    registry's `interpreter_threads`) warns once, naming PJRT_NPROC, while the call is chosen
    (before anything runs); with enough threads, and for a compiled call, it does not."""
    import warnings

    monkeypatch.setenv("PJRT_NPROC", threads)
    _dispatch._warn_if_few_cpu_threads.cache_clear()
    needed = registry.get("mosaic_gpu").interpreter_threads
    assert needed == registry.MOSAIC_GPU_INTERPRETER_THREADS > 2
    checks = {"mosaic_gpu": lambda: None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert _dispatch.choose("layer_norm", "mosaic_gpu", True, checks) == (
                "mosaic_gpu", True)
        assert _dispatch.choose("layer_norm", "mosaic_gpu", False, checks, "cuda")[1] is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == (1 if warns else 0), messages
    if warns:
        assert f"PJRT_NPROC={needed}" in messages[0] and "deadlock" in messages[0], messages
    _dispatch._warn_if_few_cpu_threads.cache_clear()
