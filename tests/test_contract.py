"""What every op owes, checked once over the ops' registrations (`kernels.ops.OPS`): the pieces
an op is made of (CONTRIBUTING.md, "Adding an op"); the errors its public function raises for
a bad implementation, interpret or config; and, for every implementation, the same values under
jit and eagerly, no retrace on repeated calls, and vmap over every operand, each checked
against float64 truth by the op's `CONTRACT` (tests/test_<op>.py, beside its own helpers). Each
op's particular behaviour (its vmap variants, gradients, bad inputs) is in its own file."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import chex
import jax
import jax.numpy as jnp
import pytest

import kernels
from bench.__main__ import BENCHES
from kernels import defaults, programs
from kernels.compile import CASES
from kernels.ops import OPS
from tests.support import IMPLEMENTATIONS, KERNELS, assert_close, weighted_sum, x64
from tests.test_conv2d import CONTRACT as CONV2D
from tests.test_gather import CONTRACT as GATHER
from tests.test_matmul import CONTRACT as MATMUL
from tests.test_normalize import CONTRACT as NORMALIZE

CONTRACTS = {"matmul": MATMUL, "conv2d": CONV2D, "normalize": NORMALIZE, "gather": GATHER}
# As in the op files: kernels run "strict" (Mosaic in TPU interpret mode) on these small inputs.
pytestmark = pytest.mark.usefixtures("strict_interpret")

# One small call per op, taking the options under test as keywords.
CALLS = {
    "matmul": lambda **kw: kernels.matmul(jnp.ones((3, 3)), jnp.ones((3, 3)), **kw),
    "conv2d": lambda **kw: kernels.conv2d(jnp.ones((1, 5, 6, 4)), jnp.ones((3, 3, 4, 2)), **kw),
    "normalize": lambda **kw: kernels.normalize(jnp.ones((4, 8)), **kw),
    "gather": lambda **kw: kernels.gather(jnp.ones((5, 3)), jnp.asarray([1, 2]), **kw),
}


def test_every_public_op_is_registered():
    assert sorted(OPS) == sorted(CALLS) == sorted(CONTRACTS)
    for name, op in OPS.items():
        assert op.name == name
        assert getattr(kernels, op.config_type.__name__) is op.config_type


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_every_piece(name):
    op = OPS[name]
    assert callable(op.reference) and inspect.getdoc(op.reference), "a documented reference"
    for backend in KERNELS:
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
    assert CASES[name], "compile cases (kernels.compile.CASES)"
    assert any(p.op == name for p in programs.PROGRAMS.values()), "a whole program"
    assert name in BENCHES, "a bench module"
    for platform in ("gpu", "tpu"):
        assert (name, platform) in defaults.TABLE, f"a default on {platform}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_bad_implementation_interpret_and_config_name_the_op(name):
    call, config_type = CALLS[name], OPS[name].config_type.__name__
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


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "no_jit"])
def test_jit_and_no_jit(name, implementation, jitted):
    contract = CONTRACTS[name]
    inputs = contract.example()
    op = contract.call(implementation)
    contract.check((jax.jit(op) if jitted else op)(*inputs), *inputs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_no_retrace_on_repeated_calls(name, implementation):
    contract = CONTRACTS[name]
    chex.clear_trace_counter()  # each call's lambda is one code object for every parameter
    traced = jax.jit(chex.assert_max_traces(contract.call(implementation), n=1))
    for seed in range(3):
        inputs = contract.repeated(seed)
        contract.check(traced(*inputs), *inputs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_vmap_over_every_operand(name, implementation):
    contract = CONTRACTS[name]
    examples = [contract.repeated(seed) for seed in (3, 4)]
    stacked = [jnp.stack(operands) for operands in zip(*examples)]
    out = jax.vmap(contract.call(implementation))(*stacked)
    for k, inputs in enumerate(examples):
        contract.check(out[k], *inputs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_strict_settings_with_x64(name, implementation):
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
        contract.check(jax.jit(op)(*inputs), *inputs)
        floats = tuple(i for i, a in enumerate(inputs) if jnp.issubdtype(a.dtype, jnp.floating))
        loss = lambda f: lambda *a: weighted_sum(f(*a))  # noqa: E731
        got = jax.jit(jax.grad(loss(op), argnums=floats))(*inputs)
        wide = [a.astype(jnp.float64) if i in floats else a for i, a in enumerate(inputs)]
        want = jax.grad(loss(contract.call("xla")), argnums=floats)(*wide)
    for gradient, truth, i in zip(got, want, floats):
        assert gradient.dtype == inputs[i].dtype
        assert_close(gradient, truth, inputs[i].dtype,
                     reduction_length=max(a.size for a in inputs))
