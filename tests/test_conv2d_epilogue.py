"""conv2d's fused epilogue, `activation(conv + bias)`, against every implementation: values
against float64 truth (the convolution and JAX's own activations run in float64) on the GEMM,
depthwise, pointwise (matmul) and strided paths and both data formats, gradients against JAX's
gradients of the reference, the training forward's saved pre-activation, bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kernels import reference
from kernels import _targets
from kernels.compile.launches import launches
from kernels.conv2d import conv2d
from kernels.reference.conv2d import DATA_FORMATS
from tests.support import (as_f64, assert_close, dot_platform, implementations_of, kernels_of,
                           random, weighted_sum, x64)
from tests.test_matmul_epilogue import epilogue_truth

KERNELS = kernels_of("conv2d")

pytestmark = pytest.mark.usefixtures("strict_interpret")

# (x shape NHWC, w shape HWIO, options)
PATHS = {
    "gemm": ((2, 9, 11, 8), (3, 3, 8, 16), {}),
    "depthwise": ((1, 7, 9, 8), (3, 3, 1, 16), {"feature_group_count": 8}),
    "pointwise": ((2, 5, 6, 8), (1, 1, 8, 12), {"padding": "VALID"}),
    "strided": ((1, 9, 9, 8), (3, 3, 8, 8), {"stride": 2}),
}


def _operands(path, dtype, data_format="NHWC"):
    x_shape, w_shape, options = PATHS[path]
    x, w = random(x_shape, dtype, 1), random(w_shape, dtype, 2)
    if data_format == "NCHW":
        x, w = x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1)
    return x, w, random((w_shape[3],), dtype, 3), dict(options, data_format=data_format)


def _truth(x, w, bias, activation, options):
    with x64():
        conv = lax.conv_general_dilated(
            jnp.asarray(as_f64(x)), jnp.asarray(as_f64(w)),
            window_strides=(options.get("stride", 1),) * 2,
            padding=options.get("padding", "SAME"),
            dimension_numbers=(options["data_format"], DATA_FORMATS[options["data_format"]],
                               options["data_format"]),
            feature_group_count=options.get("feature_group_count", 1))
        conv = np.asarray(conv)
    channel_last = np.moveaxis(conv, options["data_format"].index("C"), -1)
    out = epilogue_truth(channel_last, bias, activation, None)
    return np.moveaxis(out, -1, options["data_format"].index("C"))


def _reduction_length(w, options) -> int:
    fmt = DATA_FORMATS[options["data_format"]]
    return w.shape[fmt.index("H")] * w.shape[fmt.index("W")] * w.shape[fmt.index("I")]


# A few activations on the GEMM path, one on each other path: the epilogue is one function,
# every activation's values proven on matmul's kernels (tests/test_matmul_epilogue.py).
PATH_ACTIVATIONS = [("gemm", a) for a in (None, "relu", "gelu")] + [
    ("depthwise", "gelu"), ("pointwise", "silu"), ("strided", "gelu_tanh")]


@pytest.mark.parametrize("implementation,path,activation", [
    (impl, path, activation) for impl in implementations_of("conv2d")
    for path, activation in PATH_ACTIVATIONS
    if impl != "mosaic" or activation in ("gelu", "silu")])  # the strict simulator: the slowest
def test_epilogue_matches_float64_truth(implementation, path, activation):
    x, w, bias, options = _operands(path, jnp.float32)
    out = conv2d(x, w, bias=bias, activation=activation, implementation=implementation,
                 **options)
    assert out.dtype == jnp.float32
    assert_close(out, _truth(x, w, bias, activation, options), jnp.float32,
                 reduction_length=_reduction_length(w, options), dot=True,
                 platform=dot_platform(implementation))


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_bfloat16_and_data_formats(implementation, data_format):
    x, w, bias, options = _operands("gemm", jnp.bfloat16, data_format)
    out = conv2d(x, w, bias=bias, activation="gelu", implementation=implementation, **options)
    assert out.dtype == jnp.bfloat16
    assert_close(out, _truth(x, w, bias, "gelu", options), jnp.bfloat16,
                 reduction_length=_reduction_length(w, options), dot=True,
                 platform=dot_platform(implementation))


def _loss(implementation, activation, options):
    def loss(x, w, bias):
        if implementation == "reference":
            y = reference.conv2d(x, w, bias=bias, activation=activation, **options)
        else:  # the fast interpreter: see tests/test_matmul_epilogue.py's `_loss`
            y = conv2d(x, w, bias=bias, activation=activation, implementation=implementation,
                       interpret=True, **options)
        return weighted_sum(y)
    return loss


@pytest.mark.parametrize("path,activation", [("gemm", "gelu"), ("gemm", None),
                                             ("depthwise", "silu"), ("strided", "relu")])
def test_epilogue_gradients_match_reference(implementation, path, activation):
    x, w, bias, options = _operands(path, jnp.float32)
    grads = jax.grad(_loss(implementation, activation, options), argnums=(0, 1, 2))(x, w, bias)
    want = jax.grad(_loss("reference", activation, options), argnums=(0, 1, 2))(x, w, bias)
    length = max(_reduction_length(w, options), x.shape[0] * x.shape[1] * x.shape[2])
    for got, expected in zip(grads, want):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert_close(got, expected, jnp.float32, reduction_length=length, dot=True,
                     platform=dot_platform(implementation))


@pytest.mark.parametrize("impl", [*KERNELS, "xla"])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_bfloat16_epilogue_gradients_against_float64(impl, data_format):
    """bfloat16 operands: the gelu layer's gradients against the reference's run in float64,
    within the tolerance that counts the layer's rounding of z and dZ to bfloat16 before the
    gradient convolutions (xla included: the reference's own gradient rule), with the bias
    along either layout's channel axis."""
    x, w, bias, options = _operands("gemm", jnp.bfloat16, data_format)
    grads = jax.grad(_loss(impl, "gelu", options), argnums=(0, 1, 2))(x, w, bias)
    with x64():
        wide = [jnp.asarray(as_f64(a)) for a in (x, w, bias)]
        want = jax.grad(_loss("reference", "gelu", options), argnums=(0, 1, 2))(*wide)
    length = max(_reduction_length(w, options), x.shape[0] * x.shape[1] * x.shape[2])
    for got, expected in zip(grads, want):
        assert got.dtype == jnp.bfloat16
        assert_close(got, expected, jnp.bfloat16, reduction_length=length, dot=True,
                     rounded_terms=jnp.bfloat16)


@pytest.mark.parametrize("impl", KERNELS)
def test_training_forward_saves_the_preactivation(impl):
    x, w, bias, options = _operands("gemm", jnp.float32)
    target = _targets.DEFAULT["tpu" if impl == "mosaic" else "gpu"]
    layer = lambda x, w: conv2d(x, w, bias=bias, activation="relu",  # noqa: E731
                                implementation=impl, interpret=False, **options)
    assert [len(e.outvars) for e in launches(layer, x, w, target=target)] == [1]
    training = jax.grad(lambda x, w: jnp.sum(layer(x, w)), (0, 1))
    forward = launches(training, x, w, target=target)[0]
    assert len(forward.outvars) == 2  # y and z; the gradient kernels follow


@pytest.mark.parametrize("kwargs,match", [
    ({"activation": "gelu_erf"}, "activation must be one of"),
    ({"bias": jnp.ones((15,))}, r"bias must have shape \(16,\)"),
    ({"bias": jnp.ones((8,))}, r"bias must have shape \(16,\)"),
])
def test_bad_epilogue_arguments(implementation, kwargs, match):
    x, w, _, options = _operands("gemm", jnp.float32)
    with pytest.raises(ValueError, match=match):
        conv2d(x, w, implementation=implementation, **options, **kwargs)
