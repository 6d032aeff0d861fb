"""Every op over a mesh: each device runs the kernel on its own shard. One mechanism, all ops.

What an op provides
-------------------
An op wraps each function its `custom_vjp` calls (forward and backward kernels) with
`partitioned(fn, rule, factors)`. `fn(*operands, static)` is the kernel on whole arrays
(operands may be None). The op's rule (in its folder, `<op>/sharding.py`) maps a `Layout` (the
operands' shapes and, per dim, the mesh axes it is sharded over) to a `Plan`:

- `in_dims`: the sharding each operand must have. A rule keeps an operand's sharding wherever
  the maths allows and drops an axis only where the kernel needs that dim whole (XLA then
  all-gathers it: a conv's spatial dims, say), or where two operands disagree.
- `out_dims`: the outputs' shardings.
- `local`: what one device runs on its blocks: the kernel, then the collectives that turn
  per-shard partials into the result (`reduce`: psum, or psum_scatter when the output is
  wanted sharded; Chan's merge of moments; a vocab-parallel gather's sum over owners).
`factors` names the op's dims for Shardy's propagation, einsum style ("m k, k n -> m n"), so
that XLA carries shardings through the op to what consumes it.

How a plan is applied
---------------------
Which of three paths runs depends on what is known while tracing:

- Explicit mesh axes: the sharding is part of each operand's type, so the plan is built at
  trace time and run as `jax.shard_map(plan.local)` over operands resharded to `in_dims`.
- Auto mesh axes (shardings are decided by XLA's partitioner after tracing), on more than one
  device: `custom_partitioning`, whose partition callback builds the same plan from the
  shardings the partitioner proposes and returns `plan.local` as the per-device lowering.
- Inside the caller's `shard_map` (operands are already per-device blocks): the kernel runs as
  is. The public ops first mark all operands varying over the same manual axes
  (`match_varying`), so that the gradient of a replicated operand is summed over devices by
  JAX's own transpose rule, as for any jnp op.

`out_sharding=` (every op takes it, as JAX's own ops do) is a type on Explicit axes only: JAX
refuses Auto and Manual axes in it, and applies none elsewhere. There an op passes the mesh axes
it asks of each output dim to its rule through the static (`requested`, the same field the Auto
path fills from XLA's wish for the result), so a rule that sums partials over a sharded
contraction reduce-scatters into that sharding instead of all-reducing (`reduction`); whatever
a rule cannot give (a replicated operand asked sharded, say) is resharded after it
(`constrain`).

Which path runs is decided from the program's mesh as tracing sees it (the mesh in scope, or
the one jit records in its operands' types), never from the devices this process has: a CPU
host compiling for 8 GPUs has one. On one device, and under `vmap` (custom_partitioning has no
batching rule), the kernel runs unpartitioned, except on a mesh of Explicit axes, even of one
device: there the operands' types name mesh axes, which Pallas refuses, so it runs in
shard_map. XLA's TPU compiler cannot partition a
custom_partitioning call (jax-ml/jax#38196): the dispatch declines a compiled Mosaic kernel on
Auto axes (`check_partitionable`), so the default falls back to `xla` there, and Explicit axes
or shard_map run the kernels per shard. Under Auto axes a Mosaic kernel asked to run in TPU
interpret mode ("strict") runs in the HLO interpreter instead: XLA's partitioner cannot lower
the simulator's ordered host callbacks. Under Explicit axes and shard_map the simulator runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax._src.sharding_impls import canonicalize_sharding  # JAX's ops' own out_sharding check
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from kernels import _pallas, _targets, registry

__all__ = ["Layout", "Plan", "partitioned", "match_varying", "Reduction", "reduction", "spec",
           "dims_of", "sharding", "reshape", "like", "strategy", "check_partitionable",
           "out_sharding", "requested", "merged", "mergeable", "split", "axis_sizes",
           "constrain"]

Axes = tuple[str, ...]  # the mesh axes one dim is sharded over, major first
Dims = tuple[Axes, ...]  # per dim of one array


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a rule sees: per operand its shape and `Dims` (None for an absent operand), the
    mesh's axis sizes, and (Auto meshes only) the `Dims` XLA would like each output to have."""

    shapes: tuple[tuple[int, ...] | None, ...]
    dims: tuple[Dims | None, ...]
    axis_sizes: Mapping[str, int]
    requested: tuple[Dims | None, ...] | None = None

    def size(self, axes: Axes) -> int:
        return math.prod(self.axis_sizes[a] for a in axes)

    def fit(self, length: int, axes: Axes, used: set[str] | None = None) -> Axes:
        """The longest prefix of `axes` (skipping axes in `used`) that evenly divides a dim of
        `length`: a shard_map block must be whole, and a padded shard would add garbage into
        a sum."""
        kept: list[str] = []
        for axis in axes:
            if used is not None and axis in used:
                continue
            if length % self.size((*kept, axis)):
                break
            kept.append(axis)
        if used is not None:
            used.update(kept)
        return tuple(kept)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs over the mesh: operand and output shardings, and the per-device
    function (kernel + collectives) on blocks."""

    in_dims: tuple[Dims | None, ...]
    out_dims: Dims | tuple[Dims | None, ...]  # a tuple per output (None: absent) if multiple
    local: Callable[..., Any]
    multiple: bool = False


Rule = Callable[[Callable[..., Any], Any, Layout], Plan]
Factors = Callable[[Any, tuple[tuple[int, ...] | None, ...]], str]


def spec(dims: Dims) -> PartitionSpec:
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes
                           for axes in dims))


def _dims(sharding: Any, ndim: int) -> Dims:
    if not isinstance(sharding, NamedSharding):
        return ((),) * ndim
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in entries[:ndim])


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How per-shard partial sums become the result: a reduce-scatter over `scatter` along
    output dim `dim` (when XLA wants the output sharded by those axes), then an all-reduce over
    the rest."""

    all_reduce: Axes
    scatter: Axes = ()
    dim: int = 0

    def __call__(self, partial: jax.Array) -> jax.Array:
        if self.scatter:
            partial = lax.psum_scatter(partial, self.scatter, scatter_dimension=self.dim,
                                       tiled=True)
        return lax.psum(partial, self.all_reduce) if self.all_reduce else partial


