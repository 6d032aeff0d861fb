"""Every kernel call: `triton_call` and `mosaic_call` build the `pl.pallas_call` (compiler
parameters, interpret modes, cost estimate, the manual axes of a call inside `shard_map`), with
Mosaic's precision and VMEM limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import _targets
from kernels._pallas.tiles import TILE_ACCESS, tile_access, triton_backend
from kernels._pallas.vmap import vmappable_tpu_interpret
from kernels._traffic import pipelined_bytes

__all__ = ["mosaic_call", "mosaic_precision", "triton_call", "varying_axes", "vmem_limit"]


def mosaic_precision(precision: Any) -> Any:
    """`precision` as Mosaic takes it: one precision for both operands, DEFAULT or HIGHEST.
    HIGH (three bfloat16 passes on a TPU) and a pair naming anything above DEFAULT become
    HIGHEST: more precise than asked, never less."""
    if precision is None:
        return None
    pair = tuple(precision) if isinstance(precision, (tuple, list)) else (precision, precision)
    canonical = {lax.Precision(p) for p in pair}
    return (lax.Precision.DEFAULT if canonical == {lax.Precision.DEFAULT}
            else lax.Precision.HIGHEST)


def vmem_limit(needed: int) -> int | None:
    """`vmem_limit_bytes` for a Mosaic kernel that plans `needed` bytes of VMEM a step: None
    (the compiler's default scope) when it fits, else the need plus a quarter for the
    compiler's temporaries, within the physical VMEM of the target the call runs on."""
    target = _targets.current("tpu")
    if needed <= target.scoped_vmem:
        return None
    return min(target.vmem, needed + needed // 4)


def _mosaic_interpret(interpret: bool | str) -> pltpu.InterpretParams | bool:
    if interpret != "strict":
        return interpret
    # An out-of-bounds read raises instead of being clamped, and memory a kernel reads before
    # writing is NaN, so a kernel that relies on either fails loudly here.
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


def varying_axes(*arrays: Any) -> frozenset[str]:
    """The manual mesh axes (inside `shard_map`) over which any of `arrays` varies."""
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying
                               for a in jax.tree_util.tree_leaves(arrays)))


def _varying_like(out_shape: Any, args: Sequence[Any]) -> Any:
    """`out_shape` with the manual axes its inputs vary over (inside `shard_map`): a kernel's
    output differs per device exactly where one of its inputs does."""
    mat = jax.sharding.ManualAxisType(varying=varying_axes(*args))
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    in_specs: Sequence[Any] | None = None,
    out_specs: Any = None,
    num_warps: int,
    num_stages: int,
    interpret: bool | str,
    flops: int = 0,
    transcendentals: int = 0,
    bytes_accessed: int = 0,
    name: str | None = None,
    steps_per_program: int = 1,
) -> Callable[..., Any]:
    """`pl.pallas_call` for a Triton kernel.

    Always passes Triton compiler params: without them Pallas (jax >= 0.9) routes a GPU kernel
    to Mosaic GPU. Its cost estimate states `flops`, `transcendentals` and `bytes_accessed`, the
    bytes the launch's loads and stores move (the convention `mosaic_call` shares, where the
    pipeline's bytes are counted for the kernel). `steps_per_program`: the tiles of an array one
    program walks in turn (its loop's trip count), which decides how an interpreted kernel
    accesses them (`_as_index_arrays`).
    """
    specs = {} if in_specs is None else {"in_specs": in_specs, "out_specs": out_specs}

    def call(*args):
        shapes = _varying_like(out_shape, args)
        widen = interpret and _NARROW_CARRIES_CONVERT
        access = TILE_ACCESS.set(tile_access(interpret, math.prod(grid) * steps_per_program))
        try:
            outs = pl.pallas_call(
                kernel,
                out_shape=jax.tree.map(_widened, shapes) if widen else shapes,
                grid=grid,
                **specs,
                compiler_params=triton_backend().CompilerParams(num_warps=num_warps,
                                                                num_stages=num_stages),
                interpret=bool(interpret),
                cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals,
                                              bytes_accessed=bytes_accessed),
                name=name,
            )(*args)
        finally:
            TILE_ACCESS.reset(access)
        return jax.tree.map(lambda out, shape: out.astype(shape.dtype), outs, shapes)

    return call


# Interpreted, a kernel's outputs are loop carries updated in place at every program, except
# that jax 0.10's CPU backend converts a bfloat16 carry to float32 and back around each
# update: a pass over the whole output per program (Triton layer norm of 4096x1024 bfloat16:
# 1.7 s against 40 ms on jax 0.12). There the interpreted kernel writes float32 outputs,
# converted once afterwards: every kernel stores each output element once (`triton_store`
# converts to the ref's dtype), so rounding once afterwards gives the same bits.
_NARROW_CARRIES_CONVERT = jax.__version_info__ < (0, 12)


def _widened(shape: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if jnp.dtype(shape.dtype) != jnp.dtype(jnp.bfloat16):  # float16 carries stay in place
        return shape
    return jax.ShapeDtypeStruct(shape.shape, jnp.float32, manual_axis_type=getattr(
        shape, "manual_axis_type", None))


def mosaic_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid_spec: Any,
    dimension_semantics: Sequence[str],
    interpret: bool | str,
    flops: int = 0,
    transcendentals: int = 0,
    unpipelined_bytes: int = 0,
    vmem_limit_bytes: int | None = None,
    name: str | None = None,
) -> Callable[..., Any]:
    """`pl.pallas_call` for a Mosaic (TPU) kernel; `interpret` is False (compiled), True (the
    HLO interpreter) or "strict" (TPU interpret mode).

    Its cost estimate states `flops`, `transcendentals` and the bytes the kernel moves: those
    of its BlockSpec pipeline (`pipelined_bytes`, re-reads included) plus `unpipelined_bytes`,
    the traffic of the DMAs the kernel issues itself.
    """

    def build(semantics: tuple[str, ...]) -> Callable[..., Any]:
        def call(*args):
            outs = _varying_like(out_shape, args)
            moved = pipelined_bytes(grid_spec, args,
                                    outs if isinstance(outs, (list, tuple)) else [outs])
            return pl.pallas_call(
                kernel,
                out_shape=outs,
                grid_spec=grid_spec,
                compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                     vmem_limit_bytes=vmem_limit_bytes),
                interpret=_mosaic_interpret(interpret),
                cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals,
                                              bytes_accessed=moved + unpipelined_bytes),
                name=name,
            )(*args)
        return call

    semantics = tuple(dimension_semantics)
    if interpret == "strict":
        return vmappable_tpu_interpret(build, semantics)
    return build(semantics)
