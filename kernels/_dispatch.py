"""Which implementation runs an op, and whether its kernel is interpreted: decided here only.

Both are decided for the platform the program is lowered for, not for the devices of the
process that traces it: a program compiled on a CPU host for GPUs or TPUs (ahead of time, or
through `jax.export`) gets the kernels, not interpreted ones. `run` makes the choice for each
platform ("cuda", "rocm", "tpu", and every other platform as "cpu"); where the choices differ it
stages them with `jax.lax.platform_dependent`, whose lowering keeps only the branch of the
platform being lowered for. Where they agree (an explicit implementation with an explicit
`interpret`, say) the op is traced once, with no conditional.

`interpret` (docs/usage.md, "Testing on a CPU") is resolved here too, into what a kernel
receives: `False` (compiled), `True` (Pallas' HLO interpreter: the kernel's code as XLA ops, at
model speed) or `"strict"` (Mosaic kernels in TPU interpret mode, whose simulated memory makes
an out-of-bounds read raise and uninitialized memory NaN; Pallas has no stricter interpreter for
Triton kernels, which run in the HLO interpreter). The kernels get it as an argument. The fast
interpreter (`True`) runs each kernel on blocks sized for the interpreter
(`_targets.INTERPRETER`: few, large programs); "strict" runs the schedule of the device, as
compiled. (Mosaic GPU kernels have no fast interpreter: `True` and "strict" run Mosaic GPU's
interpreter on the device's blocks, "strict" with its race detector; the registry entry's
`fast_interpreter` and `interpreter_callbacks`.) The dispatch checks a kernel with its target
in scope, and declines one compiled for a device its entry's `runs_on` refuses;
`kernels.partition`, through which every kernel call goes, traces it so.

Each op passes the checks of its Pallas implementations. A check raises `NotImplementedError`
with a reason when its kernel cannot take the inputs (a dtype, a shape, an option); the next
implementation in the sequence is tried. A single explicit choice that declines raises that
reason, prefixed with the implementation's name.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax._src.core import ShardingTypeError as _ShardingTypeError  # not public in jax 0.10-0.12
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from kernels import _targets, defaults, partition, registry

ENV_VAR = "KERNELS_IMPLEMENTATION"
INTERPRET_ENV_VAR = "KERNELS_INTERPRET"
STRICT = "strict"
# Lowering platforms with a kernel of their own; any other platform is decided as "cpu".
LOWERING_PLATFORMS = ("cuda", "rocm", "tpu", "cpu")

Implementation = str | Sequence[str] | None
# What a caller passes (None, True, False, "strict"); a kernel receives it resolved (no None).
Interpret = bool | str | None


def _validated(names: Sequence[str], source: str) -> tuple[str, ...]:
    names, known = tuple(names), registry.names()
    if not names:
        raise ValueError(f"{source} must name at least one of {known}, got {names!r}")
    for name in names:
        if name not in known:
            raise ValueError(f"{source} must be one of {known} or a sequence of "
                             f"them, got {name!r}")
    return names


def implementations(implementation: Implementation, op: str = "", platform: str = "cpu",
                    dtype: Any = None, device_kind: str | None = None) -> tuple[str, ...]:
    """The sequence of implementations to try for `implementation=` of `op` in a program
    lowered for `platform` (see docs/design.md): `None` is `$KERNELS_IMPLEMENTATION` if set, else
    the op's entry in `kernels.defaults` for that platform, the op input's `dtype` and the
    program's `device_kind`."""
    if implementation is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            return _validated([n.strip() for n in env.split(",")], f"${ENV_VAR}")
        return defaults.default(op, platform, dtype, device_kind)
    if isinstance(implementation, str):
        return _validated([implementation], "implementation")
    if not isinstance(implementation, Sequence):
        raise TypeError("implementation must be None, a name or a sequence of names, got "
                        f"{implementation!r}")
    return _validated(implementation, "implementation")


def _environment_strict() -> bool:
    """Whether `$KERNELS_INTERPRET` makes "strict" the default (for a whole test run)."""
    env = os.environ.get(INTERPRET_ENV_VAR, "").strip()
    if env not in ("", STRICT):
        raise ValueError(f"${INTERPRET_ENV_VAR} must be unset or {STRICT!r}, got {env!r}")
    return bool(env)


