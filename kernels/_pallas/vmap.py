"""Kernels under `jax.vmap` where Pallas cannot batch them itself: operands left in HBM
(`mapped_under_vmap`), and TPU interpret mode (`vmappable_tpu_interpret`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.experimental.pallas import tpu as pltpu

__all__ = ["mapped_under_vmap", "reset_tpu_interpret_state", "vmappable_tpu_interpret"]


def mapped_under_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(*arrays)` with a vmap rule that maps it over the batch with `lax.map`.

    Pallas cannot add a batch dim to a kernel whose operands stay in HBM (`memory_space=ANY`):
    under `vmap` the kernel runs once per batch element instead. Unbatched operands (a shared
    table) are closed over, not broadcast.
    """
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size

        def one(batched_slices):
            slices = iter(batched_slices)
            pairs = zip(args, in_batched, strict=True)
            return wrapped(*[next(slices) if batched else a for a, batched in pairs])

        return lax.map(one, [a for a, b in zip(args, in_batched, strict=True) if b]), True

    return wrapped


def vmappable_tpu_interpret(build: Callable[[tuple[str, ...]], Callable[..., Any]],
                             semantics: tuple[str, ...]) -> Callable[..., Any]:
    """A TPU-interpreted pallas_call, `build(semantics)`, that survives `jax.vmap`.

    Pallas batches a kernel by adding a leading grid dim. Mosaic lowering knows to skip it when
    it reads `dimension_semantics`; TPU interpret mode does not and fails on the length
    mismatch. So each vmap level rebuilds the call with one more "parallel" semantic.
    """

    @jax.custom_batching.custom_vmap
    def call(*args):
        return build(semantics)(*args)

    @call.def_vmap
    def _batched(axis_size, in_batched, *args):
        del axis_size
        in_axes = tuple(0 if batched else None for batched in in_batched)
        batched_call = vmappable_tpu_interpret(
            lambda inner: jax.vmap(build(inner), in_axes=in_axes), ("parallel", *semantics))
        out = batched_call(*args)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return call


def reset_tpu_interpret_state() -> None:
    """Clears TPU interpret mode's simulated memory after a kernel raised inside it."""
    pltpu.reset_tpu_interpret_mode_state()
