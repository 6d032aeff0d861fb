"""matmul's fused epilogue, `activation(a @ b + bias) + residual`, against every implementation:
values against float64 truth (JAX's own activations run in float64), dtypes as jnp gives the
formula, gradients against JAX's gradients of the reference, the training forward's saved
pre-activation, split-K's epilogue in the reduction, bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import reference
from kernels import _targets
from kernels.compile.launches import launches
from kernels.matmul import MatmulConfig, matmul
from kernels.reference.epilogue import ACTIVATIONS
from tests.support import (as_f64, assert_close, dot_platform, implementations_of, kernels_of,
                           random, standard_promotion, weighted_sum, x64)

KERNELS = kernels_of("matmul")
IMPLEMENTATIONS = implementations_of("matmul")
ACTIVATION_NAMES = list(ACTIVATIONS)

pytestmark = pytest.mark.usefixtures("strict_interpret")


def epilogue_truth(product: np.ndarray, bias, activation, residual) -> np.ndarray:
    """The epilogue in float64 on a float64 product, with JAX's own activation."""
    z = product if bias is None else product + as_f64(bias)
    with x64():
        y = np.asarray(ACTIVATIONS[activation](jnp.asarray(z, jnp.float64)))
    return y if residual is None else y + as_f64(residual)


def _operands(a_shape, b_shape, dtype, residual_shape=None):
    """a, b, a bias and a residual (of the output's shape unless `residual_shape`)."""
    a, b = random(a_shape, dtype, 1), random(b_shape, dtype, 2)
    out_shape = np.matmul(np.zeros(a_shape), np.zeros(b_shape)).shape
    residual = random(out_shape if residual_shape is None else residual_shape, dtype, 4)
    return a, b, random((b_shape[-1],), dtype, 3), residual


def _check(a, b, bias, activation, residual, out, dtype, implementation=None):
    truth = epilogue_truth(np.matmul(as_f64(a), as_f64(b)), bias, activation, residual)
    assert out.shape == truth.shape
    assert_close(out, truth, dtype, reduction_length=a.shape[-1], dot=True,
                 platform=dot_platform(implementation))


# Every activation in float32 and two in bfloat16 on xla and the fast-interpreted kernels; the
# kernels' epilogue is one function (`kernels._epilogue`), so the strict simulator (slow) runs
# two of them, with the bias and residual blocks every case has.
VALUE_CASES = [(impl, a, jnp.float32) for impl in IMPLEMENTATIONS if impl != "mosaic"
               for a in ACTIVATION_NAMES] + [
    (impl, a, jnp.bfloat16) for impl in IMPLEMENTATIONS if impl != "mosaic"
    for a in ("gelu", "silu")] + [
    (impl, a, d) for impl in IMPLEMENTATIONS if impl == "mosaic"
    for a, d in (("gelu", jnp.float32), ("silu", jnp.bfloat16))]


@pytest.mark.parametrize("implementation,activation,dtype", VALUE_CASES,
                         ids=lambda v: v if isinstance(v, str) or v is None
                         else jnp.dtype(v).name)
def test_epilogue_matches_float64_truth(implementation, activation, dtype):
    a, b, bias, residual = _operands((65, 33), (33, 129), dtype)
    out = matmul(a, b, bias=bias, activation=activation, residual=residual,
                 implementation=implementation)
    assert out.dtype == dtype
    _check(a, b, bias, activation, residual, out, dtype, implementation)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_reference_epilogue_matches_float64_truth(activation):
    """XLA's own float32 computation meets the tolerance the kernels are held to."""
    a, b, bias, residual = _operands((65, 33), (33, 129), jnp.float32)
    out = reference.matmul(a, b, bias=bias, activation=activation, residual=residual)
    _check(a, b, bias, activation, residual, out, jnp.float32)


