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
from tests.support import MARKER, assert_lowers



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
