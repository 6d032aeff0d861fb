"""Mosaic GPU's Blackwell kernel (`kernels/gemm/mosaic_gpu/blackwell.py`: tcgen05 MMAs into
tensor memory), which matmul and conv2d run on an sm_100 program. The ops' shared test bases
run `mosaic_gpu` in the interpreter, which has no compute capability and so runs Hopper's
kernel; here a B200's abstract device is in scope (`on_target`), so the dispatch plans for
sm_100, and each call asks for Mosaic GPU's interpreter (`interpret="strict"`: the dispatch
would compile for the B200), which runs the tcgen05 kernel with its race detector, against
float64 truth. Its compiled kernels: tests/test_mosaic_gpu.py. The interpreter takes 4-10 s
a case here, so the README's command runs one case of each kind (a padded product with both
gradients, a walk over many items, an activation epilogue, a mixed split product, a strided
dilated convolution) and the exhaustive tier the rest."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import reference
from kernels import _targets
from kernels._pallas import on_target
from kernels.conv2d import conv2d
from kernels.matmul import MatmulConfig, matmul
from tests.support import (as_f64, assert_close, needs, random, standard_promotion,
                           weighted_sum, x64)
from tests.test_conv2d import _check, _inputs
from tests.test_conv2d import _loss as conv_loss
from tests.test_matmul_epilogue import _check as epilogue_check
from tests.test_matmul_epilogue import _operands as epilogue_operands

pytestmark = needs("mosaic_gpu")

B200 = _targets.TARGETS["sm_100"]


def _primitives(fn, *args) -> str:
    with on_target(B200):
        return str(jax.make_jaxpr(fn)(*args))


def _weights(shape) -> np.ndarray:
    """The cotangent `weighted_sum` gives its argument (multiples of 1/8: exact in bfloat16)."""
    return np.asarray(jax.grad(weighted_sum)(jnp.zeros(shape, jnp.float32)), np.float64)


@pytest.mark.parametrize("a_shape,b_shape,dtype,config", [
    pytest.param((256, 192), (192, 320), jnp.bfloat16, None,  # two N tiles, three K steps
                 marks=pytest.mark.exhaustive),
    ((7, 5), (5, 13), jnp.float16, None),  # padded to TMA's tiles, cut back
    pytest.param((2, 3, 40, 72), (3, 72, 136), jnp.bfloat16, None,  # broadcast batches
                 marks=pytest.mark.exhaustive),
    pytest.param((64, 1024), (1024, 64), jnp.bfloat16, MatmulConfig(split_k=3),
                 marks=pytest.mark.exhaustive),  # float32 partials
], ids=["tiles", "odd", "batched", "split_k"])
def test_products_and_gradients_on_tcgen05(a_shape, b_shape, dtype, config):
    """Forward and both gradients (dA = G·Bᵀ, dB = Aᵀ·G: the kernel's transposed operands)
    run the tcgen05 kernel, never wgmma, and match float64 truth."""
    a, b = random(a_shape, dtype, 1), random(b_shape, dtype, 2)

    def loss(a, b):
        return weighted_sum(matmul(a, b, implementation="mosaic_gpu", interpret="strict",
                                   config=config))

    jaxpr = _primitives(jax.value_and_grad(loss, argnums=(0, 1)), a, b)
    assert "tcgen05_mma" in jaxpr and "wgmma" not in jaxpr
    with on_target(B200):
        out = matmul(a, b, implementation="mosaic_gpu", interpret="strict", config=config)
        da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    a64, b64 = as_f64(a), as_f64(b)
    k = a_shape[-1]
    assert out.dtype == dtype
    assert_close(out, np.matmul(a64, b64), dtype, reduction_length=k, dot=True)
    g = _weights(out.shape)
    da_want = g @ np.swapaxes(b64, -1, -2)
    db_want = np.matmul(np.swapaxes(a64, -1, -2), g)
    db_want = db_want.sum(axis=tuple(range(db_want.ndim - b64.ndim)))
    assert_close(da, da_want, dtype, reduction_length=out.shape[-1], dot=True)
    assert_close(db, db_want, dtype, reduction_length=out.size // out.shape[-1], dot=True)


@pytest.mark.exhaustive
def test_fused_bias_and_residual_and_their_gradients():
    """bias + residual fused in the tensor-memory epilogue (column slices loaded a row a
    thread), forward and gradients, against float64 truth."""
    a, b = random((130, 96), jnp.bfloat16, 3), random((96, 200), jnp.bfloat16, 4)
    bias, residual = random((200,), jnp.bfloat16, 5), random((130, 200), jnp.bfloat16, 6)

    def layer(a, b, bias, residual):
        return matmul(a, b, bias=bias, residual=residual, implementation="mosaic_gpu",
                      interpret="strict")

    loss = lambda *args: weighted_sum(layer(*args))
    with on_target(B200):
        out = layer(a, b, bias, residual)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(a, b, bias, residual)
    want = as_f64(a) @ as_f64(b) + as_f64(bias) + as_f64(residual)
    assert_close(out, want, jnp.bfloat16, reduction_length=96, dot=True)
    g = _weights(out.shape)
    for got, expected, length in zip(grads, (g @ as_f64(b).T, as_f64(a).T @ g, g.sum(0), g),
                                     (200, 130, 130, 1)):
        assert_close(got, expected, jnp.bfloat16, reduction_length=length, dot=True)


def test_an_activation_epilogue_and_its_split_backward():
    """gelu(a @ b + bias) + residual in bfloat16: the forward's epilogue on tensor memory's
    slices (z saved for the backward, in bfloat16), and the backward's dZ, rounded to bfloat16
    as the 16-bit layer's rule has it, times the bfloat16 operands as plain bfloat16 products,
    against the reference's gradients run in float64 (the tolerance counts that rounding)."""
    a, b, bias, residual = epilogue_operands((24, 40), (40, 72), jnp.bfloat16)

    def loss(impl):
        def f(a, b, bias, residual):
            y = (reference.matmul if impl == "reference" else functools.partial(
                matmul, implementation=impl, interpret="strict"))(
                    a, b, bias=bias, activation="gelu", residual=residual)
            return weighted_sum(y)
        return f

    with on_target(B200):
        out = matmul(a, b, bias=bias, activation="gelu", residual=residual,
                     implementation="mosaic_gpu", interpret="strict")
        grads = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2, 3))(a, b, bias, residual)
    epilogue_check(a, b, bias, "gelu", residual, out, jnp.bfloat16)
    with x64():
        wide = [jnp.asarray(as_f64(x)) for x in (a, b, bias, residual)]
        want = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(*wide)
    for got, expected in zip(grads, want):
        assert got.dtype == jnp.bfloat16
        assert_close(got, expected, jnp.bfloat16, reduction_length=40, dot=True, platform="gpu",
                     rounded_terms=jnp.bfloat16)