SHAPES = {
    "folded": ((2, 7, 13), (13, 5), (7, 5)),          # folded batch; the residual broadcasts
    "batched": ((3, 1, 6, 9), (4, 9, 8), (1, 6, 8)),  # broadcast batch dims
    "rank-1": ((7,), (7, 3), (3,)),                    # rank-1 a: no M
    "scalar-residual": ((1, 1), (1, 1), ()),           # a scalar residual
}


# The batched product's layout is the wrapper's, shared by every kernel: the strict simulator
# (slow) runs the other shapes.
@pytest.mark.parametrize("implementation,shape", [
    (impl, name) for impl in IMPLEMENTATIONS for name in SHAPES
    if impl != "mosaic" or name != "batched"])
def test_epilogue_shapes(implementation, shape):
    a_shape, b_shape, residual_shape = SHAPES[shape]
    a, b, bias, residual = _operands(a_shape, b_shape, jnp.float32, residual_shape)
    out = matmul(a, b, bias=bias, activation="gelu_tanh", residual=residual,
                 implementation=implementation)
    _check(a, b, bias, "gelu_tanh", residual, out, jnp.float32, implementation)


def test_bias_alone_and_residual_alone(implementation):
    a, b, bias, residual = _operands((9, 20), (20, 11), jnp.float32)
    _check(a, b, bias, None, None, matmul(a, b, bias=bias, implementation=implementation),
           jnp.float32, implementation)
    _check(a, b, None, "relu", residual, matmul(a, b, activation="relu", residual=residual,
                                                implementation=implementation), jnp.float32,
           implementation)


def test_output_dtype_is_the_formulas(implementation):
    """A bfloat16 product with a float32 residual is float32, rounded once; strict promotion
    refuses the mixed formula as jnp does."""
    a, b, bias, _ = _operands((9, 20), (20, 11), jnp.bfloat16)
    residual = random((9, 11), jnp.float32, 5)
    with standard_promotion():
        out = matmul(a, b, bias=bias, activation="silu", residual=residual,
                     implementation=implementation)
        assert out.dtype == (jnp.matmul(a, b) + residual).dtype == jnp.float32
    _check(a, b, bias, "silu", residual, out, jnp.float32, implementation)
    with pytest.raises(jax.dtypes.TypePromotionError):
        matmul(a, b, residual=residual, implementation=implementation)


def test_broadcast_residual_gradient_sums_in_float32(implementation):
    """A residual broadcast over the rows gets the cotangent summed over them in float32 and
    rounded once to its dtype, as JAX's gradient of the reference does (the weights are
    multiples of 1/8: the float32 sums are exact, bfloat16 sums would round)."""
    a, b, bias, _ = _operands((512, 8), (8, 16), jnp.float32)
    residual = random((16,), jnp.bfloat16, 5)
    with standard_promotion():
        got = jax.grad(_loss(implementation, "relu"), argnums=3)(a, b, bias, residual)
        want = jax.grad(_loss("reference", "relu"), argnums=3)(a, b, bias, residual)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


def _loss(implementation, activation):
    """A weighted sum of the layer. Kernels run the fast interpreter here: the gradient kernels
    take no epilogue, and the strict simulator runs every kernel in the other tests."""
    def loss(a, b, bias, residual):
        if implementation == "reference":
            y = reference.matmul(a, b, bias=bias, activation=activation, residual=residual)
        else:
            y = matmul(a, b, bias=bias, activation=activation, residual=residual,
                       implementation=implementation, interpret=True)
        return weighted_sum(y)
    return loss


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "silu"])
def test_epilogue_gradients_match_reference(implementation, activation):
    a, b, bias, residual = _operands((2, 17, 40), (40, 9), jnp.float32, (17, 9))
    grads = jax.grad(_loss(implementation, activation), argnums=(0, 1, 2, 3))(a, b, bias,
                                                                               residual)
    want = jax.grad(_loss("reference", activation), argnums=(0, 1, 2, 3))(a, b, bias, residual)
    for got, expected in zip(grads, want):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert_close(got, expected, jnp.float32, reduction_length=2 * 40, dot=True,
                     platform=dot_platform(implementation))


