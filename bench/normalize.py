"""normalize rows: layer norm over the last axis, and the tutorial's axis-0 standardization
`(X - X.mean(0)) / X.std(0)` (also timed in NumPy, a `baselines` entry).

GB/s count the one-read-one-write minimum (x read once, y written once), whatever a kernel
actually moves, so the column compares implementations against the same floor.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bench.harness import WITH_BACKWARD, Case, backward
from kernels.normalize import OP, common, normalize
from kernels.reference.normalize import normalize as reference_normalize
from kernels._cases import random

SHAPES = OP.cases.BENCH  # per shape set, in kernels/normalize/cases.py


def _numpy_standardize(x):
    x = np.asarray(x)
    return (x - x.mean(0)) / x.std(0)


def _problem(x, axis, has_params: bool) -> common.Problem:
    axes = (axis % x.ndim,)
    _, (outer, groups, reduced, rows) = common.plan(x.shape, axes)
    return common.Problem(outer, groups, reduced, rows, jnp.dtype(x.dtype), True,
                          1e-5 if has_params else 0.0, has_params, has_params)


def cases(shapes: str) -> list[Case]:
    """`shapes`: a key of `SHAPES`; native and interpreted sizes also get the gradient's rows."""
    out = []
    for shape, axis, has_params in SHAPES[shapes]:
        dtypes = (jnp.float32, jnp.bfloat16) if has_params else (jnp.float32,)
        for dtype in dtypes:
            x = random(shape, dtype, seed=1)
            epsilon = 1e-5 if has_params else 0.0
            if has_params:
                scale = random(shape[axis:][:1], jnp.float32, seed=2) + 1
                offset = random(shape[axis:][:1], jnp.float32, seed=3)
                args = (x, scale, offset)
            else:
                args = (x,)
            p = _problem(x, axis, has_params)

            def run(name, interpret, axis=axis, epsilon=epsilon):
                return lambda *a: normalize(*a, axis=axis, epsilon=epsilon,
                                             implementation=name, interpret=interpret)

            def reference(*a, axis=axis, epsilon=epsilon):
                return reference_normalize(*a, axis=axis, epsilon=epsilon)

            expected = reference(*(a.astype(jnp.float32) for a in args))
            baselines = {} if has_params else {"numpy": _numpy_standardize}
            flops, _ = common.forward_flops_and_bytes(p)
            label = "layer norm" if has_params else "standardize"
            out.append(Case(
                op="normalize", shape=f"{label} {shape[0]}x{shape[1]} axis={axis}",
                dtype=jnp.dtype(dtype).name, args=args, run=run, expected=expected,
                flops=flops, bytes=common.minimum_bytes(p), baselines=baselines))
            if shapes in WITH_BACKWARD:
                out.append(backward(out[-1], reference, wrt=range(len(args))))
    return out