def test_a_cta_walks_many_items(monkeypatch):
    """On a GPU of 2 SMs (the B200 target, shrunk) the persistent CTAs walk 5 and 4 of the 9
    output tiles: the TMA ring wraps across items (slots continue from item to item) and the
    two tensor-memory accumulators alternate, the MMA of item i waiting for the epilogue to
    have read item i - 2's. Against float64 truth."""
    monkeypatch.setitem(_targets.TARGETS, "sm_100", dataclasses.replace(B200, num_sms=2))
    a, b = random((384, 320), jnp.bfloat16, 7), random((320, 192), jnp.bfloat16, 8)
    config = MatmulConfig(block_n=64)
    with on_target(_targets.TARGETS["sm_100"]):
        from kernels.matmul.common import make_problem
        from kernels.gemm.mosaic_gpu.config import TCGEN05, plan_of

        plan = plan_of(make_problem(a, b, False, False, jnp.bfloat16), config)
        assert (plan.mma, plan.num_ctas, plan.tiles(make_problem(a, b, False, False,
                                                                 jnp.bfloat16))) == (TCGEN05, 2, 9)
        assert plan.k_blocks_per_split(make_problem(a, b, False, False, jnp.bfloat16)) % \
            plan.stages, plan  # the ring's slots do not restart with each item
        out = matmul(a, b, implementation="mosaic_gpu", interpret="strict", config=config)
    assert_close(out, as_f64(a) @ as_f64(b), jnp.bfloat16, reduction_length=320, dot=True)