def reduction(axes: Axes, out_shape: Sequence[int], out_dims: list[Axes], layout: Layout,
              output: int = 0) -> Reduction:
    """The `Reduction` of partials summed over mesh `axes` into an output of `out_shape` (None
    for a dim that may not be scattered); records a scattered dim in `out_dims`."""
    requested = layout.requested[output] if layout.requested else None
    for d, wanted in enumerate(requested or ()):
        scatter = tuple(a for a in wanted if a in axes)
        if (scatter and not out_dims[d] and out_shape[d] is not None
                and out_shape[d] % layout.size(scatter) == 0):
            out_dims[d] = scatter
            return Reduction(tuple(a for a in axes if a not in scatter), scatter, d)
    return Reduction(tuple(axes))


def match_varying(*operands: Any) -> tuple[Any, ...]:
    """Inside `shard_map`: every operand varying over the union of the operands' manual axes
    (a no-op elsewhere). A kernel's outputs vary like its inputs, and `custom_vjp` needs each
    cotangent typed like its primal; JAX transposes the cast to a psum over devices."""
    varying = _pallas.varying_axes(*(x for x in operands if x is not None))

    def cast(x):
        missing = varying - _pallas.varying_axes(x)
        return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return tuple(None if x is None else cast(x) for x in operands)


def _with_present(present: tuple[bool, ...], arrays: Sequence[Any]) -> list[Any]:
    arrays = iter(arrays)
    return [next(arrays) if p else None for p in present]


def _map_outputs(plan: Plan, make: Callable[[Dims], Any]) -> Any:
    if plan.multiple:
        return tuple(None if d is None else make(d) for d in plan.out_dims)
    return make(plan.out_dims)


def _explicit_mesh(operands: Sequence[Any]) -> Any:
    """The mesh with Explicit axes some operand lives on, if any (sharded or replicated: its
    type says how, so shard_map can run the plan)."""
    for mesh in map(_targets.mesh_of, operands):
        if mesh is not None and not mesh.empty and any(
                t == AxisType.Explicit for t in mesh.axis_types):
            return mesh
    return None


def _in_manual_context(operands: Sequence[Any]) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and any(t == AxisType.Manual for t in mesh.axis_types):
        return True
    return bool(_pallas.varying_axes(*operands))


