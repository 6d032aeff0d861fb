"""The process environment the real compilers need on a machine without their hardware.

Each variable is read once, when jax starts its backends (the CUDA plugin's version check) or
when libtpu first loads, so it must be set before then: by the entry points that compile
(`python -m kernels.compile`, `python -m bench`, the test suite's conftest), not by importing
this package, which changes nothing.
"""

from __future__ import annotations

import os

from jax._src import xla_bridge

# (libtpu's cloud metadata query is skipped by jax itself where it finds no TPU chip.)
COMPILE_ONLY_VARIABLES = {
    # libtpu loaded by several processes at once (pytest-xdist workers, parallel compiles):
    # without this, the second fails on libtpu's lock file.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    # XLA's GPU compiler for compile-only GPUs: the CUDA plugin skips its driver check, which
    # otherwise disables it at start-up ("topology not implemented for cuda").
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
}


def use_compile_only_devices() -> None:
    """Sets each of `COMPILE_ONLY_VARIABLES` that is unset. Call it before the first jax
    computation (or `jax.devices()`) of the process; raises RuntimeError if jax has started its
    backends already and a variable was missing, since it would then take no effect."""
    missing = [name for name in COMPILE_ONLY_VARIABLES if name not in os.environ]
    if missing and xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"kernels.compile.use_compile_only_devices() must run before jax starts its "
            f"backends (the first computation or jax.devices()): {', '.join(missing)} would "
            f"take no effect now. Call it first, or set them to 1 in the environment.")
    for name in missing:
        os.environ[name] = COMPILE_ONLY_VARIABLES[name]