@pytest.mark.parametrize("a_dtype,b_dtype", [
    pytest.param(jnp.float32, jnp.float32, marks=pytest.mark.exhaustive),
    (jnp.bfloat16, jnp.float32),
    pytest.param(jnp.float16, jnp.bfloat16, marks=pytest.mark.exhaustive)])
def test_float32_and_mixed_products_as_split_bfloat16(a_dtype, b_dtype):
    """tcgen05 has no TF32 kind (jax 0.12.0.1): a float32 or mixed product runs as bfloat16
    parts (hi + lo of each operand that is not bfloat16, `config.split_terms`), one launch,
    forward and gradients, each operand's parts laid out once along K (its K two times the
    padded K for hi + lo, once for a bfloat16 operand) and an MMA a term. About 16 significant
    bits an operand, so float32 meets the TF32 tolerance a GPU's dot gets
    (`DOT_FLOAT32_EPS`)."""
    from kernels.compile import launches
    from kernels.matmul.common import make_problem
    from kernels.gemm.mosaic_gpu.config import split_terms

    def num_terms(x_dtype, y_dtype):  # the MMAs of a K slice of a product of these dtypes
        x, y = (jax.ShapeDtypeStruct((8, 8), d) for d in (x_dtype, y_dtype))
        with standard_promotion():
            return len(split_terms(make_problem(x, y, False, False, jnp.float32)))

    a, b = random((40, 100), a_dtype, 1), random((100, 72), b_dtype, 2)
    assert num_terms(a_dtype, b_dtype) == (3 if jnp.bfloat16 not in (a_dtype, b_dtype) else 2)
    loss = lambda a, b: weighted_sum(matmul(a, b, implementation="mosaic_gpu",
                                            interpret="strict"))
    with standard_promotion():
        jaxpr = _primitives(jax.value_and_grad(loss, argnums=(0, 1)), a, b)
        with on_target(B200):
            out = matmul(a, b, implementation="mosaic_gpu", interpret="strict")
            da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    # The forward's, dA = G·Bᵀ's and dB = Aᵀ·G's terms (G in the output's dtype).
    assert jaxpr.count("tcgen05_mma") == (num_terms(a_dtype, b_dtype) + num_terms(
        out.dtype, b_dtype) + num_terms(a_dtype, out.dtype)) and "wgmma" not in jaxpr
    with standard_promotion():
        (launch,) = launches(lambda a, b: matmul(a, b, implementation="mosaic_gpu",
                                                 interpret=False), a, b, target=B200)
    parts = [1 if dtype == jnp.bfloat16 else 2 for dtype in (a_dtype, b_dtype)]
    a_k, b_k = launch.invars[0].aval.shape[-1], launch.invars[1].aval.shape[-2]
    assert (a_k, b_k) == (parts[0] * 128, parts[1] * 128), launch.invars  # K 100 padded
    dtype = out.dtype
    assert_close(out, as_f64(a) @ as_f64(b), dtype, reduction_length=100, dot=True,
                 platform="gpu")
    g = _weights(out.shape)
    assert_close(da, g @ as_f64(b).T, a_dtype, reduction_length=72, dot=True, platform="gpu")
    assert_close(db, as_f64(a).T @ g, b_dtype, reduction_length=40, dot=True, platform="gpu")
    # The lo parts count: the error is a small fraction of bfloat16 operands' alone.
    truth = as_f64(a) @ as_f64(b)
    bfloat16_error = np.abs(as_f64(a.astype(jnp.bfloat16)) @ as_f64(b.astype(jnp.bfloat16))
                            - truth).max()
    assert np.abs(as_f64(out) - truth).max() < bfloat16_error / 16


