"""normalize's fused residual add and output dtype (issue 25, item 1), for every registered
implementation: values and gradients against float64 truth, over chunks and splits, second
order, and what the kernels move.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm
from kernels.reference.normalize import (layer_norm as reference_layer_norm,
                                 normalize as reference_normalize, rms_norm as reference_rms_norm)
from tests.support import as_f64, assert_close, kernels_of, random, tolerance, weighted_sum, x64

KERNELS = kernels_of("normalize")  # this op's kernels (`tests.support.implementations_of`)
from tests.test_normalize import (CHUNKED, TRITON_SCHEDULES, _case_id, _chunked_config,
                                  _ground_truth, _group_size, _inputs)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


# Rows (one chunk, a ragged 5000-element row, several rows per block), the columns layout and
# several or non-contiguous normalized axes.
RESIDUAL_CASES = [((3, 7), -1), ((129, 1000), -1), ((3, 5000), -1), ((300, 20), 0),
                  ((3, 5, 33), (1, 2)), ((4, 9, 6), (0, 2))]


def _residual_inputs(shape, axis, dtype, seed):
    x, scale, offset = _inputs(shape, axis, dtype, seed=seed)
    return x, random(shape, dtype, seed + 3), scale, offset


def _check_residual(y, total, x, residual, scale, offset, **kwargs):
    """The sum is XLA's own `x + residual` in x's dtype, bit for bit; y is within the tolerance
    of float64 truth normalizing the exact sum (the sum is normalized unrounded)."""
    assert total.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(total, np.float64),
                                  np.asarray(x + residual, np.float64))
    with x64():
        args = [None if a is None else jnp.asarray(as_f64(a)) for a in (x, scale, offset)]
        expected, _ = reference_normalize(*args, residual=jnp.asarray(as_f64(residual)),
                                          **kwargs)
    assert y.dtype == x.dtype
    assert_close(y, np.asarray(expected), x.dtype,
                 reduction_length=_group_size(x.shape, kwargs["axis"]))


@pytest.mark.parametrize("shape,axis", RESIDUAL_CASES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_residual_matches_float64_ground_truth(implementation, shape, axis, dtype):
    """`(normalize(x + residual), x + residual)` against float64 truth (`_check_residual`)."""
    subtract_mean = len(shape) != 3  # RMS for the 3-D cases
    x, residual, scale, offset = _residual_inputs(shape, axis, dtype, seed=40)
    y, total = normalize(x, scale, offset, axis=axis, subtract_mean=subtract_mean,
                         residual=residual, implementation=implementation)
    _check_residual(y, total, x, residual, scale, offset, axis=axis,
                    subtract_mean=subtract_mean)


def _residual_loss(fn, use_sum=True, **kwargs):
    """Linear in both outputs (see `weighted_sum`), so the gradients carry only the backward's
    rounding; `use_sum=False` leaves the sum unused (its cotangent is a symbolic zero)."""
    def loss(x, r, s, o):
        y, total = fn(x, s, o, residual=r, **kwargs)
        return weighted_sum(y) + (weighted_sum(total[::-1]) if use_sum else 0.0)
    return loss


# An unused sum (a symbolic-zero cotangent) takes the same path in every dtype: float32 only.
@pytest.mark.parametrize("dtype,use_sum", [(jnp.float32, True), (jnp.bfloat16, True),
                                           (jnp.float32, False)],
                         ids=["f32-sum_used", "bf16-sum_used", "f32-sum_unused"])
@pytest.mark.parametrize("shape,axis,subtract_mean,config", [
    ((13, 70), -1, True, None), ((70, 13), 0, False, None),
    # Two chunks: the backward's programs sum both, and add dsum where dx is written.
    ((20, 200), -1, True, NormalizeConfig(block_groups=16, block_reduced=128))], ids=_case_id)
def test_residual_gradients_match_float64_truth(implementation, dtype, use_sum, shape, axis,
                                                subtract_mean, config):
    """dx = dresidual = the normalization's input gradient plus the sum's cotangent; scale and
    offset gradients too, against JAX's float64 gradient of the reference.

    The backward saves one array, the sum as the forward returned it, rounded to x's dtype (as
    a model saving its residual stream does, and as flash-attention's fused add-norm does),
    with the statistics of the unrounded sum. That rounding reaches every gradient, so it is
    counted: the tolerance adds twice what it changes the float64 truth by (the truth at the
    rounded sum against the truth at the exact one; nil for float32 data)."""
    x, residual, scale, offset = _residual_inputs(shape, axis, dtype, seed=42)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    blocks = {} if config is None or implementation == "xla" else dict(
        config=_chunked_config(implementation, config))
    grads = jax.jit(jax.grad(_residual_loss(normalize, use_sum, implementation=implementation,
                                            **blocks, **kwargs), argnums=(0, 1, 2, 3)))(
        x, residual, scale, offset)

    def at_the_sum(total, s, o):
        y = reference_normalize(total, s, o, **kwargs)
        return weighted_sum(y) + (weighted_sum(total[::-1]) if use_sum else 0.0)

    with x64():
        exact = jax.grad(_residual_loss(reference_normalize, use_sum, **kwargs),
                         argnums=(0, 1, 2, 3))(*(jnp.asarray(as_f64(a))
                                                 for a in (x, residual, scale, offset)))
        dtotal, dscale, doffset = jax.grad(at_the_sum, argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x + residual, scale, offset)))
    for got, want, at_rounded, primal in zip(grads, exact, (dtotal, dtotal, dscale, doffset),
                                             (x, residual, scale, offset)):
        assert got.dtype == primal.dtype
        rule = tolerance(primal.dtype, reduction_length=x.size)
        sum_rounding = 2 * float(np.max(np.abs(np.asarray(at_rounded) - np.asarray(want))))
        chex.assert_trees_all_close(np.asarray(got, np.float64), np.asarray(want),
                                    rtol=rule["rtol"], atol=rule["atol"] + sum_rounding)


@pytest.mark.parametrize("implementation,shape,axis,config",
                         [(name, *case) for name in KERNELS for case in CHUNKED]
                         + [("triton", *case[:3]) for case in TRITON_SCHEDULES[1:]],
                         ids=_case_id)
def test_residual_over_chunks_and_splits(implementation, shape, axis, config):
    """Groups longer than a block: the sum is written once per chunk by the pass that writes
    y (Triton's looped chunks and its split normalize pass; Mosaic's phase 1), and dsum is
    added where dx is written."""
    config = _chunked_config(implementation, config)
    x, residual, scale, offset = _residual_inputs(shape, axis, jnp.float32, seed=43)

    def loss(fn, **kw):
        def with_outputs(x, r, s, o):
            y, total = fn(x, s, o, axis=axis, residual=r, **kw)
            return weighted_sum(y) + weighted_sum(total[::-1]), (y, total)
        return jax.jit(jax.grad(with_outputs, argnums=(0, 1, 2, 3), has_aux=True))

    grads, (y, total) = loss(normalize, implementation=implementation, config=config)(
        x, residual, scale, offset)
    _check_residual(y, total, x, residual, scale, offset, axis=axis)
    want, _ = loss(reference_normalize)(x, residual, scale, offset)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def test_residual_grad_of_grad(implementation):
    x, residual, scale, offset = _residual_inputs((5, 24), -1, jnp.float32, seed=44)

    def hessian_vector(fn, **kw):
        def loss(x, r, s, o):
            y, total = fn(x, s, o, residual=r, **kw)
            return jnp.sum(jnp.sin(y) * jnp.cos(x)) + jnp.sum(jnp.sin(total))
        inner = jax.grad(loss, argnums=(0, 1, 2, 3))
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.tanh(g)) for g in inner(*a)),
                                argnums=(0, 1, 2, 3)))

    got = hessian_vector(layer_norm, implementation=implementation)(x, residual, scale, offset)
    want = hessian_vector(reference_layer_norm)(x, residual, scale, offset)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.float32, reduction_length=x.size)


@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.bfloat16, jnp.float32),
                                               (jnp.float32, jnp.bfloat16),
                                               (jnp.float16, jnp.bfloat16)], ids=str)
def test_out_dtype(implementation, x_dtype, out_dtype):
    """y is rounded once, to out_dtype (not to x's dtype first); dx keeps x's dtype."""
    x, scale = _inputs((33, 200), -1, x_dtype, seed=45)[:2]
    y = rms_norm(x, scale, out_dtype=out_dtype, implementation=implementation)
    assert y.dtype == jnp.dtype(out_dtype)
    want = _ground_truth(x, scale, None, axis=-1, subtract_mean=False, epsilon=1e-6)
    assert_close(y, want, out_dtype, reduction_length=200)
    loss = lambda f, **kw: lambda x, s: weighted_sum(f(x, s, out_dtype=out_dtype, **kw))
    grads = jax.grad(loss(rms_norm, implementation=implementation), argnums=(0, 1))(x, scale)
    with x64():
        want = jax.grad(loss(reference_rms_norm), argnums=(0, 1))(
            jnp.asarray(as_f64(x)), jnp.asarray(as_f64(scale)))
    for got, expected, primal in zip(grads, want, (x, scale)):
        assert got.dtype == primal.dtype
        assert_close(got, expected, primal.dtype, reduction_length=200)


@pytest.mark.parametrize("implementation,target", [("triton", "sm_90"), ("mosaic", "v5e")])
@pytest.mark.parametrize("use_sum", [True, False], ids=["sum_used", "sum_unused"])
def test_fused_residual_moves_each_array_once(implementation, target, use_sum):
    """Issue 25, item 1, at a transformer's pre-norm (8192 tokens x 1024, bfloat16): one
    forward kernel reads x and the residual and writes y and the sum (4 passes; XLA adding
    them first and a kernel normalizing costs 5), one backward kernel reads the sum, dy and
    dsum (when the sum is used) and writes dx, which is both x's and the residual's gradient
    (4 passes, not a kernel's 3 plus XLA's 3 adding dsum). Nothing else in the program touches
    an array of that size: no add, cast or copy outside the kernels."""
    from kernels import _targets
    from kernels._pallas import on_target
    from kernels.compile import launches
    from kernels.compile.launches import equations

    shape, dtype = (8192, 1024), jnp.bfloat16
    size = np.prod(shape)
    spec, param = jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((1024,), jnp.float32)
    loss = jax.grad(_residual_loss(layer_norm, use_sum, implementation=implementation,
                                   interpret=False), argnums=(0, 1, 2, 3))
    calls = launches(loss, spec, spec, param, param, target=_targets.TARGETS[target])
    assert [eqn.params["name"] for eqn in calls] == [f"normalize_forward_{implementation}",
                                                     f"normalize_backward_{implementation}"]
    forward, backward = calls
    array = size * jnp.dtype(dtype).itemsize
    assert [np.prod(v.aval.shape) for v in forward.invars][:2] == [size, size]
    view_operands = [v for v in backward.invars if np.prod(v.aval.shape) == size]
    assert len(view_operands) == 3 if use_sum else 2  # the sum, dy (and dsum)
    small = 1 << 20  # statistics, parameters, partial dscale/doffset rows
    assert 4 * array <= forward.params["cost_estimate"].bytes_accessed <= 4 * array + small
    partial_rows = sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize
                       for v in backward.outvars[1:])
    backward_passes = (4 if use_sum else 3) * array
    assert backward.params["cost_estimate"].bytes_accessed <= backward_passes + partial_rows + small

    def full_size_work(fn):
        with on_target(_targets.TARGETS[target]):
            jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(spec, spec, param,
                                                                        param).jaxpr
        return {eqn.primitive.name for eqn in equations(jaxpr)
                if any(np.prod(v.aval.shape) == size for v in eqn.outvars)}

    def unfused(x, s, o, residual, **kw):  # what a model without the fused op runs
        return layer_norm(x + residual, s, o, **kw), x + residual

    # The loss's own work on y and the sum (weights, casts, reversal) and the containers.
    loss_work = {"mul", "rev", "convert_element_type", "broadcast_in_dim", "reshape", "jit",
                 "pjit", "custom_vjp_call", "pallas_call"}
    assert full_size_work(_residual_loss(layer_norm, use_sum, implementation=implementation,
                                         interpret=False)) <= loss_work
    assert "add" in full_size_work(_residual_loss(unfused, use_sum,
                                                  implementation=implementation,
                                                  interpret=False))
