"""gather beyond its unit tests, as data (`OP.cases`): the shapes its kernels are compiled at
(`COMPILE`, read by `kernels.compile`), its whole programs (`PROGRAMS`), its bench shapes
(`BENCH`, read by `bench/gather.py`) and its sharded cases (`sharded`, `OUT_SHARDING`, with
`REDUCING` and `REDUCE_SCATTERS`, run by tests/sharded_run.py on 8 CPU devices, where "ids"
operands are indices of every kind: negative, past either end)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels._cases import Case, Program, shape_text, spec
from kernels.gather import gather

_BF16, _F32, _I32 = jnp.bfloat16, jnp.float32, jnp.int32


def _case(table_shape, num_ids, dtype, axis=0, mode=None) -> Case:
    return Case("gather", f"table {shape_text(table_shape)} {jnp.dtype(dtype).name}, "
                f"{num_ids} ids, axis={axis}, mode={mode}",
                (spec(table_shape, dtype), spec((num_ids,), _I32)),
                lambda impl, x, i: gather(x, i, axis=axis, mode=mode, implementation=impl,
                                          interpret=False))


# The bench's device shape (`designed`: its design figures show it), and odd small ones.
COMPILE = [
    _case((32000, 4096), 8192, _BF16).designed(),
    _case((32000, 4096), 8192, _F32),
    _case((32000, 4096), 8192, _BF16, mode="fill"),
    _case((8, 1000, 257), 64, _F32, axis=1),
    _case((129, 257), 7, _BF16, mode="fill"),
]

PROGRAMS = {
    "gather": Program(
        "gather", "(4096, 256) bf16 table sharded by columns, 1024 ids sharded",
        lambda impl: lambda t, i: gather(t, i, mode="fill", fill_value=0, implementation=impl),
        (((4096, 256), _BF16, P(None, "model")), ((1024,), _I32, P("data")))),
    # Where JAX's own op alone raises on Explicit axes (it asks for an out_sharding): the
    # default (`xla` there) is given the sharding the kernels give.
    "gather_vocab": Program(
        "gather", "(4096, 256) bf16 table sharded by rows (vocab-parallel), 1024 ids sharded",
        lambda impl: lambda t, i: gather(t, i, implementation=impl),
        (((4096, 256), _BF16, P("model", None)), ((1024,), _I32, P("data")))),
}

# (vocabulary, features, ids) per shape set: on a device, on a CPU (xla), in the fast
# interpreter, in "strict".
BENCH = {"native": [(32000, 4096, 8192)], "cpu": [(32000, 512, 2048)],
         "interpret": [(20000, 256, 4096)], "strict": [(1000, 128, 64)]}


def sharded(impl):
    """name -> (the op of `impl` as a function of arrays, [(shape or ids, spec)]), on a (2, 4)
    mesh ("data", "model")."""
    def take(mode, fill=None):
        return lambda x, i: gather(x, i, mode=mode, fill_value=fill, implementation=impl)

    return {
        "gather/indices": (take(None), [((96, 16), P()), ("ids", P("data"))]),
        "gather/2d-indices": (take(None), [((96, 16), P("model", None)), ("ids2d", P("data"))]),
        "gather/vocab-clip": (take("clip"), [((96, 16), P("model", None)), ("ids", P("data"))]),
        "gather/vocab-default": (take(None), [((96, 16), P("model", None)), ("ids", P("data"))]),
        "gather/vocab-fill": (take("fill", -2.0), [((96, 16), P("model", None)),
                                                   ("ids", P("data"))]),
        "gather/vocab-wrap": (take("wrap"), [((96, 16), P("model", None)), ("ids", P("data"))]),
    }


# The sharded cases whose rule sums per-shard partials in the forward pass (a vocab-parallel
# table's sum over owners).
REDUCING = {"gather/2d-indices", "gather/vocab-clip", "gather/vocab-default",
            "gather/vocab-fill", "gather/vocab-wrap"}

# out_sharding on Explicit axes: name -> (op of (arrays, out_sharding), operands, asked, want):
# `asked` the out_sharding given (None: the default, where JAX's own op alone would raise),
# `want` the output's spec. A table sharded along the gathered axis reduce-scatters into an
# asked sharding.
OUT_SHARDING = {
    "gather/vocab": (
        lambda impl: lambda x, i, s: gather(x, i, out_sharding=s, implementation=impl),
        [((96, 16), P("model", None)), ("ids", P("data"))], None, P("data")),
    "gather/vocab-reduce-scatter": (
        lambda impl: lambda x, i, s: gather(x, i, mode="fill", out_sharding=s,
                                            implementation=impl),
        [((96, 16), P("model", None)), ("ids", P())], P("model", None), P("model", None)),
    # Indices sharded on both dims (2 rows, one a device along "data"): the output keeps both.
    "gather/2d-indices-both": (
        lambda impl: lambda x, i, s: gather(x, i, out_sharding=s, implementation=impl),
        [((96, 16), P()), ("ids2x32", P("data", "model"))], None, P("data", "model")),
}
# The out_sharding cases whose kernels must reduce-scatter into the sharding asked for.
REDUCE_SCATTERS = {"gather/vocab-reduce-scatter"}
