"""Which implementation runs an op, and whether its kernel is interpreted: decided here only.

Each op passes `choose` the checks of its Pallas implementations. A check raises
`NotImplementedError` with a reason when its kernel cannot take the inputs (a dtype, a shape, an
option); `choose` then tries the next implementation in the sequence. A single explicit choice
that declines raises that reason, prefixed with the implementation's name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import jax

from kernels import defaults

IMPLEMENTATIONS = ("xla", "triton", "mosaic")
ENV_VAR = "KERNELS_IMPLEMENTATION"

Implementation = str | Sequence[str] | None



def _validated(names: Sequence[str], source: str) -> tuple[str, ...]:
    names = tuple(names)
    if not names:
        raise ValueError(f"{source} must name at least one of {IMPLEMENTATIONS}, got {names!r}")
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"{source} must be one of {IMPLEMENTATIONS} or a sequence of "
                             f"them, got {name!r}")
    return names


def implementations(implementation: Implementation, op: str = "") -> tuple[str, ...]:
    """The sequence of implementations to try for `implementation=` of `op` (see DESIGN.md):
    `None` is `$KERNELS_IMPLEMENTATION` if set, else the op's entry in `kernels.defaults`."""
    if implementation is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            return _validated([n.strip() for n in env.split(",")], f"${ENV_VAR}")
        return defaults.default(op, jax.default_backend())
    if isinstance(implementation, str):
        return _validated([implementation], "implementation")
    if not isinstance(implementation, Sequence):
        raise TypeError("implementation must be None, a name or a sequence of names, got "
                        f"{implementation!r}")
    return _validated(implementation, "implementation")


def _platform_present(name: str) -> bool:
    """Whether a device kernel `name` runs on natively is here (else it is interpreted)."""
    return any(defaults.KERNEL_OF_PLATFORM.get(defaults.PLATFORMS.get(device.platform)) == name
               for device in jax.devices())


def resolve_interpret(name: str, interpret: bool | None) -> bool:
    """Whether implementation `name` runs interpreted: by default, exactly off its platform."""
    if name == "xla":
        return False
    if interpret is None:
        return not _platform_present(name)
    return interpret


def choose(
    op: str,
    implementation: Implementation,
    interpret: bool | None,
    checks: Mapping[str, Callable[[], None]],
) -> tuple[str, bool]:
    """Returns (implementation name, interpret) for one call of `op`.

    `checks[name]()` raises `NotImplementedError(reason)` when kernel `name` declines these
    inputs; "xla" never declines. Raises `NotImplementedError` when nothing accepts the inputs.
    """
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"{op}: interpret must be None, True or False, got {interpret!r}")
    names = implementations(implementation, op)
    reasons = []
    for name in names:
        try:
            if name != "xla":
                checks[name]()
        except NotImplementedError as declined:
            reasons.append(f"{name}: {declined}")
            continue
        return name, resolve_interpret(name, interpret)
    raise NotImplementedError(f"{op}: " + "; ".join(reasons))
