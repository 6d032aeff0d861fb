"""What every op owes, checked once over the ops' registrations (`kernels.ops.OPS`): the pieces
an op is made of (CONTRIBUTING.md, "Adding an op") and the errors its public function raises
for a bad implementation, interpret or config. Each op's own behaviour (jit, vmap, gradients,
its bad inputs) is in its own test file."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import pytest

import kernels
from bench.__main__ import BENCHES
from kernels import defaults, programs
from kernels.compile import CASES
from kernels.ops import OPS

BACKENDS = ("triton", "mosaic")
# One small call per op, taking the options under test as keywords.
CALLS = {
    "matmul": lambda **kw: kernels.matmul(jnp.ones((3, 3)), jnp.ones((3, 3)), **kw),
    "conv2d": lambda **kw: kernels.conv2d(jnp.ones((1, 5, 6, 4)), jnp.ones((3, 3, 4, 2)), **kw),
    "normalize": lambda **kw: kernels.normalize(jnp.ones((4, 8)), **kw),
    "gather": lambda **kw: kernels.gather(jnp.ones((5, 3)), jnp.asarray([1, 2]), **kw),
}


def test_every_public_op_is_registered():
    assert sorted(OPS) == sorted(CALLS)
    for name, op in OPS.items():
        assert op.name == name
        assert getattr(kernels, op.config_type.__name__) is op.config_type


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_every_piece(name):
    op = OPS[name]
    assert callable(op.reference) and inspect.getdoc(op.reference), "a documented reference"
    assert sorted(op.kernels) == sorted(BACKENDS)
    for backend, module in op.kernels.items():
        for piece in ("check", "resolve_config"):
            assert callable(getattr(module, piece, None)), f"{name}/{backend} lacks {piece}"
        assert inspect.getdoc(module).count("\n") > 10, f"{name}/{backend}: no schedule docstring"
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
