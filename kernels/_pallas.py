"""The one module that imports Pallas backend modules: every kernel call is made here
(`triton_call`, `mosaic_call`, Triton's tile loads and stores), and every lowering for a
platform this machine lacks (`on_target`, `lower`, `lowered_text`).

Everything that differs between the supported jax versions (0.10.2 on Python 3.11, the newest on
Python 3.12+) is hidden here, so a version difference is fixed in one place: compiler-parameter
classes, Triton's masked load/store, TPU interpret parameters, and the abstract device that lets
jax 0.11+ lower a kernel for a platform this machine does not have. What a Mosaic kernel's
pipeline moves is worked out in `kernels._traffic`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.state import indexing as state_indexing
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from kernels import _targets
from kernels._traffic import pipelined_bytes

__all__ = ["pl", "pltpu", "triton_load", "triton_store", "triton_call", "mosaic_call",
           "mosaic_precision", "mapped_under_vmap", "vmem_limit", "varying_axes",
           "reset_tpu_interpret_state", "TRITON_CALL_MARKER", "MOSAIC_CALL_MARKER", "on_target",
           "lower", "lowered_text"]

TRITON_CALL_MARKER = "__gpu$xla.gpu.triton"
MOSAIC_CALL_MARKER = "tpu_custom_call"


# How the Triton kernel being traced reaches its tiles (set by `triton_call` around the trace):
# "pointers" compiled (as written), else interpreted as "slices" (a kernel with so few
# programs that its tiles are best read and written as slices) or "index_arrays".
_TILE_ACCESS: contextvars.ContextVar[str] = contextvars.ContextVar("tile_access",
                                                                  default="pointers")
# Up to this many tile visits (programs times the tiles each walks) an interpreted kernel
# accesses its tiles as slices.
_SLICED_VISITS = 4


def _tile_access(interpret: bool | str, tile_visits: int) -> str:
    if not interpret:
        return "pointers"
    return "slices" if tile_visits <= _SLICED_VISITS else "index_arrays"


def _tile_indexer(ref: Any) -> Any:
    """The one `NDIndexer` that `ref.at[...]` applied to its array, else None."""
    if not isinstance(ref, state_types.TransformedRef) or len(ref.transforms) != 1:
        return None
    (indexer,) = ref.transforms
    return indexer if isinstance(indexer, state_indexing.NDIndexer) else None


def _as_index_arrays(ref: Any) -> Any:
    """`ref.at[...]` of slices (and scalars) as the same tile indexed by int arrays.

    A Triton kernel computes the same pointers either way (start + iota per dim), and the
    compilers see the same contiguity; but Pallas' interpreter pads and unpads the whole array
    around every sliced store (and pads for every sliced load) so a slice may pass the edge,
    which makes each interpreted program cost O(array), while index arrays become a gather or
    scatter of the tile (out-of-bounds lanes are masked, and a scatter drops them anyway), at
    several times the cost of a copy per element. So an interpreted kernel that visits only a
    few tiles in all (the fast interpreter's schedule, `_targets.INTERPRETER`, at its best:
    one program over whole arrays) keeps its slices: O(array) a few times, at a copy's speed.
    """
    indexer = _tile_indexer(ref)
    if _TILE_ACCESS.get() != "index_arrays" or indexer is None or any(
            not isinstance(i, state_indexing.Slice) and jnp.ndim(i) for i in indexer.indices):
        return ref
    slices = [i for i in indexer.indices if isinstance(i, state_indexing.Slice)]
    indices, dim = [], 0
    for index in indexer.indices:
        if isinstance(index, state_indexing.Slice):
            shape = [1] * len(slices)
            shape[dim] = index.size
            positions = index.start + index.stride * jnp.arange(index.size, dtype=jnp.int32)
            indices.append(positions.reshape(shape))
            dim += 1
        else:
            indices.append(index)
    return ref.ref.at[tuple(indices)]


def _masked_lanes_dropped(ref: Any, mask: jax.Array) -> Any:
    """An interpreted store's `ref.at[int arrays]` with each masked-off lane's first index
    moved past the array's end, where the interpreter's scatter drops it: the same writes as
    the mask, without the gather of the old values and the select that a masked store
    interprets as. None where `ref` is not indexed by int arrays on every dim."""
    indexer = _tile_indexer(ref)
    if indexer is None or any(isinstance(i, state_indexing.Slice) for i in indexer.indices):
        return None
    first, *rest = indexer.indices
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in indexer.indices), jnp.shape(mask))
    first = jnp.where(mask, jnp.broadcast_to(first, shape), ref.ref.shape[0])
    return ref.ref.at[(first, *rest)]


def triton_load(ref: Any, **kwargs: Any) -> jax.Array:
    """`plt.load` of a tile (see `_as_index_arrays`)."""
    return plt.load(_as_index_arrays(ref), **kwargs)


def triton_store(ref: Any, value: jax.Array, *, mask: jax.Array | None = None) -> None:
    """`plt.store` of a tile (see `_as_index_arrays` and `_masked_lanes_dropped`), converted
    to the ref's dtype as Triton's store converts to the pointer's element type."""
    ref, value = _as_index_arrays(ref), value.astype(ref.dtype)
    if mask is not None and _TILE_ACCESS.get() == "index_arrays":
        dropping = _masked_lanes_dropped(ref, mask)
        if dropping is not None:
            ref, mask = dropping, None
    plt.store(ref, value, mask=mask)


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
        access = _TILE_ACCESS.set(_tile_access(interpret, math.prod(grid) * steps_per_program))
        try:
            outs = pl.pallas_call(
                kernel,
                out_shape=jax.tree.map(_widened, shapes) if widen else shapes,
                grid=grid,
                **specs,
                compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                interpret=bool(interpret),
                cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals,
                                              bytes_accessed=bytes_accessed),
                name=name,
            )(*args)
        finally:
            _TILE_ACCESS.reset(access)
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
        return _vmappable_tpu_interpret(build, semantics)
    return build(semantics)


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


