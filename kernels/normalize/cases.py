"""normalize beyond its unit tests, as data (`OP.cases`): the shapes its kernels are compiled at
(`COMPILE`, read by `kernels.compile`), its whole programs (`PROGRAMS`), its bench shapes
(`BENCH`, read by `bench/normalize.py`) and its sharded cases (`sharded`, `OUT_SHARDING`, run by
tests/sharded_run.py on 8 CPU devices)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels._cases import Case, Program, shape_text, spec
from kernels.normalize import layer_norm, normalize, rms_norm

_BF16, _F32 = jnp.bfloat16, jnp.float32
_FUNCTIONS = {"normalize": normalize, "layer_norm": layer_norm, "rms_norm": rms_norm}


def _case(op: str, shape, dtype, axis=-1, params=True, residual=False, **options) -> Case:
    """`residual`: the fused residual add, both outputs used (so its backward adds the sum's
    cotangent)."""
    axes = (axis,) if isinstance(axis, int) else axis
    param_shape = tuple(shape[a] for a in sorted(a % len(shape) for a in axes))
    fn = _FUNCTIONS[op]
    count = {"normalize": 2, "layer_norm": 2, "rms_norm": 1}[op] if params else 0
    args = (spec(shape, dtype),) * (1 + residual) + (spec(param_shape, _F32),) * count
    extra = f", out_dtype={jnp.dtype(options['out_dtype']).name}" if "out_dtype" in options else ""

    def call(impl, x, *rest):
        if not residual:
            return fn(x, *rest, axis=axis, implementation=impl, interpret=False, **options)
        y, summed = fn(x, *rest[1:], residual=rest[0], axis=axis, implementation=impl,
                       interpret=False, **options)
        return y.astype(_F32) + summed.astype(_F32)

    return Case("normalize", f"{op}{' + residual' * residual} {shape_text(shape)} "
                f"{jnp.dtype(dtype).name} axis={axis}{extra}", args, call)


# The bench's device shapes (`designed`: those its design figures show), the shapes of models
# people train, and odd small ones.
COMPILE = [
    _case("layer_norm", (8192, 1024), _BF16).designed(),
    _case("layer_norm", (4096, 8192), _BF16).designed(),
    _case("rms_norm", (4096, 8192), _BF16),
    _case("layer_norm", (4096, 6000), _F32),  # one chunk
    # Two chunks, sums in the program (`normalize.triton.config._MAX_REREAD_CHUNKS`).
    _case("layer_norm", (4096, 16384), _BF16),
    _case("layer_norm", (4096, 12000), _F32),
    _case("layer_norm", (512, 16384), _F32),
    _case("rms_norm", (512, 16384), _F32),
    _case("normalize", (4096, 8192), _BF16, axis=0),
    _case("normalize", (10000, 100), _F32, axis=0, params=False, epsilon=0.0),
    _case("normalize", (1048576, 64), _F32, axis=0).designed(),
    _case("normalize", (32, 56, 56, 256), _BF16, axis=(0, 1, 2)).designed(),
    _case("normalize", (8, 64, 4096), _F32, axis=(0, 2)),
    _case("layer_norm", (7, 129), _F32),
    # The fused residual add (issue 25): a transformer's pre-norm, a row of 8192 in one
    # chunk (its backward also reads dsum), the columns layout, and the fused cast.
    _case("layer_norm", (8192, 1024), _BF16, residual=True).designed(),
    _case("rms_norm", (4096, 8192), _BF16, residual=True),
    _case("layer_norm", (4096, 6000), _F32, residual=True),
    _case("layer_norm", (4096, 16384), _F32, residual=True),  # 4096 chunks
    _case("normalize", (4096, 8192), _BF16, axis=0, residual=True),
    _case("rms_norm", (8192, 1024), _F32, out_dtype=_BF16),
    _case("layer_norm", (7, 129), _F32, residual=True),
]

PROGRAMS = {
    "layer_norm": Program(
        "normalize", "(256, 1024) bf16 rows sharded, scale and offset",
        lambda impl: lambda x, s, o: layer_norm(x, s, o, implementation=impl),
        (((256, 1024), _BF16, P("data", None)), ((1024,), _F32, P()), ((1024,), _F32, P()))),
    "rms_norm": Program(
        "normalize", "(256, 1024) bf16 rows sharded over both mesh axes, scale",
        lambda impl: lambda x, s: rms_norm(x, s, implementation=impl),
        (((256, 1024), _BF16, P(("data", "model"), None)), ((1024,), _F32, P()))),
    "normalize_axis0": Program(
        "normalize", "(4096, 256) f32 over axis 0 (split moments), columns sharded",
        lambda impl: lambda x: normalize(x, axis=0, implementation=impl),
        (((4096, 256), _F32, P(None, "model")),)),
    "normalize_axis0_rows": Program(
        "normalize", "(4096, 256) f32 over axis 0, rows (the normalized axis) sharded",
        lambda impl: lambda x: normalize(x, axis=0, implementation=impl),
        (((4096, 256), _F32, P("data", None)),), sharded_kernels=False),
}

# (shape, axis, with scale/offset) per shape set: on a device, on a CPU (xla), in the fast
# interpreter, in "strict": layer norm over features, then the tutorial's columns.
BENCH = {"native": [((8192, 1024), -1, True), ((4096, 8192), -1, True), ((10000, 100), 0, False)],
         "cpu": [((2048, 1024), -1, True), ((512, 8192), -1, True), ((10000, 100), 0, False)],
         "interpret": [((2048, 1024), -1, True), ((20000, 64), 0, False)],
         "strict": [((256, 1024), -1, True), ((1000, 100), 0, False)]}


def sharded(impl):
    """name -> (the op of `impl` as a function of arrays, [(shape, spec)]), on a (2, 4) mesh
    ("data", "model")."""
    ln = lambda x, s, o: layer_norm(x, s, o, implementation=impl)  # noqa: E731
    return {
        "normalize/rows": (ln, [((64, 40), P("data", None)), ((40,), P()), ((40,), P())]),
        "normalize/normalized-axis": (ln, [((64, 40), P("data", "model")), ((40,), P("model")),
                                           ((40,), P("model"))]),
        "normalize/rms-normalized-axis": (
            lambda x, s: rms_norm(x, s, implementation=impl),
            [((16, 64), P(None, "model")), ((64,), P("model"))]),
        # The fused residual add (both outputs, summed to one array), per shard of rows and
        # with the normalized axis sharded (the moments merged over the mesh).
        "normalize/residual-rows": (
            lambda x, r, s, o: sum(layer_norm(x, s, o, residual=r, implementation=impl)),
            [((64, 40), P("data", None)), ((64, 40), P("data", None)), ((40,), P()),
             ((40,), P())]),
        "normalize/residual-normalized-axis": (
            lambda x, r, s: sum(rms_norm(x, s, residual=r, implementation=impl)),
            [((16, 64), P(None, "model")), ((16, 64), P(None, "model")), ((64,), P("model"))]),
        "normalize/standardize-axis0": (
            lambda x: normalize(x, axis=0, epsilon=0.0, implementation=impl),
            [((64, 24), P("model", "data"))]),
    }


# The sharded cases whose rule sums per-shard partials in the forward pass (Chan's merge).
REDUCING = {"normalize/normalized-axis", "normalize/rms-normalized-axis",
            "normalize/standardize-axis0", "normalize/residual-normalized-axis"}

# out_sharding on Explicit axes: name -> (op of (arrays, out_sharding), operands, asked, want):
# `asked` the out_sharding given, `want` the output's spec (y's: the sum keeps x's).
OUT_SHARDING = {
    "layer_norm/replicated": (
        lambda impl: lambda x, r, s: sum(layer_norm(x, residual=r, out_sharding=s,
                                                    implementation=impl)[:1]),
        [((64, 40), P("data", None)), ((64, 40), P("data", None))], P(), P()),
    "layer_norm/residual-sum": (
        lambda impl: lambda x, r, s: layer_norm(x, residual=r, out_sharding=s,
                                                implementation=impl)[1],
        [((64, 40), P("data", None)), ((64, 40), P("data", None))], P(), P("data")),
    # A (batch, sequence, features) activation, batch and features sharded, its residual
    # replicated (the default out_sharding): the kernels' 3-D view keeps x's sharding, and the
    # residual's gradient is typed replicated.
    "layer_norm/sequence-residual-replicated": (
        lambda impl: lambda x, r, s: layer_norm(x, residual=r, out_sharding=s,
                                                implementation=impl)[0],
        [((4, 6, 40), P("data", None, "model")), ((4, 6, 40), P())], None,
        P("data", None, "model")),
}
REDUCE_SCATTERS: set[str] = set()  # out_sharding cases that must reduce-scatter: none
