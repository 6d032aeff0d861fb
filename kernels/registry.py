"""What an implementation is and what an op is, as data: the one list of implementations
(`IMPLEMENTATIONS`) and the record each op registers (`Op`).

An implementation is one entry here plus one subpackage in each op's folder
(`kernels/<op>/<subpackage>/`, with `check`, `resolve_config` and the op's kernel entry points).
Dispatch, defaults, the compile checks, whole programs, the bench and the shared tests read the
entries; none of them spells out an implementation's name. An op without an implementation's
subpackage, and an implementation whose backend the installed jax lacks, decline with a reason
(`Op.module`), like any kernel that cannot take a call: a jax without Pallas' Triton backend
still imports `kernels` and runs every other implementation. See CONTRIBUTING.md, "Adding an
implementation".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import _targets
from kernels._pallas.lowering import (MOSAIC_CALL_MARKER, MOSAIC_GPU_CALL_MARKER,
                                      TRITON_CALL_MARKER)
from kernels._targets import Target

__all__ = ["Implementation", "IMPLEMENTATIONS", "REFERENCE", "PLATFORMS", "Op", "names",
           "kernel_names", "get", "native", "compiles_for", "runs_natively", "device_reason",
           "unavailable", "registered"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of every op."""

    name: str  # as `implementation=` names it
    # The op's folder holds its kernels in kernels/<op>/<subpackage>/; None: it runs the op's
    # reference (JAX's own ops), on every platform, and never declines.
    subpackage: str | None
    # The lowering platforms whose programs run its kernels compiled ("cuda" and "rocm" apart);
    # on any other platform they are interpreted.
    platforms: tuple[str, ...] = ()
    # The devices its compiled kernels run on (a GPU's compute capability, a TPU): where the
    # program's device is another, a compiled call declines (`device_reason`); `native` and the
    # compile checks' targets follow it.
    runs_on: Callable[[Target], bool] = lambda target: False
    backend: str | None = None  # the Pallas backend module its kernels need from jax
    min_jax: tuple[int, ...] = (0, 10)  # the oldest jax it runs on
    # What `interpret=True` and `interpret="strict"` run it in (docs/usage.md, "Testing on a
    # CPU"); `strict_simulator`: "strict" is TPU interpret mode, whose simulated memory checks
    # every access (its ordered host callbacks cannot sit in a pruned `platform_dependent`
    # branch, `_dispatch.resolve_interpret`), rather than the HLO interpreter again.
    interpret: Mapping[bool | str, str] = dataclasses.field(default_factory=dict)
    strict_simulator: bool = False
    # The interpret modes that run through ordered host callbacks (TPU interpret mode, Mosaic
    # GPU's interpreter): those cannot sit in a `platform_dependent` branch that lowering for
    # the kernel's own platform prunes, so a program built for that platform compiles the
    # kernel in every branch (`_dispatch.resolve_interpret`).
    interpreter_callbacks: tuple[bool | str, ...] = ()
    call_marker: str | None = None  # the custom call its kernels leave in lowered text
    # kernels.compile's back end for its kernels (`compile.api`): "triton" and "libtpu" (the
    # Python packages the test extra installs), "mosaic_gpu" (XLA's GPU compiler).
    compile_backend: str | None = None
    # Whether its compiled kernels partition over Auto mesh axes (Mosaic's custom call has no
    # partitioner: on Auto TPU axes it is refused, `partition.check_partitionable`).
    auto_axes: bool = True
    supports_float64: bool = True  # float64 inputs run (else declined with a reason)
    # Whether `interpret=True` is the fast interpreter (Pallas' HLO interpreter on blocks sized
    # for it, at model-test sizes); else it runs the "strict" interpreter's schedule, slowly.
    fast_interpreter: bool = True
    # The threads XLA's CPU thread pools need (`PJRT_NPROC`, by default one per core) for its
    # interpreter to make progress; the dispatch warns once where a call would run it with
    # fewer (`_dispatch.choose`).
    interpreter_threads: int = 0

    @property
    def is_kernel(self) -> bool:
        return self.subpackage is not None


