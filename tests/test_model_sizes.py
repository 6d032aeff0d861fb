"""Every kernel at the sizes a model author's CPU test uses, through the default interpreter.

`interpret=None` off the kernel's platform is Pallas' HLO interpreter for both kernels (see
docs/design.md): the kernel's own code run as XLA ops, at model speed. Here each kernel, forward and
gradient, runs at such a size and is compared with the float64 reference. The per-op suites
prove the same kernels on small grids in "strict" mode (TPU interpret mode for Mosaic); the
bench's interpreted rows time these sizes against XLA. A kernel whose `interpret=True` is no
fast interpreter (Mosaic GPU's: the registry's `fast_interpreter`) is not run at these sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import reference
from kernels import _dispatch
from tests.support import (as_f64, assert_close, dot_platform, fast_kernels_of, random,
                           weighted_sum, x64)


@pytest.fixture(autouse=True)
def _default_interpreter(monkeypatch):
    """The default, whatever `$KERNELS_INTERPRET` the suite was started with."""
    monkeypatch.delenv(_dispatch.INTERPRET_ENV_VAR, raising=False)


def _float64(fn, *args):
    with x64():
        return np.asarray(fn(*(jnp.asarray(as_f64(a)) for a in args)))


def _gradients(fn, *args):
    return jax.grad(lambda *a: weighted_sum(fn(*a)), argnums=tuple(range(len(args))))(*args)


def _check(op, reference_op, args, dtype, forward_terms, gradient_terms, dot=False,
           platform=None):
    """`op` (a kernel, default interpret) against `reference_op` in float64: values, and the
    gradients of a linear loss (so each gradient carries only the backward's rounding)."""
    assert_close(op(*args), _float64(reference_op, *args), dtype, forward_terms, dot, platform)
    with x64():
        expected = _gradients(reference_op, *(jnp.asarray(as_f64(a)) for a in args))
    for got, want, terms in zip(_gradients(op, *args), expected, gradient_terms):
        assert_close(got, want, dtype, terms, dot, platform)


@pytest.mark.parametrize("kernel", fast_kernels_of("gather"))
def test_embedding_lookup(kernel):
    table = random((20000, 256), jnp.bfloat16, seed=1)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 20000, 4096), jnp.int32)
    out = kernels.gather(table, ids, implementation=kernel)
    np.testing.assert_array_equal(as_f64(out), as_f64(table)[np.asarray(ids)])
    hits = int(np.bincount(np.asarray(ids)).max())
    _check(lambda t: kernels.gather(t, ids, implementation=kernel),
           lambda t: reference.gather(t, ids), (table,), jnp.bfloat16, 1, (hits,))


@pytest.mark.parametrize("kernel", fast_kernels_of("normalize"))
def test_layer_norm(kernel):
    x = random((2048, 1024), jnp.float32, seed=3)
    scale, offset = random((1024,), jnp.float32, seed=4), random((1024,), jnp.float32, seed=5)
    _check(lambda *a: kernels.layer_norm(*a, implementation=kernel), reference.layer_norm,
           (x, scale, offset), jnp.float32, 1024, (1024, 2048, 2048))


@pytest.mark.parametrize("kernel", fast_kernels_of("normalize"))
def test_standardization_over_axis_0(kernel):
    x = random((20000, 64), jnp.float32, seed=6)
    _check(lambda x: kernels.normalize(x, axis=0, epsilon=0.0, implementation=kernel),
           lambda x: reference.normalize(x, axis=0, epsilon=0.0), (x,), jnp.float32, 20000,
           (20000,))


@pytest.mark.parametrize("kernel", fast_kernels_of("matmul"))
def test_matmul(kernel):
    a, b = random((512, 1024), jnp.float32, seed=7), random((1024, 768), jnp.float32, seed=8)
    _check(lambda a, b: kernels.matmul(a, b, implementation=kernel), reference.matmul,
           (a, b), jnp.float32, 1024, (768, 512), dot=True, platform=dot_platform(kernel))


@pytest.mark.parametrize("kernel", fast_kernels_of("conv2d"))
def test_conv2d(kernel):
    x, w = random((8, 32, 32, 32), jnp.float32, seed=9), random((3, 3, 32, 64), jnp.float32,
                                                                seed=10)
    _check(lambda x, w: kernels.conv2d(x, w, padding="SAME", implementation=kernel),
           lambda x, w: reference.conv2d(x, w, padding="SAME"), (x, w), jnp.float32,
           3 * 3 * 32, (3 * 3 * 64, 8 * 32 * 32), dot=True, platform=dot_platform(kernel))


def _programs(fn, *args) -> list[int]:
    """Programs (grid points) of each kernel launch `fn(*args)` traces, forward and backward."""
    from kernels.compile import find_pallas_calls

    jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda *a: jnp.sum(fn(*a)),
                                              argnums=tuple(range(len(args)))))(*args)
    return [int(np.prod(eqn.params["grid_mapping"].grid))
            for eqn in find_pallas_calls(jaxpr.jaxpr)]


@pytest.mark.parametrize("kernel", fast_kernels_of("normalize"))
def test_the_fast_interpreter_runs_few_programs(kernel):
    """What makes the default interpreter fast: each kernel runs a handful of whole-array
    programs (`_targets.INTERPRETER`), while "strict" runs the device's schedule, which the
    per-op suites prove."""
    x = jnp.ones((2048, 1024), jnp.float32)

    def layer_norm(interpret):
        return lambda x: kernels.layer_norm(x, implementation=kernel, interpret=interpret)

    # True, the default's choice on a CPU (None also traces the compiled kernel's branch).
    fast, strict = _programs(layer_norm(True), x), _programs(layer_norm("strict"), x)
    assert len(fast) == len(strict) == 2  # forward and backward
    assert max(fast) <= 8 and 8 * max(fast) <= min(strict), (fast, strict)
