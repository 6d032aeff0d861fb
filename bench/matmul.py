"""matmul rows: square and skinny products in float32 and bfloat16."""

from __future__ import annotations

import jax.numpy as jnp

import kernels
from kernels.matmul import OP
from kernels import reference
from bench.harness import WITH_BACKWARD, Case, backward
from kernels.matmul.common import flops_and_bytes, make_problem
from kernels._cases import random

SHAPES = OP.cases.BENCH  # per shape set, in kernels/matmul/cases.py


def _reference(a, b):
    return reference.matmul(a, b, precision="highest")


def cases(shapes: str) -> list[Case]:
    """`shapes`: a key of `SHAPES`; native and interpreted sizes also get the gradient's rows."""
    out = []
    for m, n, k in SHAPES[shapes]:
        for dtype in (jnp.float32, jnp.bfloat16):
            a, b = random((m, k), dtype, seed=1), random((k, n), dtype, seed=2)
            flops, nbytes = flops_and_bytes(make_problem(a, b, False, False, jnp.dtype(dtype)))
            out.append(Case(
                op="matmul", shape=f"{m}x{k} @ {k}x{n}", dtype=jnp.dtype(dtype).name,
                args=(a, b),
                run=lambda name, interpret: lambda a, b: kernels.matmul(
                    a, b, implementation=name, interpret=interpret),
                expected=_reference(a.astype(jnp.float32), b.astype(jnp.float32)),
                flops=flops, bytes=nbytes))
    if shapes in WITH_BACKWARD:
        out += [backward(case, _reference, wrt=(0, 1)) for case in out]
    return out