@pytest.mark.parametrize("op", ["matmul", pytest.param("conv2d", marks=pytest.mark.exhaustive)])
def test_split_parts_keep_nan_and_inf(op):
    """Inf and NaN land where XLA's float32 product puts them: an infinite operand's lo part
    is 0 (not Inf - Inf), and the corrections, summed apart, count only where the first
    term's sum is finite (Inf times a zero lo part, or one of the other sign, would make
    NaN): an Inf against a value whose lo part is 0 (1.0), against another Inf, and NaN."""
    if op == "matmul":
        x = random((9, 20), jnp.float32, 1).at[2, 3].set(jnp.nan).at[5, 0].set(jnp.inf)
        y = jnp.abs(random((20, 11), jnp.float32, 2)).at[0, 3].set(jnp.inf).at[0, 4].set(1.0)
        run, ref = matmul, jnp.matmul
    else:
        x = random((1, 7, 9, 3), jnp.float32, 1).at[0, 2, 3, 1].set(jnp.nan)
        x = x.at[0, 6, 0, 0].set(jnp.inf)
        y = jnp.abs(random((3, 3, 3, 2), jnp.float32, 2))
        run, ref = conv2d, reference.conv2d
    with on_target(B200):
        out = run(x, y, implementation="mosaic_gpu", interpret="strict")
    want = ref(x, y)
    assert np.isinf(want).any() and np.isnan(want).any()
    if op == "matmul":
        assert np.isposinf(want[5, 3]) and np.isposinf(want[5, 4]) and np.isposinf(out[5, 3])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(want))


@pytest.mark.parametrize("op", ["matmul", "conv2d"])
def test_float32_at_highest_declines(op):
    """Split bfloat16 is not IEEE float32: precision=HIGHEST declines on Blackwell too, checked
    on the problem as given (its split parts are bfloat16)."""
    highest = jax.lax.Precision.HIGHEST
    with on_target(B200), pytest.raises(NotImplementedError, match="HIGHEST runs in xla"):
        if op == "matmul":
            matmul(random((8, 16), jnp.float32, 1), random((16, 8), jnp.float32, 2),
                   precision=highest, implementation="mosaic_gpu", interpret="strict")
        else:
            conv2d(*_inputs((1, 5, 6, 3), (3, 3, 3, 4), jnp.float32), precision=highest,
                   implementation="mosaic_gpu", interpret="strict")


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype,epilogue", [(jnp.float32, {}),
                                           (jnp.bfloat16, {"activation": "gelu_tanh"})],
                         ids=["float32", "activation"])
def test_conv2d_split_bfloat16_on_tcgen05(dtype, epilogue):
    """conv2d's float32 data as split bfloat16 products, and beside it a 16-bit activation
    epilogue, whose backward takes dZ rounded to bfloat16 (plain bfloat16 products; the
    tolerance counts that rounding): the forward's parts of x side by side in its planes and
    of the weights in each tap's K (`config.forward_terms`), the weight gradient's windows
    split by the matmul. Strided and dilated, against the reference's values and
    gradients run in float64, at the tolerance of a GPU's float32 dot."""
    x, w = _inputs((2, 9, 8, 4), (3, 3, 4, 5), dtype)
    options = {"stride": 2, "dilation": (2, 1), "padding": "SAME"}
    if epilogue:
        epilogue = {**epilogue, "bias": random((5,), dtype, 9)}

    def loss(impl):
        def f(x, w):
            if impl == "reference":
                return weighted_sum(reference.conv2d(x, w, **options, **epilogue))
            return weighted_sum(conv2d(x, w, implementation=impl, interpret="strict",
                                       **options, **epilogue))
        return f

    jaxpr = _primitives(jax.value_and_grad(loss("mosaic_gpu"), argnums=(0, 1)), x, w)
    assert "tcgen05_mma" in jaxpr and "wgmma" not in jaxpr
    with on_target(B200):
        out = conv2d(x, w, implementation="mosaic_gpu", interpret="strict", **options,
                     **epilogue)
        grads = jax.grad(loss("mosaic_gpu"), argnums=(0, 1))(x, w)
    with x64():
        wide = {k: jnp.asarray(as_f64(v)) if k == "bias" else v for k, v in epilogue.items()}
        truth = reference.conv2d(jnp.asarray(as_f64(x)), jnp.asarray(as_f64(w)), **options,
                                 **wide)
        epilogue = wide
        want = jax.grad(loss("reference"), argnums=(0, 1))(as_f64(x), as_f64(w))
    assert_close(out, truth, dtype, reduction_length=36, dot=True, platform="gpu")
    for got, expected in zip(grads, want):
        assert got.dtype == dtype
        assert_close(got, expected, dtype, reduction_length=45, dot=True, platform="gpu",
                     rounded_terms=jnp.bfloat16 if dtype == jnp.bfloat16 else None)


