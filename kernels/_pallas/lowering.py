"""Lowering for a platform this machine lacks (`on_target`, `lower`, `lowered_text`), and the
markers a kernel call leaves in lowered text.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax

from kernels import _targets

__all__ = ["MOSAIC_CALL_MARKER", "MOSAIC_GPU_CALL_MARKER", "TRITON_CALL_MARKER", "lower",
           "lowered_text", "on_target"]


TRITON_CALL_MARKER = "__gpu$xla.gpu.triton"
MOSAIC_CALL_MARKER = "tpu_custom_call"
MOSAIC_GPU_CALL_MARKER = "mosaic_gpu_v2"


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
