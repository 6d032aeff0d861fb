"""What every op's test suite shares: implementations, the tolerance rule, x64, lowering."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kernels import _cases, registry
from kernels._pallas import lowered_text

# The registered implementations (kernels.registry) the installed jax runs.
IMPLEMENTATIONS = tuple(name for name in registry.names() if not registry.unavailable(name))
# A kernel's own lowering platform, and the custom call it leaves in lowered text.
PLATFORM = {name: registry.get(name).platforms[0] for name in registry.kernel_names()}
MARKER = {name: registry.get(name).call_marker for name in registry.kernel_names()}
# Capability flags: what an implementation declines (and must decline with a reason).
SUPPORTS_FLOAT64 = {name: registry.get(name).supports_float64 for name in IMPLEMENTATIONS}


def subprocess_env(cpu_only: bool) -> dict[str, str]:
    """The environment of a suite's subprocess: jax on the CPU and no XLA_FLAGS (a script sets
    its own device count). One that compiles only for the CPU compiles as this process does
    (`jax_disable_most_optimizations`, tests/conftest.py); one that compiles for GPUs or TPUs
    keeps their compilers' defaults, whose registers, spills and memory the tests read."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if cpu_only:
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return env


def needs(implementation: str) -> Any:  # a pytest.MarkDecorator
    """Skips a test where the installed jax lacks `implementation` (Mosaic GPU before jax
    0.12: its tests run on the other Python), naming why."""
    import pytest  # here: `python -m bench` imports this module without the test extra
    missing = registry.unavailable(implementation)
    return pytest.mark.skipif(missing is not None, reason=f"{implementation}: {missing}")


def skip_without_xla_gpu_compiler() -> None:
    """Skips a test that compiles a whole program for GPUs where XLA's GPU compiler is missing
    (the test extra's CUDA plugin installs it, so the README's command runs the test)."""
    import pytest
    from kernels.compile.api import missing_package

    if missing_package("mosaic_gpu"):
        pytest.skip(f"XLA's GPU compiler needs {missing_package('mosaic_gpu')}")


def implementations_of(op: str | None) -> tuple[str, ...]:
    """The implementations an op's shared tests run: the reference and each kernel the op's
    folder holds (`Op.has`). `None`: those every op has (tests of several ops at once)."""
    from kernels.ops import OPS

    ops = list(OPS.values()) if op is None else [OPS[op]]
    return tuple(name for name in IMPLEMENTATIONS
                 if not registry.get(name).is_kernel or all(o.has(name) for o in ops))


def kernels_of(op: str | None) -> tuple[str, ...]:
    return tuple(name for name in implementations_of(op) if registry.get(name).is_kernel)