def _vmappable_tpu_interpret(build: Callable[[tuple[str, ...]], Callable[..., Any]],
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
        batched_call = _vmappable_tpu_interpret(
            lambda inner: jax.vmap(build(inner), in_axes=in_axes), ("parallel", *semantics))
        out = batched_call(*args)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return call


def reset_tpu_interpret_state() -> None:
    """Clears TPU interpret mode's simulated memory after a kernel raised inside it."""
    pltpu.reset_tpu_interpret_mode_state()


_PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}


@contextlib.contextmanager
def on_target(target: _targets.Target) -> Iterator[None]:
    """Puts `target`'s abstract device in scope: jax 0.11+ needs one to lower a kernel for a
    device this machine does not have, and the kernels pick their blocks for it."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=_targets.abstract_device(target))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        # jax 0.11+ warns that Triton lowering is deprecated in favour of Mosaic GPU; this
        # library uses Triton on purpose, so the warning says nothing to its users.
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def lower(fn: Callable[..., Any], *args: Any, target: _targets.Target) -> Any:
    """`jax.jit(fn)` lowered for `target` on any machine (`jax.stages.Lowered`).

    Kernels called with `interpret=None` or `False` inside `fn` lower compiled (the dispatch
    decides `None` for the platform lowered for). For a TPU target, `args` must
    carry a sharding on a device of that target's topology if the result is to be compiled.
    """
    with on_target(target):
        traced = jax.jit(fn).trace(*args)
        platform = "cuda" if target.platform == "gpu" else "tpu"
        return traced.lower(lowering_platforms=(platform,))


def lowered_text(fn: Callable[..., Any], *args: Any, platform: str) -> str:
    """Lowers `jax.jit(fn)(*args)` for `platform` ("cuda" or "tpu") on any machine.

    Kernels called with `interpret=None` or `False` inside `fn` lower compiled. Returns the
    StableHLO text, in
    which a Triton kernel appears as `TRITON_CALL_MARKER` and a Mosaic one as
    `MOSAIC_CALL_MARKER`.
    """
    if platform not in _PLATFORMS:
        raise ValueError(f"platform must be 'cuda' or 'tpu', got {platform!r}")
    return lower(fn, *args, target=_targets.DEFAULT[_PLATFORMS[platform]]).as_text()
