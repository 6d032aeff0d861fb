"""The kernels a function launches: its `pallas_call` equations, found by walking its jaxpr
(traced for a target, so kernels called with `interpret=False` appear as compiled launches).
Used by the compile checks, the bench's design figures and the tests' schedule assertions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from kernels._pallas import on_target
from kernels._targets import Target

__all__ = ["KERNEL_PRIMITIVES", "equations", "find_pallas_calls", "grid_of", "launches",
           "launch_key", "pallas_calls",
           "distinct", "operands", "bind"]


def _sub_jaxprs(value: Any):
    values = value if isinstance(value, (tuple, list)) else [value]
    for v in values:
        if isinstance(v, jax_core.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jax_core.Jaxpr):
            yield v


# The primitives a kernel launch is: `pallas_call` (Triton, Mosaic), and `mpmd_map`, which
# Mosaic GPU's `plgpu.kernel` binds.
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it, in order, without looking
    inside a kernel launch (a kernel's body is not the program's)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from equations(sub)


def find_pallas_calls(jaxpr) -> list:
    """The kernel launches (`KERNEL_PRIMITIVES` equations) of `jaxpr` and of every jaxpr
    nested in it, in order."""
    return [eqn for eqn in equations(jaxpr) if eqn.primitive.name in KERNEL_PRIMITIVES]


def grid_of(eqn) -> tuple[int, ...]:
    """A launch's grid: its programs (Triton), grid steps (Mosaic) or CTAs (Mosaic GPU)."""
    if eqn.primitive.name == "mpmd_map":
        return tuple(eqn.params["meshes"][0].grid)
    return tuple(eqn.params["grid_mapping"].grid)


def _body(eqn) -> str:
    return str(eqn.params["jaxprs"][0] if eqn.primitive.name == "mpmd_map"
               else eqn.params["jaxpr"])


def operands(eqn) -> str:
    """A launch's operand shapes, which tell its launches apart: "float32[8, 128], ..."."""
    return ", ".join(f"{jnp.dtype(v.aval.dtype).name}{list(v.aval.shape)}" for v in eqn.invars)


def launches(fn: Callable[..., Any], *args: Any, target: Target) -> list:
    """Every `pallas_call` equation that `fn(*args)` runs when traced for `target` (kernels
    called with `interpret=False`), in order: a kernel launched twice appears twice."""
    with on_target(target):
        jaxpr = jax.make_jaxpr(fn)(*args)
    return find_pallas_calls(jaxpr.jaxpr)


def launch_key(eqn) -> tuple:
    """What makes two launches the same kernel: name, operands, grid and body."""
    return (eqn.params["name"], operands(eqn), grid_of(eqn), _body(eqn))


def pallas_calls(fn: Callable[..., Any], *args: Any, target: Target) -> list:
    """The distinct `launches` of `fn(*args)` for `target`, in order of appearance."""
    return distinct(launches(fn, *args, target=target))


def distinct(eqns: list) -> list:
    """`eqns` without repeats of the same kernel (`launch_key`), in order of appearance."""
    calls, seen = [], set()
    for eqn in eqns:
        key = launch_key(eqn)
        if key not in seen:
            seen.add(key)
            calls.append(eqn)
    return calls


def bind(eqn) -> Callable[..., Any]:
    """One launch as a function of its operands (to lower or compile it alone)."""
    return lambda *args: eqn.primitive.bind(*args, **eqn.params)