def _program_mesh(operands: Sequence[Any]) -> Any:
    """The mesh of more than one device that the program runs on, as the mesh in scope or the
    operands' types show it (jit records its arguments' mesh, devices compile-only or not, in
    every value it traces), or None for a one-device program. Never the devices this process
    has: a CPU host compiling for 8 GPUs sees one device."""
    for mesh in (jax.sharding.get_abstract_mesh(), *map(_targets.mesh_of, operands)):
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return mesh
    return None


def strategy(operands: Sequence[Any]) -> tuple[str, Any]:
    """How a kernel call on `operands` runs: ("manual", None) inside shard_map, ("explicit",
    mesh) on Explicit axes, ("auto", mesh) on a mesh of Auto axes, ("whole", None) on one
    device (see the module docstring)."""
    if _in_manual_context(operands):
        return "manual", None
    mesh = _explicit_mesh(operands)
    if mesh is not None:  # one device too: Pallas takes no operand typed sharded
        return "explicit", mesh
    mesh = _program_mesh(operands)
    return ("whole", None) if mesh is None else ("auto", mesh)


def check_partitionable(implementation: str, interpret: bool | str,
                        operands: Sequence[Any]) -> None:
    """Raises `NotImplementedError` where a compiled Mosaic kernel would meet Auto mesh axes:
    XLA's TPU compiler has no emitter for custom_partitioning (jax-ml/jax#38196), and Mosaic
    refuses to be lowered unpartitioned into a sharded program. The dispatch then falls back
    to the next implementation (`xla` by default), or names the way that works."""
    if registry.get(implementation).auto_axes or interpret or strategy(operands)[0] != "auto":
        return
    raise NotImplementedError(
        "Mosaic kernels cannot run on a TPU mesh with Auto axes (XLA's TPU compiler cannot "
        "partition them: jax-ml/jax#38196); shard the operands over Explicit axes "
        "(jax.sharding.AxisType.Explicit) or call the op inside jax.shard_map")


def partitioned(fn: Callable[..., Any], rule: Rule, factors: Factors) -> Callable[..., Any]:
    """`fn(*operands, static)`, run per shard on whatever mesh its operands live on. `static`
    is hashable: the op's NamedTuple of options, with `interpret` (the dispatch's mode) and
    `config` fields, or a tuple holding one. Forward and backward kernels alike are traced with
    their target in scope: the device kind of their operands' mesh (`_targets.for_operands`),
    or the fast interpreter where they run there on blocks of their choosing
    (`_targets.interpreted`). The dispatch's scope does not reach a custom_vjp's backward,
    which is traced after the forward's call has returned."""
    return _Partitioned(fn, rule, factors)