def _bfloat16_gradients_against_float64(impl, shapes=((24, 40), (40, 9)),
                                        residual_dtype=jnp.bfloat16):
    """The gelu layer's gradients (bfloat16 operands) each against the float64 reference's,
    within the tolerance that counts the layer's rounding of z and dZ to bfloat16 before the
    gradient products (`rounded_terms`). A float32 residual makes the output float32 (jnp's
    promotion), the layer still 16-bit."""
    a, b, bias, residual = _operands(*shapes, jnp.bfloat16)
    residual = residual.astype(residual_dtype)
    with standard_promotion():
        grads = jax.grad(_loss(impl, "gelu"), argnums=(0, 1, 2, 3))(a, b, bias, residual)
        with x64():
            wide = [jnp.asarray(as_f64(x)) for x in (a, b, bias, residual)]
            want = jax.grad(_loss("reference", "gelu"), argnums=(0, 1, 2, 3))(*wide)
    for got, expected, primal in zip(grads, want, (a, b, bias, residual)):
        assert got.dtype == primal.dtype
        assert_close(got, expected, jnp.bfloat16, reduction_length=shapes[0][0], dot=True,
                     rounded_terms=jnp.bfloat16)


@pytest.mark.parametrize("impl", [*KERNELS, "xla"])
@pytest.mark.parametrize("residual_dtype", [jnp.bfloat16, jnp.float32])
def test_bfloat16_epilogue_gradients_against_float64(impl, residual_dtype):
    """bfloat16 operands: the gradients against the reference's run in float64. A 16-bit
    layer rounds z and dZ to bfloat16 (xla too: the reference's own gradient rule), so each
    term of the gradient products carries that rounding, which the tolerance counts; with a
    float32 residual the kernel stores a float32 output beside a bfloat16 z."""
    _bfloat16_gradients_against_float64(impl, residual_dtype=residual_dtype)


# Shapes no other test traces: a backward traced with a wrong dZ stays in jit's caches for them.
WRONG_DZ_SHAPES = {"derivative": ((23, 37), (37, 11)), "sign": ((19, 33), (33, 13))}


@pytest.mark.parametrize("wrong", list(WRONG_DZ_SHAPES))
def test_bfloat16_gradient_tolerance_fails_a_wrong_dz(monkeypatch, wrong):
    """The same tolerance fails a kernel whose dZ has a wrong derivative (silu's for gelu's)
    or a wrong sign (`WRONG_DZ_SHAPES`: each its own, so no trace of another is reused)."""
    import importlib

    module = importlib.import_module("kernels.matmul")  # the package; `kernels.matmul` is the op
    right = module.gradients

    def gradients(epilogue, g, z, bias, residual, operand_dtypes):
        if wrong == "derivative":
            epilogue = epilogue._replace(activation="silu")
        dz, dbias, dresidual = right(epilogue, g, z, bias, residual, operand_dtypes)
        return (-dz if wrong == "sign" else dz), dbias, dresidual

    monkeypatch.setattr(module, "gradients", gradients)
    with pytest.raises(AssertionError):
        _bfloat16_gradients_against_float64("triton", shapes=WRONG_DZ_SHAPES[wrong])


def test_epilogue_grad_of_grad(implementation):
    a, b, bias, residual = _operands((6, 10), (10, 4), jnp.float32)

    def second(impl):
        inner = jax.grad(_loss(impl, "silu"), argnums=0)
        return jax.grad(lambda a, b, bias: jnp.sum(inner(a, b, bias, residual) ** 2),
                        argnums=(0, 1, 2))(a, b, bias)

    for got, want in zip(second(implementation), second("reference")):
        assert_close(got, want, jnp.float32, reduction_length=40, dot=True,
                     platform=dot_platform(implementation))


def _kernel_outputs(fn, *args, impl: str) -> list[int]:
    """The number of outputs of each kernel `fn` launches on the implementation's target."""
    target = _targets.DEFAULT["tpu" if impl == "mosaic" else "gpu"]
    return [len(eqn.outvars) for eqn in launches(fn, *args, target=target)]