def fast_kernels_of(op: str | None) -> tuple[str, ...]:
    """Kernels whose `interpret=True` is the fast interpreter: those the model-size tests run."""
    return tuple(name for name in kernels_of(op) if registry.get(name).fast_interpreter)


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Where a float32 dot at default precision rounds its operands natively: TF32 (10 mantissa
# bits) on GPUs, bfloat16 (7) on TPUs; the machine epsilon of that rounding.
DOT_FLOAT32_EPS = {"gpu": 2.0 ** -10, "tpu": 2.0 ** -7}


def tf32_rounded(x: Any) -> np.ndarray:
    """float32 `x` rounded to the nearest TF32 value (11 significant bits, ties away from zero,
    as PTX's cvt.rna.tf32.f32), in float64; normal numbers only."""
    mantissa, exponent = np.frexp(as_f64(x))
    return np.ldexp(np.sign(mantissa) * np.floor(np.abs(mantissa) * 2.0 ** 11 + 0.5) / 2.0 ** 11,
                    exponent)


def dot_platform(implementation: str) -> str | None:
    """The platform whose float32 dots an interpreted `implementation` computes as (the
    `platform` of `tolerance`): the GPU kernels round float32 operands to TF32 as on their
    device (`kernels._blocks.round_to_tf32`), so they are compared as a GPU's; the others as
    this process's dots (None)."""
    return "gpu" if registry.PLATFORMS.get(PLATFORM.get(implementation)) == "gpu" else None


def tolerance(dtype: Any, reduction_length: int = 1, dot: bool = False,
              platform: str | None = None, rounded_terms: Any = None) -> dict[str, float]:
    """The one tolerance rule, for a result in `dtype` against float64 ground truth.

    Relative: a few roundings of `dtype` (the output's own rounding). Absolute: the rounding of
    the accumulator, float32 for 16-bit and 32-bit data, float64 for float64, growing with the
    number of terms summed into each output element (each term's rounding error adds, and for
    unit-scale inputs so does the sums' magnitude).

    `dot`: the result of a dot (matmul, convolution) at default precision. Run natively,
    jax's default precision rounds float32 operands before they are multiplied, in XLA's own
    dots and in the kernels alike: to TF32 on a GPU, to bfloat16 on a TPU
    (`DOT_FLOAT32_EPS`), so float32 gets that unit in both terms. On a CPU (and in the
    interpreters) float32 dots are exact float32: the rule is unchanged there. `platform`:
    the platform whose dots are compared where it is not this process's (an interpreted GPU
    kernel, which rounds float32 operands to TF32 as its device does: `dot_platform`).

    `rounded_terms`: the dtype each of the `reduction_length` (unit-scale) terms of a sum was
    rounded to before it, as a 16-bit layer's gradient rounds z and dZ (`reference.epilogue.
    layer`). Those roundings are independent, each within half a unit of that dtype: their sum
    walks, about sqrt(n / 3) half-units for n terms; the allowance is 2·eps·sqrt(n), about seven
    such deviations.
    """
    eps = float(jnp.finfo(dtype).eps)
    accumulator = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    accumulator_eps = float(jnp.finfo(accumulator).eps)
    if dot and jnp.dtype(dtype) == jnp.float32:
        eps = accumulator_eps = DOT_FLOAT32_EPS.get(platform or jax.default_backend(), eps)
    atol = 4 * accumulator_eps * max(1, reduction_length)
    if rounded_terms is not None:
        atol += 2 * float(jnp.finfo(rounded_terms).eps) * math.sqrt(max(1, reduction_length))
    return {"rtol": 4 * eps, "atol": atol}


def assert_close(actual: jax.Array, expected: Any, dtype: Any, reduction_length: int = 1,
                 dot: bool = False, platform: str | None = None,
                 rounded_terms: Any = None) -> None:
    """`actual` (computed in `dtype`) equals float64 `expected` within `tolerance`."""
    chex.assert_trees_all_close(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                                **tolerance(dtype, reduction_length, dot, platform,
                                            rounded_terms))


def weighted_sum(y: jax.Array) -> jax.Array:
    """A scalar loss that weighs every element of `y` differently and is linear in `y`: its
    gradient with respect to `y` is the weights exactly, in any dtype (multiples of 1/8 in
    [-1, 1]), so a gradient compared with float64 truth carries only the backward's own
    rounding. A nonlinear loss such as sum(sin(y)) would also carry the forward's rounding of y
    into every cotangent, which the tolerance rule does not count."""
    weights = np.random.default_rng(1234).integers(-8, 9, size=y.shape) / 8
    return jnp.sum(y * jnp.asarray(weights, y.dtype))


def standard_promotion() -> contextlib.AbstractContextManager:
    """JAX's standard dtype promotion for a block. The suite runs under
    `jax_numpy_dtype_promotion="strict"` (tests/conftest.py); only the tests of mixed-dtype
    promotion, and code of others' that strict rejects (Flax's own layers), set it back."""
    return jax.numpy_dtype_promotion("standard")


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """64-bit types enabled for the block (float64 inputs, int64 indices)."""
    with jax.enable_x64(True):
        yield


random = _cases.random  # the tests' inputs, drawn as the bench draws its own


def as_f64(x: jax.Array) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def assert_lowers(fn: Callable[..., Any], *args: Any, implementation: str,
                  min_kernels: int = 1) -> str:
    """Lowers `fn(*args)` for `implementation`'s platform on this CPU machine and asserts that
    at least `min_kernels` of its kernel calls are in the text."""
    text = lowered_text(fn, *args, platform=PLATFORM[implementation])
    count = text.count(MARKER[implementation])
    assert count >= min_kernels, (
        f"expected >= {min_kernels} {MARKER[implementation]} calls, found {count}")
    return text


def reduction_length(*dims: int) -> int:
    return math.prod(dims)


def walked_pipeline_bytes(eqn) -> int:
    """Bytes a Mosaic launch's BlockSpec pipeline moves, by walking its grid step by step and
    calling each index map (only for small grids): an input block is copied in, an output
    block written back, whenever its index differs from the previous step's, clipped to the
    array, in whole memory tiles. Operands left in HBM or SMEM (manual DMAs) are not counted."""
    import itertools

    from kernels._traffic import copied_bytes

    grid_mapping = eqn.params["grid_mapping"]
    mappings = grid_mapping.block_mappings[:grid_mapping.num_inputs + grid_mapping.num_outputs]
    prefetch = [np.zeros(v.aval.shape, v.aval.dtype)
                for v in eqn.invars[:grid_mapping.num_index_operands]]
    total = 0
    for mapping in mappings:
        space = str(getattr(mapping.block_aval, "memory_space", "")).lower()
        if any(name in space for name in ("any", "hbm", "smem")):
            continue
        jaxpr = mapping.index_map_jaxpr
        steps = [[int(i) for i in jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *step,
                                                       *prefetch)]
                 for step in itertools.product(*map(range, grid_mapping.grid))]
        dims = [(getattr(d, "block_size", 1), type(d).__name__ == "Element")
                for d in mapping.block_shape]
        total += copied_bytes(np.array(steps), dims, mapping.array_aval.shape,
                              mapping.array_aval.dtype)
    return total


@dataclasses.dataclass(frozen=True)
class Contract:
    """An op's part in the shared contract tests (tests/test_contract.py), defined beside its
    own helpers in tests/test_<op>.py."""

    call: Callable[[str], Callable[..., Any]]  # implementation -> the op as a function of arrays
    example: Callable[[], tuple]  # inputs for the jit and eager calls
    repeated: Callable[[int], tuple]  # seed -> float32 inputs, one shape for every seed
    # check(out, *inputs, implementation=): against float64 truth
    check: Callable[..., None]
    small: Callable[..., Any]  # small(**options): one small call, with the options under test
