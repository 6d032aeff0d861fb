"""gather rows: an embedding lookup (axis 0, bfloat16 table) and its backward scatter-add.

GB/s count the minimum traffic, whatever a kernel actually moves: forward, the gathered rows
read once and the output written once; backward, the cotangent read once and the table
gradient written once (plus the indices). The backward row times the whole gradient: the
wrapper's sort of the index vector and the scatter-add kernel.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from bench.harness import Case, backward
from kernels.gather import OP, gather
from kernels.gather.common import Problem, gather_bytes, scatter_bytes
from kernels.reference.gather import gather as reference_gather
from kernels._cases import random

SHAPES = OP.cases.BENCH  # per shape set, in kernels/gather/cases.py


def _problem(vocabulary: int, features: int, ids: int, dtype) -> Problem:
    return Problem(1, vocabulary, features, ids, jnp.dtype(dtype), "clip", None)


def cases(shapes: str) -> list[Case]:
    """`shapes`: a key of `SHAPES` (each with the backward's rows)."""
    out = []
    for vocabulary, features, num_ids in SHAPES[shapes]:
        dtype = jnp.bfloat16
        table = random((vocabulary, features), dtype, seed=1)
        ids = jnp.asarray(np.random.default_rng(2).integers(0, vocabulary, num_ids), jnp.int32)
        p = _problem(vocabulary, features, num_ids, dtype)
        shape = f"table {vocabulary}x{features}, {num_ids} ids"
        forward = Case(
            op="gather", shape=shape, dtype="bfloat16", args=(table, ids),
            run=lambda name, interpret: lambda t, i: gather(t, i, implementation=name,
                                                            interpret=interpret),
            expected=reference_gather(table, ids), flops=0, bytes=gather_bytes(p))
        out += [forward, dataclasses.replace(backward(forward, reference_gather, wrt=(0,)),
                                             flops=num_ids * features, bytes=scatter_bytes(p))]
    return out
