"""Lowering for cuda and tpu on an abstract 8-device mesh: the kernels run on per-shard blocks.

No devices are needed: an Explicit `AbstractMesh` carries the shardings in the operands' types,
so `kernels.partition` plans the call while tracing, and the lowered program shows each
kernel's operand shapes (one device's blocks) and the collectives around it.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from kernels import _targets
from kernels.partition.rules import dims_of_sharding
from tests.support import MARKER, assert_lowers, implementations_of



def _mesh(implementation: str) -> AbstractMesh:
    """(2, 4) mesh of the implementation's default target devices: kernels inside shard_map
    pick their blocks for the device the mesh is made of."""
    target = _targets.DEFAULT["gpu" if implementation == "triton" else "tpu"]
    return AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                        abstract_device=_targets.abstract_device(target))


def _operand(shape, spec, dtype=jnp.float32):
    return lambda mesh: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# name -> (call, operands, blocks one device's first kernel call gets, all-reduces)
CASES = {
    "matmul/M+N": (lambda impl: lambda a, b: kernels.matmul(a, b, implementation=impl,
                                                            interpret=False),
                   [_operand((256, 128), P("data", None)), _operand((128, 512), P(None, "model"))],
                   [(128, 128), (128, 128)], 0),
    "matmul/K": (lambda impl: lambda a, b: kernels.matmul(a, b, implementation=impl,
                                                          interpret=False),
                 [_operand((256, 128), P("data", "model")), _operand((128, 256), P("model", None))],
                 [(128, 32), (32, 256)], 1),
    "layer_norm/rows": (lambda impl: lambda x: kernels.layer_norm(x, implementation=impl,
                                                                  interpret=False),
                        [_operand((256, 512), P("data", None))], [(128, 512)], 0),
    "gather/vocab": (lambda impl: lambda t, i: kernels.gather(t, i, mode="fill", fill_value=0.0,
                                                              implementation=impl,
                                                              interpret=False),
                     [_operand((1024, 128), P("model", None)),
                      _operand((64,), P("data"), jnp.int32)],
                     [(256, 128)], 1),
    "conv2d/batch+out-channels": (
        lambda impl: lambda x, w: kernels.conv2d(x, w, implementation=impl, interpret=False),
        [_operand((8, 16, 16, 64), P("data")), _operand((3, 3, 64, 128), P(None, None, None,
                                                                              "model"))],
        [(3, 3, 64, 32)], 0),  # the input is padded or flattened before the kernel
}


def _kernel_operand_shapes(text: str, marker: str) -> list[tuple[int, ...]]:
    """Operand shapes of the first kernel call."""
    line = next(line for line in text.splitlines() if marker in line and "custom_call" in line)
    operands = re.search(r":\s*\(([^)]*)\)\s*->", line).group(1)
    shapes = []
    for dims in re.findall(r"tensor<([0-9x]+)x[a-z]+[0-9]*>", operands):
        shapes.append(tuple(int(d) for d in dims.split("x")))
    return shapes


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("case", CASES)
def test_kernels_lower_per_shard(case, implementation):
    make, operands, block_shapes, all_reduces = CASES[case]
    mesh = _mesh(implementation)
    text = assert_lowers(make(implementation), *(make_operand(mesh) for make_operand in operands),
                         implementation=implementation)
    assert "sdy.manual_computation" in text or "shard_map" in text
    shapes = _kernel_operand_shapes(text, MARKER[implementation])
    sizes = [math.prod(shape) for shape in shapes]
    for expected in block_shapes:  # each sharded operand reaches the kernel as one block
        assert math.prod(expected) in sizes, (shapes, expected)
    assert text.count("all_reduce") == all_reduces, text.count("all_reduce")
    assert "all_gather" not in text


def _gradient_mesh(implementation: str) -> AbstractMesh:
    """(2, 2) Explicit mesh of the devices `implementation`'s kernels compile for."""
    platform = "tpu" if implementation == "mosaic" else "gpu"
    return AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                        abstract_device=_targets.abstract_device(_targets.DEFAULT[platform]))


# name -> (op of (implementation, arrays), operands): epilogue operands sharded unlike the
# product (replicated, on another mesh axis, broadcast over the batch), and a normalized
# activation of rank 3, whose gradients JAX types like their primals.
_EPILOGUE_CASES = {
    "matmul/bias-replicated": (
        lambda impl, x, w, b: kernels.matmul(x, w, bias=b, activation="gelu",
                                             implementation=impl, interpret=False),
        [_operand((64, 32), P("data", None)), _operand((32, 48), P(None, "model")),
         _operand((48,), P())]),
    "matmul/residual-replicated": (
        lambda impl, x, w, r: kernels.matmul(x, w, residual=r, implementation=impl,
                                             interpret=False),
        [_operand((64, 32), P("data", None)), _operand((32, 48), P(None, "model")),
         _operand((64, 48), P())]),
    "matmul/residual-other-axis": (
        lambda impl, x, w, b, r: kernels.matmul(x, w, bias=b, residual=r, implementation=impl,
                                                interpret=False),
        [_operand((64, 32), P()), _operand((32, 48), P(None, "model")), _operand((48,), P()),
         _operand((64, 48), P("data", None))]),
    "matmul/residual-batch-broadcast": (
        lambda impl, x, w, r: kernels.matmul(x, w, residual=r, activation="silu",
                                             implementation=impl, interpret=False),
        [_operand((4, 16, 32), P("data", None, None)), _operand((32, 48), P(None, "model")),
         _operand((16, 48), P())]),
    "conv2d/bias-replicated": (
        lambda impl, x, w, b: kernels.conv2d(x, w, bias=b, activation="relu",
                                             implementation=impl, interpret=False),
        [_operand((4, 8, 8, 16), P("data")), _operand((3, 3, 16, 32), P(None, None, None, "model")),
         _operand((32,), P())]),
    "normalize/sequence-sharded": (  # (batch, sequence, features): a 3-D view of the rows
        lambda impl, x, scale: kernels.rms_norm(x, scale, implementation=impl, interpret=False),
        [_operand((4, 16, 48), P(None, "data", "model")), _operand((48,), P())]),
    "normalize/residual-replicated": (
        lambda impl, x, r, scale: kernels.layer_norm(x, scale, residual=r, implementation=impl,
                                                     interpret=False)[0],
        [_operand((64, 48), P("data", None)), _operand((64, 48), P()), _operand((48,), P())]),
}


@pytest.mark.parametrize("case,implementation", [
    (case, impl) for case in _EPILOGUE_CASES for impl in implementations_of(case.split("/")[0])])
def test_gradients_are_typed_like_their_primals(case, implementation):
    """On a (2, 2) Explicit mesh every implementation's gradient of a bias or residual sharded
    unlike the output carries its primal's sharding, as JAX's own gradient does (a custom_vjp
    whose backward returns dZ's sharding raises while tracing)."""
    op, operands = _EPILOGUE_CASES[case]
    mesh = _gradient_mesh(implementation)
    args = [make_operand(mesh) for make_operand in operands]
    loss = lambda *a: jnp.sum(op(implementation, *a).astype(jnp.float32))  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).out_info
    for arg, grad in zip(args, grads):
        assert (dims_of_sharding(grad.sharding, grad.ndim)
                == dims_of_sharding(arg.sharding, arg.ndim)), (grad.sharding, arg.sharding)