def resolve_interpret(name: str, interpret: Interpret, platform: str = "cpu",
                      operands: Sequence[Any] = ()) -> bool | str:
    """How implementation `name` runs in a program lowered for `platform`: `False`
    (compiled), `True` (the HLO interpreter, interpreter-sized blocks; Mosaic GPU: its own
    interpreter) or "strict" (the device's blocks; Mosaic kernels in TPU interpret mode,
    Triton's in the HLO interpreter, Mosaic GPU's in its interpreter with race detection).
    `None` interprets exactly where the platform is not the kernel's own, with the HLO
    interpreter, or with "strict" where `$KERNELS_INTERPRET` says so.

    An interpreter that runs through ordered host callbacks (TPU interpret mode, Mosaic GPU's
    interpreter: the entry's `interpreter_callbacks`) cannot sit in a `platform_dependent`
    branch that lowering for the kernel's platform prunes (jax's cond lowering then expects
    their tokens). So where such a mode meets a program built for the kernel's platform
    (`_targets.program_platform`: the abstract device in scope or the operands' mesh), the
    kernel is compiled in every branch."""
    entry = registry.get(name)
    if not entry.is_kernel:
        return False
    if interpret is not None:
        return interpret
    mode = STRICT if _environment_strict() else True
    if registry.compiles_for(name, platform) or (
            mode in entry.interpreter_callbacks
            and registry.compiles_for(name, _targets.program_platform(operands))):
        return False
    return mode


def choose(
    op: str,
    implementation: Implementation,
    interpret: Interpret,
    checks: Mapping[str, Callable[[], None]],
    platform: str = "cpu",
    operands: Sequence[Any] = (),
    config: Any = None,
    dtype: Any = None,
) -> tuple[str, bool | str]:
    """(implementation name, `resolve_interpret`'s mode) for one call of `op` whose input has
    `dtype`, lowered for `platform`.

    `checks[name]()` raises `NotImplementedError(reason)` when kernel `name` declines these
    inputs, as does a kernel that cannot be partitioned over the mesh `operands` live on
    (`partition.check_partitionable`); the reference (`xla`) never declines. Raises
    `NotImplementedError` when nothing accepts the inputs. A kernel in the fast interpreter is
    checked with the blocks it will run, the interpreter's (`_targets.interpreted`), unless the
    caller gave a `config`: that is a device's blocks, checked against the device.
    """
    if not (interpret is None or isinstance(interpret, bool) or
            isinstance(interpret, str) and interpret == STRICT):
        raise TypeError(f"{op}: interpret must be None, True, False or {STRICT!r}, got "
                        f"{interpret!r}")
    family = registry.PLATFORMS.get(platform)  # "gpu", "tpu", or None (cpu)
    with _targets.for_operands(operands):
        kind = _targets.device_kind(family) if family else None
    names = implementations(implementation, op, platform, dtype, kind)
    reasons = []
    for name in names:
        interpreted = resolve_interpret(name, interpret, platform, operands)
        try:
            if registry.get(name).is_kernel:
                partition.check_partitionable(name, interpreted, operands)
                fast = (_targets.interpreter_sized(interpreted, config)
                        and registry.get(name).fast_interpreter)
                with _targets.for_operands(operands), _targets.interpreted(fast):
                    reason = None if interpreted else registry.device_reason(name, platform)
                    if reason:
                        raise NotImplementedError(reason)
                    checks[name]()
        except NotImplementedError as declined:
            reasons.append(f"{name}: {declined}")
            continue
        if interpreted:
            _warn_if_few_cpu_threads(name, registry.get(name).interpreter_threads,
                                     xla_cpu_threads())
        return name, interpreted
    raise NotImplementedError(f"{op}: " + "; ".join(reasons))


def xla_cpu_threads() -> int:
    """The threads of XLA's CPU thread pools: `$PJRT_NPROC`, else one per core this process may
    run on (XLA's own default)."""
    env = os.environ.get("PJRT_NPROC", "").strip()
    if env.isdigit():
        return int(env)
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


@functools.cache
def _warn_if_few_cpu_threads(name: str, needed: int, threads: int) -> None:
    """Warns (once per process and figures) that `name`'s interpreter needs more of XLA's CPU
    threads than there are: it can then deadlock (the registry's `interpreter_threads`)."""
    if threads < needed:
        warnings.warn(
            f"{name}'s interpreter needs at least {needed} threads in XLA's CPU thread pools, "
            f"which have {threads} here: it can deadlock. Set PJRT_NPROC={needed} (or more) in "
            "the environment before jax starts", RuntimeWarning, stacklevel=4)


