"""What each op registers: its meaning, its kernels, its partition rules, and how a call is
checked against them.

Every op builds one `Op` in `kernels/<op>/__init__.py` (`OP`), and `kernels.ops.OPS` lists
them. The op's wrapper takes the kernel module of the chosen implementation from it
(`module`), the per-kernel checks the dispatch runs before choosing (`checks`) and its config
check (`check_config`); the contract tests (`tests/test_contract.py`) run over `OPS`, so a new
op that misses a piece (a kernel's `check`, compile cases, a whole program, a bench, a default)
fails them. See CONTRIBUTING.md, "Adding an op".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["Op"]


@dataclasses.dataclass(frozen=True)
class Op:
    name: str  # as the dispatch, the defaults table and the error messages name it
    reference: Callable[..., Any]  # the meaning (reference/<op>.py), which `xla` runs
    kernels: Mapping[str, ModuleType]  # "triton" / "mosaic" -> module: check, resolve_config
    config_type: type  # the op's config dataclass
    sharding: ModuleType  # kernels/<op>/sharding.py: a rule and factors per partitioned launch

    def module(self, implementation: str) -> ModuleType:
        return self.kernels[implementation]

    def checks(self, problem: Any, config: Any) -> dict[str, Callable[[], None]]:
        """Per kernel, `module.check(problem, config)`: raises NotImplementedError where the
        kernel declines the call (the dispatch then tries the next implementation)."""
        return {name: functools.partial(module.check, problem, config)
                for name, module in self.kernels.items()}

    def check_config(self, config: Any, caller: str | None = None) -> None:
        """A caller's config must be the op's config dataclass (or None)."""
        if config is not None and not isinstance(config, self.config_type):
            raise TypeError(f"{caller or self.name}: config must be a "
                            f"{self.config_type.__name__} or None, got {config!r}")