@pytest.mark.parametrize("impl", KERNELS)
def test_training_forward_saves_the_preactivation(impl):
    """Inference writes the output once; the training forward also writes z for the backward,
    which then runs two product kernels and no recomputation of the product."""
    a, b, bias, residual = _operands((9, 20), (20, 11), jnp.float32)
    layer = lambda a, b: matmul(a, b, bias=bias, activation="gelu",  # noqa: E731
                                residual=residual, implementation=impl, interpret=False)
    assert _kernel_outputs(layer, a, b, impl=impl) == [1]
    training = jax.grad(lambda a, b: jnp.sum(layer(a, b)), (0, 1))
    assert sorted(_kernel_outputs(training, a, b, impl=impl)) == [1, 1, 2]
    # Without an activation nothing is saved: dZ is the cotangent itself.
    plain = jax.grad(lambda a, b: jnp.sum(matmul(a, b, bias=bias, implementation=impl,
                                                 interpret=False)), (0, 1))
    assert _kernel_outputs(plain, a, b, impl=impl) == [1, 1, 1]


def test_triton_split_k_applies_the_epilogue_after_the_sum():
    a, b, bias, residual = _operands((5, 256), (256, 24), jnp.float32)
    config = MatmulConfig(block_m=16, block_n=32, block_k=16, split_k=4)
    out = matmul(a, b, bias=bias, activation="gelu", residual=residual, implementation="triton",
                 config=config)
    _check(a, b, bias, "gelu", residual, out, jnp.float32, "triton")
    grads = jax.grad(lambda a, b: weighted_sum(matmul(
        a, b, bias=bias, activation="gelu", residual=residual, implementation="triton",
        config=config)), (0, 1))(a, b)
    want = jax.grad(lambda a, b: weighted_sum(reference.matmul(
        a, b, bias=bias, activation="gelu", residual=residual)), (0, 1))(a, b)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=256, dot=True, platform="gpu")


@pytest.mark.parametrize("impl", KERNELS)
def test_float64_gelu_declines_to_xla(impl):
    with x64():
        a, b, bias, _ = _operands((5, 8), (8, 3), jnp.float64)
        with pytest.raises(NotImplementedError, match="gelu"):
            matmul(a, b, bias=bias, activation="gelu", implementation=impl)
        out = matmul(a, b, bias=bias, activation="gelu", implementation=(impl, "xla"))
        truth = epilogue_truth(np.matmul(as_f64(a), as_f64(b)), bias, "gelu", None)
        assert_close(out, truth, jnp.float64, reduction_length=8)


@pytest.mark.parametrize("kwargs,match", [
    ({"activation": "tanh"}, "activation must be one of"),
    ({"activation": 1}, "activation must be one of"),
    ({"bias": jnp.ones((12,))}, r"bias must have shape \(11,\)"),
    ({"bias": jnp.ones((1, 11))}, r"bias must have shape \(11,\)"),
    ({"residual": jnp.ones((9, 12))}, "residual of shape"),
    ({"residual": jnp.ones((2, 9, 11))}, "residual of shape"),
])
def test_bad_epilogue_arguments(implementation, kwargs, match):
    a, b = jnp.ones((9, 20)), jnp.ones((20, 11))
    with pytest.raises(ValueError, match=match):
        matmul(a, b, implementation=implementation, **kwargs)


def test_bias_needs_output_features(implementation):
    with pytest.raises(ValueError, match="bias needs an output with a feature dim"):
        matmul(jnp.ones((4, 5)), jnp.ones((5,)), bias=jnp.ones((1,)),
               implementation=implementation)
    with pytest.raises(TypeError, match="bias must have a numeric dtype"):
        matmul(jnp.ones((4, 5)), jnp.ones((5, 3)), bias=np.array(["x"] * 3),
               implementation=implementation)