def run(
    op: str,
    implementation: Implementation,
    interpret: Interpret,
    checks: Mapping[str, Callable[[], None]],
    call: Callable[..., Any],
    *operands: Any,
    config: Any = None,
    out_sharding: NamedSharding | None = None,
    empty: bool = False,
    dtype: Any = None,
) -> Any:
    """`call(name, interpret, out_sharding, *operands)` with the implementation `choose` picks
    for each platform the program may be lowered for (see the module docstring). `operands` is
    a pytree of arrays (None for an absent one); `call` traces the chosen implementation;
    `config` is the caller's (see `choose`); `out_sharding` the caller's, checked
    (`partition.out_sharding`). `empty`: the call has nothing for a kernel to do (an output of
    size zero, or nothing to sum over): the choice is made and checked as for any call, but the
    reference computes the (empty or all-zero) result, the one place every op handles size
    zero. `dtype`: the dtype of the op's input (x, a, the table), which the defaults table may
    split its entries by.

    Without an `out_sharding`, where JAX's own op (`xla`) cannot type its output's sharding on
    Explicit axes (a contraction over a sharded dim, a table sharded along the gathered axis),
    it is given the sharding the kernels give (`_kernels_sharding`), so the default runs where
    a kernel would.

    Where nothing accepts the inputs on some platforms only (an explicit Mosaic kernel on Auto
    mesh axes: fine interpreted on CPU devices, impossible on TPUs), or where a platform's
    choice cannot be traced with these shardings, lowering for those platforms raises the
    reason (`_declined`), before anything is compiled."""
    arrays = jax.tree.leaves(operands)
    choices: dict[str, Any] = {}
    for platform in LOWERING_PLATFORMS:
        try:
            choices[platform] = choose(op, implementation, interpret, checks, platform, arrays,
                                       config, dtype=dtype)
        except NotImplementedError as declined:
            choices[platform] = str(declined)
    if empty:
        choices = {platform: choice if isinstance(choice, str) else (registry.REFERENCE, False)
                   for platform, choice in choices.items()}
    accepted = list(dict.fromkeys(c for c in choices.values() if not isinstance(c, str)))
    if not accepted:
        raise NotImplementedError(choices["cpu"])

    def traced(choice: tuple[str, bool | str], operands: tuple[Any, ...]) -> Any:
        with _targets.for_operands(arrays):
            try:
                return call(*choice, out_sharding, *operands)
            except _ShardingTypeError:
                if registry.get(choice[0]).is_kernel or out_sharding is not None:
                    raise
                sharding = _kernels_sharding(op, interpret, checks, call, operands, config)
                if sharding is None:
                    raise
                return call(*choice, sharding, *operands)

    def branch(choice: tuple[str, bool | str] | str) -> Callable[..., Any]:
        def run_branch(*operands):
            if not isinstance(choice, str):
                try:
                    return traced(choice, operands)
                except _ShardingTypeError as error:
                    # Every branch is traced, whatever the program is lowered for: JAX's own op
                    # (the `xla` branch) may not type a sharding that the kernel's rule takes
                    # (Explicit axes). Lowering for this branch's platforms raises it instead.
                    if len(accepted) == 1:
                        raise
                    reason = f"{op}: {choice[0]}: {error}"
            else:
                reason = choice
            # Traced through another platform's choice, to type the branch: the marker on its
            # inputs raises the reason before any of that is lowered or run.
            other = next(c for c in accepted if c != choice)
            return traced(other, _declined(reason, operands))
        return run_branch

    distinct = {choice: branch(choice) for choice in choices.values()}
    if len(distinct) == 1:
        return next(iter(distinct.values()))(*operands)
    *kernel_platforms, other = LOWERING_PLATFORMS
    return jax.lax.platform_dependent(
        *operands, default=distinct[choices[other]],
        **{platform: distinct[choices[platform]] for platform in kernel_platforms
           if choices[platform] != choices[other]})


def _kernels_sharding(op: str, interpret: Interpret, checks: Mapping[str, Callable[[], None]],
                      call: Callable[..., Any], operands: tuple[Any, ...],
                      config: Any) -> NamedSharding | None:
    """The sharding of the (first) output that the first kernel taking these inputs gives,
    from its abstract evaluation (traced, not run), or None where none takes them (the caller
    then raises JAX's own error)."""
    arrays = jax.tree.leaves(operands)
    for name in registry.kernel_names():
        try:
            choice = choose(op, name, interpret, checks, "cpu", arrays, config)
            out = jax.eval_shape(lambda *ops: call(*choice, None, *ops), *operands)
        except Exception:  # noqa: BLE001 - a kernel that cannot say leaves JAX's error
            continue
        return jax.tree.leaves(out)[0].sharding
    return None


# The identity to tracing and differentiation, but lowering or running it raises
# `NotImplementedError(reason)`: it marks the inputs of the branch of a platform where the op
# was declined, so that only a program for that platform fails.
_declined_p = jax_core.Primitive("kernels_declined")
_declined_p.multiple_results = True
_declined_p.def_abstract_eval(lambda *avals, reason: avals)
ad.primitive_jvps[_declined_p] = lambda primals, tangents, reason: (
    _declined_p.bind(*primals, reason=reason), list(tangents))
batching.primitive_batchers[_declined_p] = lambda args, dims, reason: (
    _declined_p.bind(*args, reason=reason), dims)


def _raise_declined(*args, reason):
    raise NotImplementedError(reason)


_declined_p.def_impl(_raise_declined)
mlir.register_lowering(_declined_p, _raise_declined)


def _declined(reason: str, out: Any) -> Any:
    leaves, tree = jax.tree.flatten(out)
    return jax.tree.unflatten(tree, _declined_p.bind(*leaves, reason=reason))