class _Partitioned:
    """`partitioned(fn, rule, factors)`: one method per way to run `fn` over a mesh
    (`strategy`): whole, manual (inside shard_map), explicit (shard_map over the plan's
    shardings) and auto (custom_partitioning, whose callbacks are the methods below it)."""

    def __init__(self, fn: Callable[..., Any], rule: Rule, factors: Factors):
        self.fn, self.rule, self.factors = fn, rule, factors
        self.auto = custom_partitioning(self._whole, static_argnums=(0, 1))
        self.auto.def_partition(partition=self._partition,
                                infer_sharding_from_operands=self._infer,
                                sharding_rule=self._sharding_rule)

    def __call__(self, *args):
        *operands, static = args
        present = tuple(x is not None for x in operands)
        arrays = [x for x in operands if x is not None]
        how, mesh = strategy(arrays)
        if how == "whole":
            return self.on_target(*operands, static)
        if how == "manual":
            return self.on_target(*_with_present(present, match_varying(*arrays)), static)
        if how == "explicit":
            return self._run_explicit(mesh, present, static, operands)
        return self._run_auto(present, static, arrays)

    def on_target(self, *args):
        """`fn(*args)` traced with its operands' target (or the interpreter's) in scope."""
        *operands, static = args
        with _targets.for_operands([x for x in operands if x is not None]), \
                _targets.interpreted(_interpreter_sized(static)):
            return self.fn(*args)

    def _run_explicit(self, mesh, present, static, operands):
        shapes = tuple(None if x is None else tuple(x.shape) for x in operands)
        dims = tuple(None if x is None else _dims(jax.typeof(x).sharding, x.ndim)
                     for x in operands)
        axis_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        plan = self.rule(self.on_target, static,
                         Layout(shapes, dims, axis_sizes, _requested_of(static)))
        arrays = [jax.sharding.reshard(x, NamedSharding(mesh, spec(d)))
                  for x, d in zip(operands, plan.in_dims)
                  if x is not None]
        in_specs = tuple(spec(d) for x, d in zip(operands, plan.in_dims) if x is not None)
        local = plan.local
        if not plan.multiple:
            body = lambda *blocks: local(*_with_present(present, blocks))  # noqa: E731
            return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                 out_specs=spec(plan.out_dims), check_vma=False)(*arrays)
        # shard_map outputs are arrays: absent (None) outputs are dropped, then restored.
        kept = [d is not None for d in plan.out_dims]
        body = lambda *blocks: tuple(  # noqa: E731
            y for y in local(*_with_present(present, blocks)) if y is not None)
        out_specs = tuple(spec(d) for d in plan.out_dims if d is not None)
        outs = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*arrays)
        return tuple(_with_present(tuple(kept), outs))

    def _run_auto(self, present, static, arrays):
        # custom_partitioning has no batching rule of its own: under vmap, run whole.
        @jax.custom_batching.custom_vmap
        def call(*arrays):
            return self.auto(present, static, *arrays)

        @call.def_vmap
        def _batched(axis_size, in_batched, *arrays):
            in_axes = tuple(0 if b else None for b in in_batched)
            out = jax.vmap(lambda *a: self._whole(present, static, *a), in_axes=in_axes)(*arrays)
            return out, jax.tree_util.tree_map(lambda _: True, out)

        return call(*arrays)

    # custom_partitioning's callbacks (Auto axes).

    def _whole(self, present, static, *arrays):
        return self.on_target(*_with_present(present, arrays), static)

    def _partition(self, present, static, mesh, arg_shapes, result_shape):
        layout = _auto_layout(present, arg_shapes, result_shape, mesh)
        plan = self.rule(self.on_target, _without_simulator(static), layout)
        shardings = tuple(NamedSharding(mesh, spec(d)) for d in plan.in_dims if d is not None)
        out = _map_outputs(plan, lambda d: NamedSharding(mesh, spec(d)))

        def lower(*blocks):
            return plan.local(*_with_present(present, blocks))

        return mesh, lower, out, shardings

    def _infer(self, present, static, mesh, arg_shapes, result_shape):
        plan = self.rule(self.on_target, static,
                         _auto_layout(present, arg_shapes, result_shape, mesh))
        return _map_outputs(plan, lambda d: NamedSharding(mesh, spec(d)))

    def _sharding_rule(self, present, static, mesh, value_types, result_types):
        shapes = _with_present(present, [tuple(t.shape) for t in value_types])
        return self.factors(static, tuple(shapes))


def _interpreter_sized(static: Any) -> bool:
    """`_targets.interpreter_sized` of `static`: an op's NamedTuple with `interpret` and
    `config` fields, or a tuple holding one."""
    if hasattr(static, "interpret"):
        return _targets.interpreter_sized(static.interpret, static.config)
    return type(static) is tuple and any(map(_interpreter_sized, static))


def _requested_of(static: Any) -> tuple[Dims | None, ...] | None:
    """The output dims an op asks of a launch on Explicit axes (its static's `requested`: one
    entry per output, from `out_sharding`), or None."""
    return getattr(static, "requested", None)


def _without_simulator(static: Any) -> Any:
    """`static` with "strict" given way to the HLO interpreter: XLA's partitioner cannot lower
    TPU interpret mode's ordered host callbacks (the same kernel code runs, without the memory
    checks)."""
    if hasattr(static, "_replace") and getattr(static, "interpret", None) == "strict":
        return static._replace(interpret=True)
    if type(static) is tuple:
        return tuple(map(_without_simulator, static))
    return static


def _auto_layout(present, arg_shapes, result_shape, mesh) -> Layout:
    shapes = _with_present(present, [tuple(a.shape) for a in arg_shapes])
    shardings = _with_present(present, [a.sharding for a in arg_shapes])
    dims = tuple(None if shape is None else _dims(s, len(shape))
                 for shape, s in zip(shapes, shardings))
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    requested = tuple(None if r is None else _dims(getattr(r, "sharding", None), len(r.shape))
                      for r in results)
    return Layout(tuple(shapes), dims, dict(zip(mesh.axis_names, mesh.axis_sizes)), requested)


def sharding(dims: Sequence[Axes], *operands: Any) -> NamedSharding | None:
    """The sharding `dims` says on the Explicit mesh `operands` live on, or None where they
    live on none (JAX infers or propagates the sharding there)."""
    mesh = _explicit_mesh(operands)
    return None if mesh is None else NamedSharding(mesh, spec(tuple(dims)))


