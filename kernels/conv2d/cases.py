"""conv2d beyond its unit tests, as data (`OP.cases`): the shapes its kernels are compiled at
(`COMPILE`, read by `kernels.compile`), its whole programs (`PROGRAMS`), its bench shapes
(`BENCH`, read by `bench/conv2d.py`) and its sharded cases (`sharded`, `OUT_SHARDING`, with
`REDUCING` and `REDUCE_SCATTERS`, run by tests/sharded_run.py on 8 CPU devices)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels._cases import Case, Program, shape_text, spec
from kernels.conv2d import conv2d

_BF16, _F32 = jnp.bfloat16, jnp.float32


def _case(x_shape, w_shape, dtype, bias: bool = False, **options) -> Case:
    """`bias`: with a bias operand (of the output channels), an epilogue."""
    extra = "".join(f", {k}={v}" for k, v in options.items()) + ", bias" * bias
    args = (spec(x_shape, dtype), spec(w_shape, dtype)) + (spec(w_shape[-1:], dtype),) * bias
    return Case("conv2d", f"{shape_text(x_shape)} * {shape_text(w_shape)} "
                f"{jnp.dtype(dtype).name}{extra}", args,
                lambda impl, x, w, *bias: conv2d(x, w, bias=bias[0] if bias else None,
                                                 implementation=impl, interpret=False, **options))


# The bench's device shapes (`designed`: those its design figures show), the shapes of models
# people train, and odd small ones.
COMPILE = [
    _case((32, 56, 56, 64), (3, 3, 64, 64), _BF16).designed(),
    _case((32, 56, 56, 64), (1, 1, 64, 256), _BF16).designed(),
    _case((32, 28, 28, 128), (3, 3, 128, 256), _BF16, stride=2).designed(),
    _case((32, 112, 112, 32), (3, 3, 1, 32), _BF16, feature_group_count=32).designed(),
    _case((8, 64, 64, 128), (3, 3, 128, 128), _F32).designed(),  # TF32: K-major copies
    _case((8, 64, 64, 128), (3, 3, 128, 128), _BF16),
    _case((8, 64, 64, 128), (3, 3, 128, 256), _F32, stride=2),
    _case((2, 33, 65, 65), (3, 3, 65, 129), _F32),
    _case((8, 56, 56, 96), (7, 7, 1, 96), _BF16, feature_group_count=96),  # ConvNeXt
    _case((1, 9, 17, 8), (3, 3, 8, 16), _F32, stride=2),
    _case((32, 56, 56, 64), (3, 3, 64, 64), _BF16, bias=True,
          activation="relu").designed(inference=True),
]

PROGRAMS = {
    "conv2d": Program(
        "conv2d", "(8, 32, 32, 64) bf16 3x3 -> 128, batch sharded",
        lambda impl: lambda x, w: conv2d(x, w, implementation=impl),
        (((8, 32, 32, 64), _BF16, P("data")), ((3, 3, 64, 128), _BF16, P()))),
    "depthwise_stride2": Program(
        "conv2d", "(16, 56, 56, 32) bf16 depthwise 3x3 stride 2, batch sharded",
        lambda impl: lambda x, w: conv2d(x, w, stride=2, feature_group_count=32,
                                         implementation=impl),
        (((16, 56, 56, 32), _BF16, P("data")), ((3, 3, 1, 32), _BF16, P()))),
}

# (x NHWC, w HWIO, options) per shape set: on a device, on a CPU (xla), in the fast
# interpreter, in "strict".
BENCH = {"native": [((32, 56, 56, 64), (3, 3, 64, 64), {}),
                    ((32, 28, 28, 128), (3, 3, 128, 256), {"stride": 2}),
                    ((32, 112, 112, 32), (3, 3, 1, 32), {"feature_group_count": 32})],
         "cpu": [((8, 32, 32, 32), (3, 3, 32, 64), {}),
                 ((8, 64, 64, 32), (3, 3, 1, 32), {"feature_group_count": 32})],
         "interpret": [((8, 32, 32, 32), (3, 3, 32, 64), {}),
                       ((8, 64, 64, 32), (3, 3, 1, 32), {"feature_group_count": 32})],
         "strict": [((1, 9, 17, 8), (3, 3, 8, 16), {"stride": 2})]}


def sharded(impl):
    """name -> (the op of `impl` as a function of arrays, [(shape, spec)]), on a (2, 4) mesh
    ("data", "model")."""
    conv = lambda x, w: conv2d(x, w, implementation=impl)  # noqa: E731
    return {
        "conv2d/batch": (conv, [((4, 6, 6, 8), P("data")), ((3, 3, 8, 8), P())]),
        "conv2d/out-channels": (conv, [((4, 6, 6, 8), P("data")),
                                       ((3, 3, 8, 8), P(None, None, None, "model"))]),
        "conv2d/depthwise-channels": (
            lambda x, w: conv2d(x, w, feature_group_count=8, implementation=impl),
            [((4, 6, 6, 8), P("data", None, None, "model")),
             ((3, 3, 1, 8), P(None, None, None, "model"))]),
        # With the epilogue, over sharded input channels: applied after the partials' sum.
        "conv2d/in-channels": (
            lambda x, w, bias: conv2d(x, w, bias=bias, activation="silu", implementation=impl),
            [((4, 6, 6, 8), P("data", None, None, "model")),
             ((3, 3, 8, 8), P(None, None, "model")), ((8,), P())]),
        "conv2d/spatial": (conv, [((4, 8, 6, 8), P(None, "data")), ((3, 3, 8, 8), P())]),
    }


# The sharded cases whose rule sums per-shard partials in the forward pass.
REDUCING = {"conv2d/in-channels"}


def _with_out_sharding(impl):
    return lambda x, w, s: conv2d(x, w, out_sharding=s, implementation=impl)


# out_sharding on Explicit axes: name -> (op of (arrays, out_sharding), operands, asked, want):
# `asked` the out_sharding given (None: the default, where JAX's own op alone would raise),
# `want` the output's spec. Sharded input channels reduce-scatter into an asked sharding.
OUT_SHARDING = {
    "conv2d/in-channels": (
        _with_out_sharding,
        [((4, 6, 6, 8), P("data", None, None, "model")), ((3, 3, 8, 8), P(None, None, "model"))],
        None, P("data")),
    "conv2d/in-channels-reduce-scatter": (
        _with_out_sharding,
        [((4, 6, 6, 8), P("data", None, None, "model")), ((3, 3, 8, 8), P(None, None, "model"))],
        P("data", None, None, "model"), P("data", None, None, "model")),
    # Output channels sharded, the bias replicated: its gradient is typed replicated.
    "conv2d/out-channels-bias": (
        lambda impl: lambda x, w, bias, s: conv2d(x, w, bias=bias, activation="relu",
                                                  out_sharding=s, implementation=impl),
        [((4, 6, 6, 8), P("data")), ((3, 3, 8, 8), P(None, None, None, "model")), ((8,), P())],
        None, P("data", None, None, "model")),
}
# The out_sharding cases whose kernels must reduce-scatter into the sharding asked for.
REDUCE_SCATTERS = {"conv2d/in-channels-reduce-scatter"}
