"""What every op owes, checked once over the ops' registrations (`kernels.ops.OPS`) and the
implementations' (`kernels.registry`): the pieces an op is made of (CONTRIBUTING.md, "Adding an
op"); the errors its public function raises for a bad implementation, interpret or config; and,
for every implementation, the same values under jit and eagerly, no retrace on repeated calls,
vmap over every operand and gradients under x64, each checked against float64 truth by the op's
`CONTRACT` (tests/test_<op>.py, beside its own helpers). A dummy implementation registered here
reaches the dispatch, these shared checks and the compile listing. Each op's particular
behaviour (its vmap variants, gradients, bad inputs) is in its own files."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import pytest

import kernels
from bench.__main__ import BENCHES
from kernels import _dispatch, defaults, registry
from kernels.compile import CASES, listing
from kernels.ops import OPS
from tests.support import (Contract, assert_close, dot_platform, implementations_of, kernels_of,
                           weighted_sum, x64)

# Each op's contract, beside its helpers in tests/test_<op>.py.
CONTRACTS: dict[str, Contract] = {
    name: importlib.import_module(f"tests.test_{name}").CONTRACT for name in OPS}
# As in the op files: kernels run "strict" (Mosaic in TPU interpret mode) on these small inputs.
pytestmark = pytest.mark.usefixtures("strict_interpret")


def test_every_public_op_is_registered():
    assert sorted(OPS) == sorted(CONTRACTS)
    for name, op in OPS.items():
        assert op.name == name
        assert getattr(kernels, op.config_type.__name__) is op.config_type


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_every_piece(name):
    op = OPS[name]
    assert callable(op.reference) and inspect.getdoc(op.reference), "a documented reference"
    for backend in kernels_of(name):
        module = op.module(backend)
        for piece in ("check", "resolve_config"):
            assert callable(getattr(module, piece, None)), f"{name}/{backend} lacks {piece}"
        # One package per implementation: its loop nests, a module per pass with its block
        # schedule, and its sizing in config.py (CONTRIBUTING's layout).
        assert hasattr(module, "__path__"), f"{name}/{backend}: not kernels/{name}/{backend}/"
        assert "loop nest" in inspect.getdoc(module), f"{name}/{backend}: no loop nests"
        passes = [importlib.import_module(f"{module.__name__}.{p}") for p in ("forward", "backward")
                  if importlib.util.find_spec(f"{module.__name__}.{p}")]
        assert passes and all(inspect.getdoc(p).count("\n") > 10 for p in passes), \
            f"{name}/{backend}: a pass without its block schedule"
        assert importlib.util.find_spec(f"{module.__name__}.config"), f"{name}/{backend}: config"
    rules = [n for n, f in vars(op.sharding).items() if n.endswith("rule") and callable(f)]
    assert rules, "partition rules (kernels/<op>/sharding.py)"
    for rule in rules:
        assert callable(getattr(op.sharding, rule[:-len("rule")] + "factors", None)), rule
    # Its cases beyond the unit tests, as data in its folder (kernels/<op>/cases.py).
    assert CASES[name], "compile cases (COMPILE)"
    assert op.cases.PROGRAMS and all(p.op == name for p in op.cases.PROGRAMS.values()), \
        "whole programs (PROGRAMS)"
    assert sorted(op.cases.BENCH) == ["cpu", "interpret", "native", "strict"], "bench shapes"
    assert op.cases.sharded(registry.REFERENCE) and isinstance(op.cases.OUT_SHARDING, dict), \
        "sharded cases"
    assert isinstance(op.cases.REDUCING, set) and isinstance(op.cases.REDUCE_SCATTERS, set), \
        "which sharded cases reduce (REDUCING, REDUCE_SCATTERS)"
    assert name in BENCHES, "a bench module (bench/<op>.py)"
    for platform in ("gpu", "tpu"):
        assert (name, platform) in defaults.TABLE, f"a default on {platform}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_bad_implementation_interpret_and_config_name_the_op(name):
    call, config_type = CONTRACTS[name].small, OPS[name].config_type.__name__
    with pytest.raises(ValueError, match="implementation must be one of"):
        call(implementation="cuda")
    with pytest.raises(ValueError, match="implementation must be one of"):
        call(implementation=("triton", "nope"))
    with pytest.raises(TypeError, match=f"{name}: interpret must be None, True, False or"):
        call(implementation="triton", interpret="yes")
    with pytest.raises(TypeError, match=f"{name}: config must be a {config_type} or None"):
        call(config={"block_m": 16})
    # out_sharding as JAX's own ops check it, and no more entries than the output has dims.
    with pytest.raises(TypeError, match=f"`out_sharding` argument of {name}"):
        call(out_sharding="data")
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match=f"{name}: out_sharding .* more entries"):
        call(out_sharding=jax.NamedSharding(mesh, jax.P(*(None,) * 5)))


def check_jit_and_no_jit(name: str, implementation: str, jitted: bool) -> None:
    contract = CONTRACTS[name]
    inputs = contract.example()
    op = contract.call(implementation)
    contract.check((jax.jit(op) if jitted else op)(*inputs), *inputs,
                   implementation=implementation)


def check_no_retrace_on_repeated_calls(name: str, implementation: str) -> None:
    contract = CONTRACTS[name]
    chex.clear_trace_counter()  # each call's lambda is one code object for every parameter
    traced = jax.jit(chex.assert_max_traces(contract.call(implementation), n=1))
    for seed in range(3):
        inputs = contract.repeated(seed)
        contract.check(traced(*inputs), *inputs, implementation=implementation)


def check_vmap_over_every_operand(name: str, implementation: str) -> None:
    contract = CONTRACTS[name]
    examples = [contract.repeated(seed) for seed in (3, 4)]
    stacked = [jnp.stack(operands) for operands in zip(*examples)]
    out = jax.vmap(contract.call(implementation))(*stacked)
    for k, inputs in enumerate(examples):
        contract.check(out[k], *inputs, implementation=implementation)


def check_strict_settings_with_x64(name: str, implementation: str) -> None:
    """Forward and gradient under the suite's strict rank and dtype promotion
    (tests/conftest.py) with jax_enable_x64 on too, where Python scalars and default integers are
    64-bit beside the kernels' 32-bit arithmetic; the gradient against JAX's gradient of the
    reference in float64."""
    assert jax.config.jax_numpy_rank_promotion == "raise"
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    contract = CONTRACTS[name]
    with x64():
        inputs = contract.repeated(0)
        op = contract.call(implementation)
        if name in ("matmul", "conv2d") and implementation == "mosaic_gpu":
            # Its interpreter cannot run the warp-specialized pipeline under x64: declined,
            # naming why (the compiled kernel is traced in 32 bits: test_mosaic_gpu).
            with pytest.raises(NotImplementedError, match="jax_enable_x64"):
                jax.jit(op)(*inputs)
            return
        contract.check(jax.jit(op)(*inputs), *inputs, implementation=implementation)
        floats = tuple(i for i, a in enumerate(inputs) if jnp.issubdtype(a.dtype, jnp.floating))
        loss = lambda f: lambda *a: weighted_sum(f(*a))  # noqa: E731
        got = jax.jit(jax.grad(loss(op), argnums=floats))(*inputs)
        wide = [a.astype(jnp.float64) if i in floats else a for i, a in enumerate(inputs)]
        want = jax.grad(loss(contract.call(registry.REFERENCE)), argnums=floats)(*wide)
    for gradient, truth, i in zip(got, want, floats):
        assert gradient.dtype == inputs[i].dtype
        assert_close(gradient, truth, inputs[i].dtype,
                     reduction_length=max(a.size for a in inputs),
                     dot=name in ("matmul", "conv2d"), platform=dot_platform(implementation))


# Each op with each of its implementations (`implementations_of`).
SHARED = [(name, implementation) for name in sorted(OPS)
          for implementation in implementations_of(name)]


@pytest.mark.parametrize("name,implementation", SHARED)
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "no_jit"])
def test_jit_and_no_jit(name, implementation, jitted):
    check_jit_and_no_jit(name, implementation, jitted)


@pytest.mark.parametrize("name,implementation", SHARED)
def test_no_retrace_on_repeated_calls(name, implementation):
    check_no_retrace_on_repeated_calls(name, implementation)


@pytest.mark.parametrize("name,implementation", SHARED)
def test_vmap_over_every_operand(name, implementation):
    check_vmap_over_every_operand(name, implementation)


@pytest.mark.parametrize("name,implementation", SHARED)
def test_strict_settings_with_x64(name, implementation):
    check_strict_settings_with_x64(name, implementation)


# An implementation that runs each op's reference, as `xla` does, under another name.
DUMMY = registry.Implementation("dummy", None)


def test_a_registered_implementation_reaches_dispatch_shared_tests_and_compile_listing():
    with registry.registered(DUMMY):
        # Dispatch: a valid name, chosen, and resolved as the reference runs (never
        # interpreted); a kernel implementation's checks do not include it.
        assert "dummy" in registry.names() and "dummy" not in registry.kernel_names()
        assert _dispatch.implementations("dummy") == ("dummy",)
        assert _dispatch.resolve_interpret("dummy", True) is False
        # The shared tests of every op, run for it.
        for name in sorted(OPS):
            check_jit_and_no_jit(name, "dummy", jitted=True)
            check_vmap_over_every_operand(name, "dummy")
            check_strict_settings_with_x64(name, "dummy")
        # The compile listing names it, with nothing to compile.
        rows = {row["implementation"]: row for row in listing()}
        assert rows["dummy"]["targets"] == [] and rows["dummy"]["back_end"] is None
    assert "dummy" not in registry.names()
    with pytest.raises(ValueError, match="implementation must be one of"):
        kernels.matmul(jnp.ones((2, 2)), jnp.ones((2, 2)), implementation="dummy")


def test_an_op_without_an_implementations_kernels_declines_with_a_reason():
    """A kernel implementation an op's folder lacks declines like any kernel: an explicit
    choice raises the reason; in a sequence, the next implementation runs."""
    absent = registry.Implementation("absent", "absent_kernels", platforms=("tpu",))
    with registry.registered(absent):
        assert not OPS["matmul"].has("absent")
        with pytest.raises(NotImplementedError,
                           match=r"absent: matmul has no absent kernels \(kernels.matmul"):
            kernels.matmul(jnp.ones((2, 2)), jnp.ones((2, 2)), implementation="absent")
        out = kernels.matmul(jnp.ones((2, 2)), jnp.ones((2, 2)), implementation=("absent", "xla"))
        chex.assert_trees_all_equal(out, jnp.full((2, 2), 2.0))


def test_a_jax_without_pallas_triton_imports_kernels_and_runs_the_others():
    """JAX has deprecated Pallas' Triton backend: where a jax lacks it, `import kernels` works,
    every other implementation runs, and `triton` declines with the reason."""
    script = textwrap.dedent("""
        import sys
        sys.modules["jax.experimental.pallas.triton"] = None  # as if jax had none
        import jax.numpy as jnp
        import kernels
        x = jnp.arange(12.0).reshape(3, 4)
        for implementation in ("xla", "mosaic"):
            kernels.layer_norm(x, implementation=implementation, interpret=True)
        try:
            kernels.layer_norm(x, implementation="triton", interpret=True)
        except NotImplementedError as declined:
            print(declined)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, check=True)
    assert "triton: the installed jax" in result.stdout
    assert "has no jax.experimental.pallas.triton" in result.stdout