def reshape(x: jax.Array, shape: Sequence[int], dims: Sequence[Axes]) -> jax.Array:
    """`x.reshape(shape)`, whose result on an Explicit mesh is sharded as `dims` says: JAX
    cannot infer the sharding of a reshape that splits a sharded dim."""
    out_sharding = sharding(dims, x)
    if out_sharding is None:
        return x.reshape(shape)
    return lax.reshape(x, tuple(shape), out_sharding=out_sharding)


def dims_of(x: jax.Array) -> Dims:
    """The mesh axes each dim of `x` is sharded over, where its type says (Explicit axes)."""
    if _explicit_mesh([x]) is None:
        return ((),) * x.ndim
    return _dims(jax.typeof(x).sharding, x.ndim)


def like(cotangent: Any, primal: jax.Array) -> Any:
    """`cotangent` with `primal`'s sharding where that is part of the type (Explicit axes):
    a custom_vjp's cotangent must be typed like its primal."""
    if cotangent is None or _explicit_mesh([primal, cotangent]) is None:
        return cotangent
    want = jax.typeof(primal).sharding
    if jax.typeof(cotangent).sharding.spec == want.spec:
        return cotangent
    return jax.sharding.reshard(cotangent, want)


def out_sharding(value: Any, op: str, ndim: int) -> NamedSharding | None:
    """`out_sharding=` of an op whose output has `ndim` dims, checked as JAX's own ops check it
    (a NamedSharding, or a PartitionSpec under `jax.set_mesh`; Explicit axes only), before
    anything is traced. Returns it as a NamedSharding, or None."""
    sharding = canonicalize_sharding(value, op)
    if sharding is not None and len(sharding.spec) > ndim:
        raise ValueError(f"{op}: out_sharding {sharding.spec} has more entries than the "
                         f"output's {ndim} dims")
    return sharding


def requested(sharding: NamedSharding | None, ndim: int) -> Dims | None:
    """The mesh axes `sharding` (an op's `out_sharding`) asks of each of `ndim` output dims
    where it is a type (some axis Explicit), else None: JAX applies none on Auto axes."""
    if sharding is None or not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return _dims(sharding, ndim)


def merged(shape: Sequence[int], dims: Sequence[Axes]) -> Axes:
    """The axes of dims of `shape` (sharded as `dims`) reshaped into one, where each device
    then holds one contiguous block of it: those of the first dim longer than 1, when no later
    dim is sharded; else () (no such block; the op reshards afterwards). `split` undoes it."""
    longer = [d for d, size in enumerate(shape) if size > 1]
    if not longer or not mergeable(shape, dims):
        return ()
    return tuple(dims[longer[0]])


def mergeable(shape: Sequence[int], dims: Sequence[Axes]) -> bool:
    """Whether dims of `shape` sharded as `dims` reshape into one with each device's part one
    contiguous block, as `merged` takes it: no dim after the first longer than 1 is sharded."""
    longer = [d for d, size in enumerate(shape) if size > 1]
    return not any(dims[d] for d in longer[1:])


def split(axes: Axes, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> Dims:
    """Per dim of `shape`, the axes of one dim reshaped into `shape`, major first: each dim
    takes the next axes while it divides into them, so a dim split to one element a device
    passes the rest on (JAX merges (2, 8) sharded ("data", "model") on a (2, 4) mesh into
    ("data", "model"); `merged`'s one sharded dim comes back on that dim)."""
    rest, dims = list(axes), []
    for size in shape:
        taken: list[str] = []
        while rest and size % math.prod(axis_sizes[a] for a in (*taken, rest[0])) == 0:
            taken.append(rest.pop(0))
        dims.append(tuple(taken))
    return tuple(dims) if not rest else (tuple(axes),) + ((),) * (len(shape) - 1)


def axis_sizes(x: jax.Array) -> dict[str, int]:
    """The axis sizes of the Explicit mesh `x` lives on ({} on none)."""
    mesh = _explicit_mesh([x])
    return {} if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes))


def constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """`x` with the `out_sharding` its op was asked for, where that is a type (Explicit axes)
    and the rule did not already give it: a reshard, XLA's cheapest collective for it."""
    dims = requested(sharding, x.ndim)
    if dims is None or dims_of(x) == dims:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec(dims)))
