"""normalize's gradients for every registered implementation: against JAX's gradient of the
reference, in 16-bit dtypes, second order, and by finite differences in float64.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.test_util import check_grads

from kernels.normalize import normalize
from kernels.reference.normalize import normalize as reference_normalize
from tests.support import SUPPORTS_FLOAT64, as_f64, assert_close, random, x64
from tests.test_normalize import _inputs, _loss

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


@pytest.mark.parametrize("shape,axis,subtract_mean", [
    ((13, 70), -1, True), ((13, 70), -1, False), ((70, 13), 0, True), ((4, 5, 6), (0, 2), False),
    ((3, 4, 10), (1, 2), True)], ids=str)
def test_gradients_match_reference(implementation, shape, axis, subtract_mean):
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=16)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    grads = jax.jit(jax.grad(_loss(normalize, implementation=implementation, **kwargs),
                             argnums=(0, 1, 2)))(x, scale, offset)
    want = jax.jit(jax.grad(_loss(reference_normalize, **kwargs), argnums=(0, 1, 2)))(
        x, scale, offset)
    for got, expected in zip(grads, want):
        chex.assert_equal_shape([got, expected])
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def test_gradients_without_parameters(implementation):
    x = random((9, 33), jnp.float32, 17)
    got = jax.grad(lambda x: _loss(normalize, implementation=implementation)(x, None, None))(x)
    want = jax.grad(lambda x: _loss(reference_normalize)(x, None, None))(x)
    assert_close(got, want, jnp.float32, reduction_length=33)


def test_gradients_bfloat16(implementation):
    x, scale, offset = _inputs((24, 64), -1, jnp.bfloat16, seed=18, param_dtype=jnp.bfloat16)
    # A linear loss: its cotangent does not depend on the (bfloat16-rounded) output.
    # bfloat16-representable, so the cotangent reaching the kernel (cast to y's dtype) is exact.
    weights = random(x.shape, jnp.bfloat16, seed=21).astype(jnp.float32)
    loss = lambda f, **kw: lambda x, s, o: jnp.sum(
        f(x, s, o, **kw).astype(jnp.float32) * weights)
    grads = jax.grad(loss(normalize, implementation=implementation), argnums=(0, 1, 2))(
        x, scale, offset)
    with x64():  # JAX's gradient of the reference in float64: the ground truth.
        want = jax.grad(loss(reference_normalize), argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x, scale, offset)))
    for got, expected, primal in zip(grads, want, (x, scale, offset)):
        assert got.dtype == primal.dtype
        assert_close(got, expected, jnp.bfloat16, reduction_length=64)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
def test_grad_of_grad(implementation, subtract_mean):
    x, scale, offset = _inputs((5, 24), -1, jnp.float32, seed=19)
    kwargs = dict(subtract_mean=subtract_mean)

    def hessian_vector(fn, **kw):
        inner = jax.grad(_loss(fn, **kwargs, **kw), argnums=(0, 1, 2))
        return jax.jit(jax.grad(lambda x, s, o: sum(jnp.sum(jnp.tanh(g)) for g in inner(x, s, o)),
                                argnums=(0, 1, 2)))

    got = hessian_vector(normalize, implementation=implementation)(x, scale, offset)
    want = hessian_vector(reference_normalize)(x, scale, offset)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.float32, reduction_length=x.size)


@pytest.mark.parametrize("implementation", [i for i in ("xla", "triton")
                                            if SUPPORTS_FLOAT64[i]])
@pytest.mark.parametrize("shape,axis,subtract_mean,order", [
    ((4, 9), -1, True, 2), ((4, 9), -1, False, 2), ((9, 4), 0, True, 1),
    ((3, 4, 5), (0, 2), False, 1)], ids=str)
def test_finite_differences_float64(implementation, shape, axis, subtract_mean, order):
    """Gradients (order 1) and gradients of gradients (order 2) against finite differences."""
    with x64():
        x, scale, offset = _inputs(shape, axis, jnp.float64, seed=20, param_dtype=jnp.float64)
        fn = jax.jit(lambda x, s, o: normalize(x, s, o, axis=axis, subtract_mean=subtract_mean,
                                               implementation=implementation))
        check_grads(fn, (x, scale, offset), order=order, modes=["rev"], atol=1e-6, rtol=1e-6)
