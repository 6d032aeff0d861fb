"""How a plan is applied (the package's docstring has the three paths): `partitioned` wraps an
op's kernel so each device runs it on its shard, on Explicit axes through `shard_map`, on Auto
axes through `custom_partitioning`, inside a caller's `shard_map` as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding

from kernels import _pallas, _targets, registry
from kernels.partition.rules import Dims, Factors, Layout, Plan, Rule, dims_of_sharding, spec
from kernels.partition.shardings import explicit_mesh

__all__ = ["match_varying", "strategy", "check_partitionable", "partitioned"]


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
    mesh = explicit_mesh(operands)
    if mesh is not None:  # one device too: Pallas takes no operand typed sharded
        return "explicit", mesh
    mesh = _program_mesh(operands)
    return ("whole", None) if mesh is None else ("auto", mesh)


def check_partitionable(implementation: str, interpret: bool | str,
                        operands: Sequence[Any]) -> None:
    """Raises `NotImplementedError` where a kernel cannot run on its operands' mesh: a
    compiled Mosaic kernel on Auto axes (XLA's TPU compiler has no emitter for
    custom_partitioning, jax-ml/jax#38196, and Mosaic refuses to be lowered unpartitioned into
    a sharded program), and an interpreter that runs only through host callbacks (Mosaic
    GPU's) on several devices: XLA's partitioner cannot place its ordered callbacks (TPU
    interpret mode gives way to the HLO interpreter there, `_without_simulator`), and under
    shard_map its simulated GPU state, one per process, fails when the devices' kernels
    interleave (8 CPU devices, jax 0.12.0.1: "Barrier remains allocated"). The dispatch then
    falls back to the next implementation (`xla` by default), or names the way that works."""
    how, mesh = strategy(operands)
    entry = registry.get(implementation)
    if interpret and True in entry.interpreter_callbacks and how != "whole":
        devices = (mesh or jax.sharding.get_abstract_mesh()).size
        if devices > 1:
            raise NotImplementedError(
                f"{implementation}'s interpreter cannot run on a mesh of {devices} devices "
                "(it runs through host callbacks, on one simulated GPU per process): run the op "
                "on one device, or compile it for its GPUs, where it partitions")
    if how != "auto" or entry.auto_axes or interpret:
        return
    raise NotImplementedError(
        "Mosaic kernels cannot run on a TPU mesh with Auto axes (XLA's TPU compiler cannot "
        "partition them: jax-ml/jax#38196); shard the operands over Explicit axes "
        "(jax.sharding.AxisType.Explicit) or call the op inside jax.shard_map")


def partitioned(fn: Callable[..., Any], rule: Rule, factors: Factors) -> Callable[..., Any]:
    """`fn(*operands, static)`, run per shard on whatever mesh its operands live on. `static`
    is hashable: the op's NamedTuple of options, with `interpret` (the dispatch's mode) and
    `config` fields (and the `device` the op was called for), or a tuple holding one. Forward
    and backward kernels alike are traced with their target in scope: the device the op
    recorded (`_targets.program_device`), the device kind of their operands' mesh
    (`_targets.for_operands`) or of the mesh XLA's partitioner gives (Auto axes), or the fast
    interpreter where they run there on blocks of their choosing (`_targets.interpreted`). The
    dispatch's scope does not reach a custom_vjp's backward, which is traced after the
    forward's call has returned: hence the recorded device."""
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
        with _targets.for_device(_device_of(static)), \
                _targets.for_operands([x for x in operands if x is not None]), \
                _targets.interpreted(_interpreter_sized(static)):
            return self.fn(*args)

    def _run_explicit(self, mesh, present, static, operands):
        shapes = tuple(None if x is None else tuple(x.shape) for x in operands)
        dims = tuple(None if x is None else dims_of_sharding(jax.typeof(x).sharding, x.ndim)
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
        # The partitioner calls back outside the program's trace, and the shards' types name
        # no device: the mesh says which GPU or TPU the kernels are for.
        with _targets.for_device(_targets.mesh_device(mesh)):
            layout = _auto_layout(present, arg_shapes, result_shape, mesh)
            plan = self.rule(self.on_target, _without_simulator(static), layout)
        shardings = tuple(NamedSharding(mesh, spec(d)) for d in plan.in_dims if d is not None)
        out = _map_outputs(plan, lambda d: NamedSharding(mesh, spec(d)))

        def lower(*blocks):
            with _targets.for_device(_targets.mesh_device(mesh)):
                return plan.local(*_with_present(present, blocks))

        return mesh, lower, out, shardings

    def _infer(self, present, static, mesh, arg_shapes, result_shape):
        with _targets.for_device(_targets.mesh_device(mesh)):
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
        return (_targets.interpreter_sized(static.interpret, static.config)
                and registry.get(static.implementation).fast_interpreter)
    return type(static) is tuple and any(map(_interpreter_sized, static))


def _device_of(static: Any) -> Any:
    """The device an op's static options (or a tuple holding them) recorded for its program
    (`_targets.program_device`), or None."""
    if type(static) is tuple:
        return next((d for d in map(_device_of, static) if d is not None), None)
    return getattr(static, "device", None)


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
    dims = tuple(None if shape is None else dims_of_sharding(s, len(shape))
                 for shape, s in zip(shapes, shardings))
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    requested = tuple(None if r is None
                      else dims_of_sharding(getattr(r, "sharding", None), len(r.shape))
                      for r in results)
    return Layout(tuple(shapes), dims, dict(zip(mesh.axis_names, mesh.axis_sizes)), requested)
