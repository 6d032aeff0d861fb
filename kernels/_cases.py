"""The kinds of case an op's `cases.py` lists (`kernels/<op>/cases.py`, `Op.cases`): shapes its
kernels are compiled at (`Case`, run by `kernels.compile`) and whole programs (`Program`, by
`kernels.compile.programs`). Bench shapes and sharded cases are plain data read by `bench` and
`tests/sharded_run.py`; `random` draws the values that the bench and the tests run them on. A
leaf module: an op's cases import it without importing the compile package that reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["Case", "Program", "spec", "shape_text", "random"]


def random(shape: tuple[int, ...], dtype: Any, seed: int = 0, scale: float = 1.0) -> jax.Array:
    """Standard normal values rounded to `dtype`, drawn in NumPy so they are the same on every
    jax version."""
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values.astype(np.dtype(jnp.dtype(dtype))))


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape: `call(implementation, *arrays)` runs it; the compiled function is
    its forward and its gradient with respect to every float argument."""

    op: str
    description: str
    args: tuple[jax.ShapeDtypeStruct, ...]
    call: Callable[..., Any]
    design: bool = False  # one of the device-sized shapes the bench's design figures show
    # Its design figures also show inference, the forward alone (a fused layer: what its
    # epilogue saves there against a training step, which also writes the pre-activation).
    inference: bool = False

    def function(self, implementation: str) -> Callable[..., Any]:
        def forward_and_backward(*arrays):
            def loss(*xs):
                return jnp.sum(self.call(implementation, *xs).astype(jnp.float32))

            float_args = tuple(i for i, a in enumerate(arrays)
                               if jnp.issubdtype(a.dtype, jnp.floating))
            return jax.value_and_grad(loss, argnums=float_args)(*arrays)

        return forward_and_backward

    def layer(self, implementation: str) -> Callable[..., Any]:
        """`layer(cotangent, *arrays) -> (out, gradients)`: the op's output and its gradient
        with respect to every float argument from a given cotangent, as a training step runs
        the layer."""
        def layer(cotangent, *arrays):
            floating = [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating)]

            def forward(*floats):
                full = list(arrays)
                for i, value in zip(floating, floats):
                    full[i] = value
                return self.call(implementation, *full)

            out, pullback = jax.vjp(forward, *(arrays[i] for i in floating))
            return out, pullback(cotangent.astype(out.dtype))

        return layer

    def forward(self, implementation: str) -> Callable[..., Any]:
        """The op alone, as inference runs it."""
        return lambda *arrays: self.call(implementation, *arrays)

    def designed(self, inference: bool = False) -> Case:
        """This case, marked as one the bench's design figures show (`inference`: the forward
        alone too)."""
        return dataclasses.replace(self, design=True, inference=inference)


@dataclasses.dataclass(frozen=True)
class Program:
    """One op's forward and gradient as a program: `operands` are (shape, dtype, spec over the
    ("data", "model") mesh); the program returns the loss sum(op(...)) and its gradient with
    respect to every floating operand. Every program's sharding is one its rule runs without
    all-gathering an operand."""

    op: str  # the op's registered name (`Op.name`)
    description: str
    call: Callable[..., Callable[..., jax.Array]]  # implementation -> op function
    operands: tuple[tuple[tuple[int, ...], Any, P], ...]
    # Whether the rule runs the kernels on these shards: a sharded normalized axis is merged
    # by XLA ops instead (Chan's merge; the fused kernel needs whole groups).
    sharded_kernels: bool = True

    @property
    def dtype(self) -> Any:
        """The dtype of its first operand, the op's input (the defaults table may split by it)."""
        return jnp.dtype(self.operands[0][1])

    def function(self, implementation: str | None) -> Callable[..., Any]:
        op = self.call(implementation)
        floating = tuple(i for i, (_, dtype, _) in enumerate(self.operands)
                         if jnp.issubdtype(dtype, jnp.floating))

        def loss(*arrays):
            return jnp.sum(op(*arrays).astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=floating)

    def args(self, mesh: Mesh, one_device: bool) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
                    mesh, P() if one_device else spec))
                for shape, dtype, spec in self.operands]


def spec(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def shape_text(shape) -> str:
    return "x".join(map(str, shape))
