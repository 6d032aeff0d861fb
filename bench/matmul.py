"""matmul rows: square and skinny products in float32 and bfloat16."""

from __future__ import annotations

import jax.numpy as jnp

import kernels
import reference
from bench.harness import Case
from kernels.matmul.common import flops_and_bytes, make_problem
from tests.support import random

NATIVE_SHAPES = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 4096)]
INTERPRET_SHAPES = [(256, 256, 256)]
CPU_SHAPES = [(512, 512, 512), (1024, 1024, 1024)]


def cases(shapes: str) -> list[Case]:
    """`shapes`: "native" (an accelerator), "cpu" (xla on a CPU) or "interpret" (small)."""
    chosen = {"native": NATIVE_SHAPES, "cpu": CPU_SHAPES, "interpret": INTERPRET_SHAPES}[shapes]
    out = []
    for m, n, k in chosen:
        for dtype in (jnp.float32, jnp.bfloat16):
            a, b = random((m, k), dtype, seed=1), random((k, n), dtype, seed=2)
            flops, nbytes = flops_and_bytes(make_problem(a, b, False, False, jnp.dtype(dtype)))
            out.append(Case(
                op="matmul", shape=f"{m}x{k} @ {k}x{n}", dtype=jnp.dtype(dtype).name,
                args=(a, b),
                run=lambda name, interpret: lambda a, b: kernels.matmul(
                    a, b, implementation=name, interpret=interpret),
                expected=reference.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                                          precision="highest"),
                flops=flops, bytes=nbytes))
    return out