def _gpu_families(*majors: int) -> Callable[[Target], bool]:
    """GPUs of these compute-capability majors (9: Hopper, 10: datacenter Blackwell); an
    unknown GPU (the fast interpreter's) is taken as one."""
    return lambda t: (t.platform == "gpu" and (t.compute_capability is None
                                               or t.compute_capability // 10 in majors))


REFERENCE = "xla"  # the implementation that runs each op's reference: JAX's own ops
# Mosaic GPU's interpreter runs each simulated warpgroup, and each warp of a `warp_map`, as an
# XLA computation on a thread of its own, whose callbacks wait on the kernel's barriers; XLA runs
# some of those callbacks on its CPU client's thread pools, which have PJRT_NPROC threads (by
# default one per core). On a 2-core host the interpreter's own callback and one barrier wait
# took both, and the thread the barrier waited for never ran: a Blackwell test hung about 1 run in
# 8 with two workers (jax 0.12.0.1; with 16 threads, none in 12). 16 covers every thread a CTA of
# ours can simulate at once (3 warpgroups of 4 warps, and their callbacks).
MOSAIC_GPU_INTERPRETER_THREADS = 16
_ENTRIES = (
    Implementation(REFERENCE, None),
    # Ampere and Hopper: the GPUs its kernels are compiled for (sm_80, sm_90) and timed on. On
    # sm_100 one backward spills (normalize 4096x12000 float32: 16 bytes); Mosaic GPU is there.
    Implementation(
        "triton", "triton", platforms=("cuda", "rocm"), runs_on=_gpu_families(8, 9),
        backend="jax.experimental.pallas.triton",
        interpret={True: "Pallas' HLO interpreter on blocks sized for it",
                   "strict": "Pallas' HLO interpreter on the device's blocks"},
        call_marker=TRITON_CALL_MARKER, compile_backend="triton"),
    Implementation(
        "mosaic", "mosaic", platforms=("tpu",), runs_on=lambda t: t.platform == "tpu",
        backend="jax.experimental.pallas.tpu",
        interpret={True: "Pallas' HLO interpreter on blocks sized for it",
                   "strict": "TPU interpret mode on the device's blocks (out-of-bounds reads "
                             "raise, uninitialized memory is NaN)"},
        strict_simulator=True, interpreter_callbacks=("strict",),
        call_marker=MOSAIC_CALL_MARKER, compile_backend="libtpu",
        auto_axes=False, supports_float64=False),
    # Pallas' Mosaic GPU backend, the GPU backend JAX keeps (Triton's is deprecated): sm_90a
    # and sm_100a only, cuda only. normalize's, gather's and matmul's Hopper kernels have run on
    # an H100 (docs/design.md, section 6); conv2d's and the Blackwell matmul's are compiled only.
    # Its interpreter is no fast interpreter: a 256x1024 layer norm took 250-280 ms there against
    # XLA's 0.1-0.3 ms (900-2000x), a gather of 64 rows of 128 from 1000 about 100 ms forward and
    # 1.4 s backward against XLA's 0.01 and 0.05 ms (`python -m bench --interpret strict`, this
    # project's 2-core CPU, jax 0.12.0.1).
    Implementation(
        "mosaic_gpu", "mosaic_gpu", platforms=("cuda",), runs_on=_gpu_families(9, 10),
        backend="jax.experimental.pallas.mosaic_gpu", min_jax=(0, 12),
        interpret={True: "Mosaic GPU's interpreter on the device's blocks",
                   "strict": "Mosaic GPU's interpreter on the device's blocks, with its race "
                             "detector"},
        interpreter_callbacks=(True, "strict"), call_marker=MOSAIC_GPU_CALL_MARKER,
        compile_backend="mosaic_gpu", supports_float64=False, fast_interpreter=False,
        interpreter_threads=MOSAIC_GPU_INTERPRETER_THREADS),
)
# A lowering platform (or jax.default_backend(), a device's platform) -> the kind of
# `_targets.Target` its devices are: also the defaults table's platform.
PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}
# name -> entry, in the order `names` lists them (the default of every op's tests). Changed
# only by `registered` (a test's temporary entry).
IMPLEMENTATIONS: dict[str, Implementation] = {entry.name: entry for entry in _ENTRIES}


def names() -> tuple[str, ...]:
    return tuple(IMPLEMENTATIONS)


def kernel_names() -> tuple[str, ...]:
    """The implementations with kernels of their own (not the reference)."""
    return tuple(name for name, entry in IMPLEMENTATIONS.items() if entry.is_kernel)


def get(name: str) -> Implementation:
    return IMPLEMENTATIONS[name]


def compiles_for(name: str, platform: str) -> bool:
    """Whether implementation `name`'s kernels are compiled (not interpreted) in a program
    lowered for `platform` ("cuda", "rocm", "tpu", "cpu"; "gpu" as jax.default_backend() says
    it): its own platforms."""
    lowerings = ("cuda", "rocm") if platform == "gpu" else (platform,)
    return any(p in IMPLEMENTATIONS[name].platforms for p in lowerings)


def runs_natively(name: str, platform: str, target: Target | None = None) -> bool:
    """Whether implementation `name`'s kernels run compiled in a program lowered for
    `platform` on `target` (default: the device such a call targets now, `_targets.current`):
    its platform, and a device its `runs_on` takes."""
    kind = PLATFORMS.get(platform)
    return (kind is not None and compiles_for(name, platform)
            and IMPLEMENTATIONS[name].runs_on(target or _targets.current(kind)))


def device_reason(name: str, platform: str) -> str | None:
    """Why implementation `name`, compiled for `platform`, cannot run on the device a call
    targets now (`runs_on`), or None."""
    kind = PLATFORMS.get(platform)
    if kind is None or not compiles_for(name, platform):
        return None
    target = _targets.current(kind)
    if IMPLEMENTATIONS[name].runs_on(target):
        return None
    return f"its kernels do not run on {target.device_kind} ({target.name})"


def native(platform: str, target: Target | None = None) -> str | None:
    """The first implementation (in the registry's order) whose kernels run compiled on
    `platform` and `target` (`runs_natively`); None where only the reference runs (a CPU)."""
    return next((name for name in IMPLEMENTATIONS if runs_natively(name, platform, target)),
                None)


@functools.cache
def _backend_missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # a parent package that is not there
        return True


def unavailable(name: str) -> str | None:
    """Why implementation `name` cannot run with the installed jax, or None."""
    entry = IMPLEMENTATIONS[name]
    if jax.__version_info__ < entry.min_jax:
        return (f"needs jax >= {'.'.join(map(str, entry.min_jax))}, this is jax "
                f"{jax.__version__}")
    if entry.backend and _backend_missing(entry.backend):
        return f"the installed jax {jax.__version__} has no {entry.backend}"
    return None


@contextlib.contextmanager
def registered(entry: Implementation) -> Iterator[Implementation]:
    """`entry` is an implementation within this scope (a test's, to see a new one reach the
    dispatch, the shared tests and the compile listing)."""
    if entry.name in IMPLEMENTATIONS:
        raise ValueError(f"an implementation named {entry.name!r} is already registered")
    IMPLEMENTATIONS[entry.name] = entry
    try:
        yield entry
    finally:
        del IMPLEMENTATIONS[entry.name]


@dataclasses.dataclass(frozen=True)
class Op:
    """What an op registers (`OP` in `kernels/<op>/__init__.py`; `kernels.ops.OPS` lists them).

    Its kernels are found by implementation (`module`); the dispatch runs `checks` before
    choosing. `cases` holds the op's cases beyond its unit tests, as data: compile cases, whole
    programs, bench shapes and sharded cases (`kernels/<op>/cases.py`).
    """

    name: str  # as the dispatch, the defaults table and the error messages name it
    reference: Callable[..., Any]  # the meaning (reference/<op>.py), which `xla` runs
    package: str  # "kernels.<op>": each implementation's kernels are its subpackage
    config_type: type  # the op's config dataclass
    sharding: ModuleType  # kernels/<op>/sharding.py: a rule and factors per partitioned launch
    # check(implementation, problem, config), instead of the kernel module's own check, where
    # the op checks more than its kernel module does (conv2d's 1x1 runs on the matmul kernels).
    check: Callable[[str, Any, Any], None] | None = None

    @property
    def cases(self) -> ModuleType:
        """kernels/<op>/cases.py, imported when first read (its cases import the op itself)."""
        return importlib.import_module(f"{self.package}.cases")

    def has(self, implementation: str) -> bool:
        """Whether the op's folder holds kernels of `implementation`."""
        entry = IMPLEMENTATIONS[implementation]
        return entry.is_kernel and importlib.util.find_spec(
            f"{self.package}.{entry.subpackage}") is not None

    def module(self, implementation: str) -> ModuleType:
        """The op's kernel package of `implementation`; NotImplementedError with the reason where
        the op has none or the installed jax cannot run it."""
        entry = IMPLEMENTATIONS[implementation]
        if not entry.is_kernel:
            raise ValueError(f"{implementation} runs the reference: it has no kernel module")
        reason = unavailable(implementation)
        if reason:
            raise NotImplementedError(reason)
        if not self.has(implementation):
            raise NotImplementedError(f"{self.name} has no {implementation} kernels "
                                      f"({self.package}.{entry.subpackage})")
        return importlib.import_module(f"{self.package}.{entry.subpackage}")

    def checks(self, problem: Any, config: Any) -> dict[str, Callable[[], None]]:
        """Per kernel implementation, its check of this call: raises NotImplementedError where
        it declines (the dispatch then tries the next implementation)."""
        return {name: functools.partial(self._check, name, problem, config)
                for name in kernel_names()}

    def _check(self, implementation: str, problem: Any, config: Any) -> None:
        if self.check is not None:
            self.check(implementation, problem, config)
        else:
            self.module(implementation).check(problem, config)

    def validate(self, config: Any, caller: str | None = None, booleans: bool = False,
                 **arrays: Any) -> None:
        """What every op's public function checks first, before anything is traced: each named
        array has a numeric dtype (or bool, where `booleans`), named before `jnp.asarray`'s
        generic error; the config is the op's config dataclass (or None). The op's own
        arguments (shapes, axes, modes) are its reference's checks."""
        caller = caller or self.name
        for name, array in arrays.items():
            dtype = getattr(array, "dtype", None)
            dtype = np.asarray(array).dtype if dtype is None else dtype
            if not (jnp.issubdtype(dtype, jnp.number) or booleans and dtype == jnp.bool_):
                kinds = "numeric or boolean" if booleans else "numeric"
                raise TypeError(f"{caller}: {name} must have a {kinds} dtype, got {dtype}")
        if config is not None and not isinstance(config, self.config_type):
            raise TypeError(f"{caller}: config must be a {self.config_type.__name__} or None, "
                            f"got {config!r}")
