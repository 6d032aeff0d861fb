"""Sharding as part of an array's type (Explicit mesh axes), for gradient rules: the reference's
own (`epilogue.layer`) and, through `kernels.partition`, every kernel's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType


def explicit_mesh(operands: Sequence[Any]) -> Any:
    """The mesh with Explicit axes some operand lives on, if any (sharded or replicated: its
    type says how, so shard_map can run the plan)."""
    for x in operands:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and any(
                t == AxisType.Explicit for t in mesh.axis_types):
            return mesh
    return None


def typed_like(cotangent: Any, primal: Any) -> Any:
    """`cotangent` with `primal`'s sharding where that is part of the type (Explicit axes):
    a custom_vjp's cotangent must be typed like its primal (also an operand resharded like
    another, or a result given back its input's sharding)."""
    if cotangent is None or explicit_mesh([primal, cotangent]) is None:
        return cotangent
    want = jax.typeof(primal).sharding
    if jax.typeof(cotangent).sharding.spec == want.spec:
        return cotangent
    return jax.sharding.reshard(cotangent, want)
