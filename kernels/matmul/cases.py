"""matmul beyond its unit tests, as data (`OP.cases`): the shapes its kernels are compiled at
(`COMPILE`, read by `kernels.compile`), its whole programs (`PROGRAMS`), its bench shapes
(`BENCH`, read by `bench/matmul.py`) and its sharded cases (`sharded`, `OUT_SHARDING`, with
`REDUCING` and `REDUCE_SCATTERS`, run by tests/sharded_run.py on 8 CPU devices)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels._cases import Case, Program, shape_text, spec
from kernels.matmul import matmul

_BF16, _F32 = jnp.bfloat16, jnp.float32


def _case(a_shape, b_shape, dtype) -> Case:
    return Case("matmul", f"{shape_text(a_shape)} @ {shape_text(b_shape)} "
                f"{jnp.dtype(dtype).name}", (spec(a_shape, dtype), spec(b_shape, dtype)),
                lambda impl, a, b: matmul(a, b, implementation=impl, interpret=False))


def _fused_case(a_shape, b_shape, dtype, activation) -> Case:
    """A dense layer with every epilogue: `activation(a @ b + bias) + residual`."""
    out_shape = (*a_shape[:-1], b_shape[-1])
    return Case("matmul", f"{activation}({shape_text(a_shape)} @ {shape_text(b_shape)} + bias) "
                f"+ residual {jnp.dtype(dtype).name}",
                (spec(a_shape, dtype), spec(b_shape, dtype), spec(b_shape[-1:], dtype),
                 spec(out_shape, dtype)),
                lambda impl, a, b, bias, residual: matmul(
                    a, b, bias=bias, activation=activation, residual=residual,
                    implementation=impl, interpret=False))


# The bench's device shapes (`designed`: those its design figures show), the shapes of models
# people train, and odd small ones.
COMPILE = [
    _case((1024, 1024), (1024, 1024), _F32).designed(),
    _case((1024, 1024), (1024, 1024), _BF16),
    _case((4096, 4096), (4096, 4096), _F32),
    _case((4096, 4096), (4096, 4096), _BF16).designed(),
    _case((8192, 4096), (4096, 1024), _F32),
    _case((8192, 4096), (4096, 1024), _BF16).designed(),
    _case((16, 4096), (4096, 4096), _BF16).designed(),  # decode: split K
    _case((129, 65), (65, 257), _F32),
    _case((8, 1000, 1000), (8, 1000, 1000), _BF16),
    _case((7, 5), (5, 13), _F32),
    _fused_case((8192, 4096), (4096, 1024), _BF16, "gelu").designed(inference=True),
]

PROGRAMS = {
    "matmul": Program(
        "matmul", "(256, 512) @ (512, 1024) bf16, M and N sharded",
        lambda impl: lambda a, b: matmul(a, b, implementation=impl),
        (((256, 512), _BF16, P("data", None)), ((512, 1024), _BF16, P(None, "model")))),
    # Where JAX's own op alone raises on Explicit axes (it asks for an out_sharding): the
    # default (`xla` there) is given the sharding the kernels give.
    "matmul_k": Program(
        "matmul", "(256, 512) @ (512, 1024) bf16, K sharded (row-parallel)",
        lambda impl: lambda a, b: matmul(a, b, implementation=impl),
        (((256, 512), _BF16, P(None, "model")), ((512, 1024), _BF16, P("model", None)))),
}

# (m, n, k) per shape set: on a device, on a CPU (xla), in the fast interpreter, in "strict".
BENCH = {"native": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 4096)],
         "cpu": [(512, 512, 512), (1024, 1024, 1024)],
         "interpret": [(1024, 1024, 1024)],
         "strict": [(128, 128, 128)]}


def sharded(impl):
    """name -> (the op of `impl` as a function of arrays, [(shape, spec)]), on a (2, 4) mesh
    ("data", "model")."""
    mm = lambda a, b: matmul(a, b, implementation=impl)  # noqa: E731

    def fused(a, b, bias, residual):
        return matmul(a, b, bias=bias, activation="gelu", residual=residual,
                      implementation=impl)

    return {
        "matmul/M": (mm, [((64, 32), P("data", None)), ((32, 48), P())]),
        "matmul/N": (mm, [((64, 32), P("data", None)), ((32, 48), P(None, "model"))]),
        "matmul/batch+K": (mm, [((4, 16, 32), P("data", None, "model")),
                                ((32, 48), P("model", None))]),
        # A row-parallel layer with the epilogue, applied after the partials' sum over the
        # sharded K; its residual sharded like the output.
        "matmul/K": (fused, [((64, 32), P("data", "model")), ((32, 48), P("model", None)),
                                      ((48,), P()), ((64, 48), P("data", None))]),
    }


# The sharded cases whose rule sums per-shard partials in the forward pass.
REDUCING = {"matmul/K", "matmul/batch+K"}


def _with_out_sharding(impl):
    return lambda a, b, s: matmul(a, b, out_sharding=s, implementation=impl)


# out_sharding on Explicit axes: name -> (op of (arrays, out_sharding), operands, asked, want):
# `asked` the out_sharding given (None: the default, where JAX's own op alone would raise),
# `want` the output's spec.
OUT_SHARDING = {
    "matmul/K": (_with_out_sharding, [((64, 32), P(None, "model")), ((32, 48), P("model", None))],
                 None, P()),
    # A sharded contraction's output asked for a sharding along the contraction's mesh axis.
    "matmul/K-reduce-scatter": (
        _with_out_sharding, [((64, 32), P(None, "model")), ((32, 48), P("model", None))],
        P("model", None), P("model", None)),
    "matmul/K-both": (
        _with_out_sharding, [((4, 16, 32), P(None, None, "model")), ((32, 48), P("model", None))],
        P("data", None, "model"), P("data", None, "model")),
    # Sequence-parallel activations into a dense layer with a bias: rows sharded on the
    # sequence, not the batch, so the batch is not folded into M (a reshape JAX refuses on
    # Explicit axes), and dbias sums over batch and rows.
    "matmul/sequence-sharded": (
        lambda impl: lambda a, b, bias, s: matmul(a, b, bias=bias, activation="silu",
                                                  out_sharding=s, implementation=impl),
        [((4, 16, 32), P(None, "model", None)), ((32, 48), P()), ((48,), P())],
        None, P(None, "model")),
    # A column-parallel layer whose bias and residual are replicated: their gradients are
    # typed replicated, as JAX's gradient types them (dZ is sharded over "model").
    "matmul/column-parallel-epilogue": (
        lambda impl: lambda a, b, bias, residual, s: matmul(
            a, b, bias=bias, activation="gelu", residual=residual, out_sharding=s,
            implementation=impl),
        [((64, 32), P("data", None)), ((32, 48), P(None, "model")), ((48,), P()),
         ((64, 48), P())],
        None, P("data", "model")),
}
# The out_sharding cases whose kernels must reduce-scatter into the sharding asked for.
REDUCE_SCATTERS = {"matmul/K-reduce-scatter", "matmul/K-both"}
