"""The shapes every kernel is compiled at (`CASES`, per op): the bench's device shapes, the
shapes of models people train, and odd small ones. Each `Case` is an op's forward and its
gradient, so a case compiles every kernel the op launches; `design` marks the shapes whose
launches the bench's design figures show."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import kernels

__all__ = ["Case", "CASES"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape: `call(implementation, *arrays)` runs it; the compiled function is
    its forward and its gradient with respect to every float argument."""

    op: str
    description: str
    args: tuple[jax.ShapeDtypeStruct, ...]
    call: Callable[..., Any]
    design: bool = False  # one of the device-sized shapes the bench's design figures show

    def function(self, implementation: str) -> Callable[..., Any]:
        def forward_and_backward(*arrays):
            def loss(*xs):
                return jnp.sum(self.call(implementation, *xs).astype(jnp.float32))

            float_args = tuple(i for i, a in enumerate(arrays)
                               if jnp.issubdtype(a.dtype, jnp.floating))
            return jax.value_and_grad(loss, argnums=float_args)(*arrays)

        return forward_and_backward


def _spec(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _matmul_case(a_shape, b_shape, dtype) -> Case:
    return Case("matmul", f"{'x'.join(map(str, a_shape))} @ {'x'.join(map(str, b_shape))} "
                f"{jnp.dtype(dtype).name}", (_spec(a_shape, dtype), _spec(b_shape, dtype)),
                lambda impl, a, b: kernels.matmul(a, b, implementation=impl, interpret=False))


def _conv_case(x_shape, w_shape, dtype, **options) -> Case:
    extra = "".join(f", {k}={v}" for k, v in options.items())
    return Case("conv2d", f"{'x'.join(map(str, x_shape))} * {'x'.join(map(str, w_shape))} "
                f"{jnp.dtype(dtype).name}{extra}", (_spec(x_shape, dtype), _spec(w_shape, dtype)),
                lambda impl, x, w: kernels.conv2d(x, w, implementation=impl, interpret=False,
                                                  **options))


def _normalize_case(op: str, shape, dtype, axis=-1, params=True, residual=False,
                    **options) -> Case:
    """`residual`: the fused residual add, both outputs used (so its backward adds the sum's
    cotangent)."""
    axes = (axis,) if isinstance(axis, int) else axis
    param_shape = tuple(shape[a] for a in sorted(a % len(shape) for a in axes))
    fn = getattr(kernels, op)
    count = {"normalize": 2, "layer_norm": 2, "rms_norm": 1}[op] if params else 0
    args = (_spec(shape, dtype),) * (1 + residual) + (_spec(param_shape, jnp.float32),) * count
    extra = f", out_dtype={jnp.dtype(options['out_dtype']).name}" if "out_dtype" in options else ""

    def call(impl, x, *rest):
        if not residual:
            return fn(x, *rest, axis=axis, implementation=impl, interpret=False, **options)
        y, total = fn(x, *rest[1:], residual=rest[0], axis=axis, implementation=impl,
                      interpret=False, **options)
        return y.astype(jnp.float32) + total.astype(jnp.float32)

    return Case("normalize", f"{op}{' + residual' * residual} {'x'.join(map(str, shape))} "
                f"{jnp.dtype(dtype).name} axis={axis}{extra}", args, call)


def _gather_case(table_shape, num_ids, dtype, axis=0, mode=None) -> Case:
    return Case("gather", f"table {'x'.join(map(str, table_shape))} {jnp.dtype(dtype).name}, "
                f"{num_ids} ids, axis={axis}, mode={mode}",
                (_spec(table_shape, dtype), _spec((num_ids,), jnp.int32)),
                lambda impl, x, i: kernels.gather(x, i, axis=axis, mode=mode,
                                                  implementation=impl, interpret=False))


def _design(case: Case) -> Case:
    return dataclasses.replace(case, design=True)


def _cases() -> dict[str, list[Case]]:
    """The bench's device shapes, the shapes of models people train, and odd small ones;
    `_design` marks those the bench's design figures show."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    return {
        "matmul": [
            _design(_matmul_case((1024, 1024), (1024, 1024), f32)),
            _matmul_case((1024, 1024), (1024, 1024), bf16),
            _matmul_case((4096, 4096), (4096, 4096), f32),
            _design(_matmul_case((4096, 4096), (4096, 4096), bf16)),
            _matmul_case((8192, 4096), (4096, 1024), f32),
            _design(_matmul_case((8192, 4096), (4096, 1024), bf16)),
            _design(_matmul_case((16, 4096), (4096, 4096), bf16)),  # decode: split K
            _matmul_case((129, 65), (65, 257), f32),
            _matmul_case((8, 1000, 1000), (8, 1000, 1000), bf16),
            _matmul_case((7, 5), (5, 13), f32),
        ],
        "conv2d": [
            _design(_conv_case((32, 56, 56, 64), (3, 3, 64, 64), bf16)),
            _design(_conv_case((32, 56, 56, 64), (1, 1, 64, 256), bf16)),
            _design(_conv_case((32, 28, 28, 128), (3, 3, 128, 256), bf16, stride=2)),
            _design(_conv_case((32, 112, 112, 32), (3, 3, 1, 32), bf16, feature_group_count=32)),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 128), f32),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 128), bf16),
            _conv_case((8, 64, 64, 128), (3, 3, 128, 256), f32, stride=2),
            _conv_case((2, 33, 65, 65), (3, 3, 65, 129), f32),
            _conv_case((8, 56, 56, 96), (7, 7, 1, 96), bf16, feature_group_count=96),  # ConvNeXt
            _conv_case((1, 9, 17, 8), (3, 3, 8, 16), f32, stride=2),
        ],
        "normalize": [
            _design(_normalize_case("layer_norm", (8192, 1024), bf16)),
            _design(_normalize_case("layer_norm", (4096, 8192), bf16)),
            _normalize_case("rms_norm", (4096, 8192), bf16),
            _normalize_case("layer_norm", (4096, 6000), f32),  # one chunk
            # Two chunks, sums in the program (`normalize.triton.config._MAX_REREAD_CHUNKS`).
            _normalize_case("layer_norm", (4096, 16384), bf16),
            _normalize_case("layer_norm", (4096, 12000), f32),
            _normalize_case("layer_norm", (512, 16384), f32),
            _normalize_case("rms_norm", (512, 16384), f32),
            _normalize_case("normalize", (4096, 8192), bf16, axis=0),
            _normalize_case("normalize", (10000, 100), f32, axis=0, params=False, epsilon=0.0),
            _design(_normalize_case("normalize", (1048576, 64), f32, axis=0)),
            _design(_normalize_case("normalize", (32, 56, 56, 256), bf16, axis=(0, 1, 2))),
            _normalize_case("normalize", (8, 64, 4096), f32, axis=(0, 2)),
            _normalize_case("layer_norm", (7, 129), f32),
            # The fused residual add (issue 25): a transformer's pre-norm, a row of 8192 in one
            # chunk (its backward also reads dsum), the columns layout, and the fused cast.
            _design(_normalize_case("layer_norm", (8192, 1024), bf16, residual=True)),
            _normalize_case("rms_norm", (4096, 8192), bf16, residual=True),
            _normalize_case("layer_norm", (4096, 6000), f32, residual=True),
            _normalize_case("layer_norm", (4096, 16384), f32, residual=True),  # 4096 chunks
            _normalize_case("normalize", (4096, 8192), bf16, axis=0, residual=True),
            _normalize_case("rms_norm", (8192, 1024), f32, out_dtype=bf16),
            _normalize_case("layer_norm", (7, 129), f32, residual=True),
        ],
        "gather": [
            _design(_gather_case((32000, 4096), 8192, bf16)),
            _gather_case((32000, 4096), 8192, f32),
            _gather_case((32000, 4096), 8192, bf16, mode="fill"),
            _gather_case((8, 1000, 257), 64, f32, axis=1),
            _gather_case((129, 257), 7, bf16, mode="fill"),
        ],
    }


CASES = _cases()