@pytest.mark.parametrize("x_shape,w_shape,options", [
    ((2, 9, 8, 4), (3, 3, 4, 5), {"dilation": (2, 1), "stride": 2, "padding": "SAME"}),
    pytest.param((1, 9, 7, 4), (7, 1, 2, 6), {"padding": ((1, 2), (0, 3)),
                                              "feature_group_count": 2},
                 marks=pytest.mark.exhaustive),
])
def test_conv2d_on_tcgen05(x_shape, w_shape, options):
    """conv2d's implicit GEMM on the tcgen05 kernel: the forward's boxes of x a piece of an
    output row (`tiles.Pixels`), the weight gradient's of dY and x (`tiles.PixelSums`), the
    strided input gradient's phases; forward and gradients against float64 truth."""
    x, w = _inputs(x_shape, w_shape, jnp.bfloat16)

    def layer(x, w):
        return conv2d(x, w, implementation="mosaic_gpu", interpret="strict", **options)

    loss = lambda x, w: weighted_sum(layer(x, w))
    jaxpr = _primitives(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert "tcgen05_mma" in jaxpr and "wgmma" not in jaxpr
    with on_target(B200):
        out = layer(x, w)
        grads = jax.grad(loss, argnums=(0, 1))(x, w)
    _check(x, w, out, jnp.bfloat16, **options)
    with x64():
        want = jax.grad(conv_loss("reference", **options), argnums=(0, 1))(as_f64(x), as_f64(w))
    length = max(np.prod(w_shape), np.prod(x_shape[:3]))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.bfloat16, reduction_length=length, dot=True)


def test_conv2d_weight_gradient_split_over_pixels_on_tcgen05():
    """The weight gradient's items split the output pixels (9 taps of one 128x64 tile leave
    most of a B200's SMs idle): each split reads its own K slices of dY and x, and the float32
    partials sum to the gradient, against float64 truth."""
    from kernels.conv2d.common import make_problem
    from kernels.conv2d.mosaic_gpu.config import weight_grad_plan
    from kernels.reference.conv2d import geometry

    x_shape, w_shape = (2, 16, 16, 16), (3, 3, 16, 16)
    x, w = _inputs(x_shape, w_shape, jnp.bfloat16)
    p = make_problem(x_shape, w_shape, x.dtype, w.dtype,
                     geometry(x_shape, w_shape, stride=1, padding="SAME", dilation=1,
                              feature_group_count=1, data_format="NHWC"), x.dtype)
    loss = conv_loss("mosaic_gpu", interpret="strict")
    with on_target(B200):
        assert weight_grad_plan(p, x.dtype, x.dtype).splits > 1
        grads = jax.grad(loss, argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(conv_loss("reference"), argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.bfloat16, reduction_length=2 * 16 * 16 * 9, dot=True)


@pytest.mark.parametrize("config", [MatmulConfig(block_m=256), MatmulConfig(block_n=192),
                                    MatmulConfig(block_k=32)],
                         ids=["two_consumers_rows", "tensor_memory_columns", "two_swizzles"])
def test_a_hopper_tile_is_no_blackwell_tile(config):
    """Blackwell's tile is tcgen05's 128 rows by 64, 128 or 256 columns (two accumulators in
    tensor memory's 512 columns) over K slices of whole 128-byte swizzle spans (A's and B's
    tiles share one swizzle): another is rejected, naming the config, before tracing."""
    a, b = random((256, 64), jnp.bfloat16, 1), random((64, 384), jnp.bfloat16, 2)
    with on_target(B200), pytest.raises(ValueError,
                                        match="block_m 128 .* block_n one of .* K slice"):
        matmul(a, b, implementation="mosaic_gpu", interpret="strict", config=config)
