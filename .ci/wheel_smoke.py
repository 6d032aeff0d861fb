"""Smoke test of an installed `pallas-kernels` wheel, run by .ci/run from outside the checkout.

Every op, forward and gradient, through its default implementation and through both kernels
in the (fast) interpreter, against its reference evaluated in float64. It proves the wheel
carries everything an op needs (`kernels`, with the repository's `reference/` as
`kernels.reference`; nothing imported from the checkout), that it installs no top-level import
name but `kernels`, and that its metadata names the version `kernels.__version__` holds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import reference

RNG = np.random.default_rng(0)


def _array(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


IDS = np.asarray([0, 3, -1, 49, 50, -51, 7, 7], np.int32)  # in range, negative, out of range
# name: (op, reference, float32 args, the number of terms summed into an output, options)
CASES = {
    "matmul": (kernels.matmul, reference.matmul, [_array(64, 48), _array(48, 40)], 48, {}),
    "conv2d": (kernels.conv2d, reference.conv2d, [_array(2, 9, 9, 8), _array(3, 3, 8, 16)],
               72, {"padding": "SAME"}),
    "layer_norm": (kernels.layer_norm, reference.layer_norm,
                   [_array(16, 96), _array(96), _array(96)], 96, {}),
    "rms_norm": (kernels.rms_norm, reference.rms_norm, [_array(16, 96), _array(96)], 96, {}),
    "normalize": (kernels.normalize, reference.normalize, [_array(40, 6)], 40, {"axis": 0}),
    "gather": (kernels.gather, reference.gather, [_array(50, 24), IDS], 8, {"mode": "fill"}),
}
RUNS = [("default", None), ("triton", True), ("mosaic", True)]
# Interpreted, the Triton kernels multiply float32 as their GPU does, as TF32 (operands rounded
# to 10 mantissa bits: `kernels._blocks.round_to_tf32`): their products are held to TF32's
# unit, as tests/support.tolerance holds a GPU's dots.
TF32_EPS = 2.0 ** -10
DOTS = ("matmul", "conv2d")


def _loss_and_gradient(fn, args, weights):
    """The output and the gradient of sum(output * weights) for the floating args."""
    floating = [i for i, a in enumerate(args) if np.issubdtype(np.asarray(a).dtype, np.floating)]

    def loss(*differentiated):
        full = list(args)
        for i, value in zip(floating, differentiated):
            full[i] = value
        out = fn(*full)
        return jnp.sum(out * weights), out

    grads, out = jax.grad(loss, argnums=tuple(range(len(floating))), has_aux=True)(
        *[args[i] for i in floating])
    return out, grads


def main() -> None:
    where = pathlib.Path(kernels.__file__).resolve()
    assert "site-packages" in where.parts, f"kernels imported from {where}, not the wheel"
    assert importlib.metadata.version("pallas-kernels") == kernels.__version__
    top_level = importlib.metadata.distribution("pallas-kernels").read_text("top_level.txt")
    assert top_level.split() == ["kernels"], f"top-level import names: {top_level.split()}"
    assert importlib.util.find_spec("reference") is None, "a top-level `reference` is importable"
    checks = 0
    for name, (op, ref, args, terms, options) in CASES.items():
        with jax.enable_x64(True):
            args64 = [a.astype(np.float64) if a.dtype == np.float32 else a for a in args]
            shape = jax.eval_shape(lambda *a: ref(*a, **options), *args64).shape
            weights = RNG.integers(-8, 9, shape) / 8
            truth = _loss_and_gradient(lambda *a: ref(*a, **options), args64, weights)
        for implementation, interpret in RUNS:
            chosen = None if implementation == "default" else implementation
            got = _loss_and_gradient(
                lambda *a: op(*a, implementation=chosen, interpret=interpret, **options),
                args, jnp.asarray(weights, jnp.float32))
            unit = 4 * TF32_EPS if implementation == "triton" and name in DOTS else 1e-5
            for actual, expected in zip(jax.tree.leaves(got), jax.tree.leaves(truth)):
                np.testing.assert_allclose(np.asarray(actual, np.float64), expected,
                                           rtol=unit, atol=unit * terms,
                                           err_msg=f"{name} {implementation}")
                checks += 1
    print(f"pallas-kernels {kernels.__version__} wheel at {where.parent}: {len(CASES)} ops x "
          f"{len(RUNS)} implementations, {checks} forward and gradient checks passed")


if __name__ == "__main__":
    main()
