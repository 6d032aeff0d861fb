"""The shared normalize suite (layer norm, RMS norm, standardization), run against every
implementation: xla, triton interpreted, mosaic in strict TPU interpret mode."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm
from reference.normalize import layer_norm as reference_layer_norm
from reference.normalize import normalize as reference_normalize
from reference.normalize import rms_norm as reference_rms_norm
from tests.support import (FLOAT_DTYPES, KERNELS, SUPPORTS_FLOAT64, Contract, as_f64,
                           assert_close, assert_lowers, random, tolerance, weighted_sum, x64)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


def _param_shape(shape, axis):
    axes = (axis,) if isinstance(axis, int) else axis
    return tuple(shape[a] for a in sorted(a % len(shape) for a in axes))


def _group_size(shape, axis) -> int:
    return int(np.prod(_param_shape(shape, axis), dtype=np.int64))


def _ground_truth(x, scale=None, offset=None, **kwargs) -> np.ndarray:
    """The reference evaluated in float64 on the (rounded) inputs."""
    with x64():
        args = [None if a is None else jnp.asarray(as_f64(a)) for a in (x, scale, offset)]
        return np.asarray(reference_normalize(*args, **kwargs))


def _inputs(shape, axis, dtype, seed=0, param_dtype=jnp.float32):
    x = random(shape, dtype, seed)
    pshape = _param_shape(shape, axis)
    scale = random(pshape, param_dtype, seed + 1) + 1
    offset = random(pshape, param_dtype, seed + 2)
    return x, scale, offset


def _check(y, x, scale, offset, **kwargs):
    expected = _ground_truth(x, scale, offset, **kwargs)
    chex.assert_shape(y, x.shape)
    assert y.dtype == x.dtype
    assert_close(y, expected, x.dtype, reduction_length=_group_size(x.shape, kwargs["axis"]))


# (shape, axis): not multiples of any block; a row that is one 8192-element Triton chunk (5000);
# long rows that loop over chunks (65536); the tutorial's axis-0 standardization; several axes,
# negative axes, non-contiguous axes (the one layout that transposes).
CASES = [((1, 1), -1), ((3, 7), -1), ((129, 1000), -1), ((4, 33, 4096), -1), ((3, 5000), -1),
         ((2, 65536), -1), ((10000, 100), 0), ((3, 5, 33), (1, 2)), ((6, 20, 7), -2),
         ((4, 9, 6), (0, 2)), ((2, 3, 4, 5), (-3, -2))]


@pytest.mark.parametrize("shape,axis", CASES, ids=str)
def test_matches_float64_ground_truth(implementation, shape, axis):
    x, scale, offset = _inputs(shape, axis, jnp.float32)
    y = normalize(x, scale, offset, axis=axis, implementation=implementation)
    _check(y, x, scale, offset, axis=axis)


@pytest.mark.parametrize("shape,axis", [((129, 1000), -1), ((300, 37), 0), ((5, 2, 7), (0, 2))],
                         ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
def test_16_bit_dtypes(implementation, shape, axis, dtype):
    x, scale, offset = _inputs(shape, axis, dtype, seed=3)
    y = normalize(x, scale, offset, axis=axis, implementation=implementation)
    _check(y, x, scale, offset, axis=axis)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-5])
@pytest.mark.parametrize("params", ["none", "scale", "offset", "both"])
def test_options(implementation, subtract_mean, epsilon, params):
    shape, axis = (19, 45), -1
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=4)
    scale = scale if params in ("scale", "both") else None
    offset = offset if params in ("offset", "both") else None
    kwargs = dict(axis=axis, epsilon=epsilon, subtract_mean=subtract_mean)
    y = normalize(x, scale, offset, implementation=implementation, **kwargs)
    _check(y, x, scale, offset, **kwargs)


# Groups longer than one block, with a ragged last chunk, for each layout: the chunked paths
# (merged moments, two-phase Mosaic grid; Triton's backward: two chunks (200) summed in its
# programs, three (300) by a sums pass) at sizes the interpreters run quickly. In the columns
# layout a Mosaic chunk with scale/offset is a multiple of 128 (the parameters' lane dim).
CHUNKED = [((20, 300), -1, NormalizeConfig(block_groups=16, block_reduced=128)),
           ((20, 200), -1, NormalizeConfig(block_groups=16, block_reduced=128)),
           ((300, 20), 0, NormalizeConfig(block_groups=20, block_reduced=128)),
           ((2, 300, 130), 1, NormalizeConfig(block_groups=128, block_reduced=128))]


def _case_id(value) -> str:
    if isinstance(value, NormalizeConfig):
        return f"blocks{value.block_groups}x{value.block_reduced}"
    return str(value)


def _chunked_config(implementation, config):
    if implementation == "triton":  # Triton blocks are powers of 2
        return NormalizeConfig(block_groups=1 << (config.block_groups - 1).bit_length(),
                               block_reduced=config.block_reduced)
    return config


@pytest.mark.parametrize("implementation", KERNELS)  # the config means nothing to xla
@pytest.mark.parametrize("shape,axis,config", CHUNKED, ids=_case_id)
@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
def test_groups_longer_than_one_block(implementation, shape, axis, config, subtract_mean):
    config = _chunked_config(implementation, config)
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=5)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)

    def loss(f, **kw):  # (loss, y): one jitted program computes the output and its gradients
        def fn(x, s, o):
            y = f(x, s, o, **kwargs, **kw)
            return weighted_sum(y), y
        return jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))

    grads, y = loss(normalize, implementation=implementation, config=config)(x, scale, offset)
    _check(y, x, scale, offset, **kwargs)
    want, _ = loss(reference_normalize)(x, scale, offset)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


# Each Triton schedule (kernels/normalize/triton/__init__.py, "Programs vs the GPU") at a size the
# interpreter runs quickly: long groups with enough group blocks for one wave (fused, looped
# chunks); too few blocks, so the reduced axis is split, several chunks per split with a
# shorter last split (rows and columns layouts, ragged chunks and group blocks).
TRITON_SCHEDULES = [((132, 40), -1, NormalizeConfig(block_groups=1, block_reduced=16), "fused"),
                    ((1, 2210), -1, NormalizeConfig(block_groups=1, block_reduced=4), "split"),
                    ((301, 3), 0, NormalizeConfig(block_groups=2, block_reduced=1), "split")]


def _triton_schedule(shape, axis, config):
    from kernels.normalize import common, triton

    axes = tuple(sorted(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)))
    _, (outer, groups, reduced, rows) = common.plan(shape, axes)
    p = common.Problem(outer, groups, reduced, rows, jnp.dtype(jnp.float32), True, 1e-5, True,
                       True)
    return triton.schedule(p, triton.resolve_config(p, config))


@pytest.mark.parametrize("shape,axis,config,kind", TRITON_SCHEDULES, ids=_case_id)
def test_triton_schedules(shape, axis, config, kind):
    s = _triton_schedule(shape, axis, config)
    if kind == "fused":
        assert s.splits == 1 and s.num_chunks > 1
    else:  # several chunks per split, the last split shorter
        assert s.per_split > 1 and s.splits * s.per_split > s.num_chunks
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=31)

    def fn(x, s, o):
        return weighted_sum(normalize(x, s, o, axis=axis, implementation="triton",
                                      config=config))

    def want(x, s, o):
        return weighted_sum(reference_normalize(x, s, o, axis=axis))

    _check(normalize(x, scale, offset, axis=axis, implementation="triton", config=config), x,
           scale, offset, axis=axis)
    grads = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(x, scale, offset)
    for got, expected in zip(grads, jax.grad(want, argnums=(0, 1, 2))(x, scale, offset)):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def _triton_kernels(op, shape, dtype, axis):
    """The Triton pallas_calls of op's forward and backward at `shape`, traced for an H100."""
    from kernels import _targets
    from kernels.compile import pallas_calls

    fn = {"layer_norm": layer_norm, "normalize": normalize}[op]
    param = jax.ShapeDtypeStruct(_param_shape(shape, axis), jnp.float32)

    def loss(x, s, o):
        y = fn(x, s, o, axis=axis, implementation="triton", interpret=False)
        return jnp.sum(y.astype(jnp.float32))

    return pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), jax.ShapeDtypeStruct(shape, dtype),
                        param, param, target=_targets.DEFAULT["gpu"])


@pytest.mark.parametrize("op,shape,dtype,axis", [
    ("normalize", (1048576, 64), jnp.float32, 0),  # batch-norm statistics of 64 features
    ("normalize", (32, 56, 56, 256), jnp.bfloat16, (0, 1, 2)),  # ResNet-50 batch norm
    ("layer_norm", (8192, 8192), jnp.bfloat16, -1),  # rows longer than one tile
    ("layer_norm", (8192, 1024), jnp.bfloat16, -1),
], ids=str)
def test_triton_programs_fill_an_h100(op, shape, dtype, axis):
    """Issue 10, findings 5 and 6: every forward and backward kernel launches two waves of an
    H100's 132 SMs (the single-pass grid gave 2 programs at (1M, 64) over axis 0), and the
    backward's partial dscale/doffset rows stay a few percent of its necessary traffic (a
    long-row backward used to write one float32 partial row per row: 2x the bytes of a
    bfloat16 x each)."""
    calls = _triton_kernels(op, shape, dtype, axis)
    assert {eqn.params["name"] for eqn in calls} >= {"normalize_forward_triton",
                                                    "normalize_backward_triton"}
    for eqn in calls:
        assert np.prod(eqn.params["grid_mapping"].grid) >= 2 * 132, eqn.params["name"]
    backward = next(eqn for eqn in calls if eqn.params["name"] == "normalize_backward_triton")
    partial_bytes = sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize
                        for v in backward.outvars[1:])
    necessary = 3 * np.prod(shape) * jnp.dtype(dtype).itemsize  # x and dy read, dx written
    assert partial_bytes <= 0.05 * necessary


@pytest.mark.parametrize("shape,dtype", [((4096, 8192), jnp.bfloat16), ((4096, 8192), jnp.float32),
                                         ((4096, 5000), jnp.float32),
                                         ((4096, 16384), jnp.bfloat16),
                                         ((4096, 12000), jnp.float16),
                                         ((4096, 16384), jnp.float32),
                                         ((512, 12000), jnp.float32)], ids=str)
def test_triton_backward_reads_a_row_of_up_to_16384_once(shape, dtype):
    """Issue 25, item 4: the backward of a row of up to 16384 elements is one kernel that reads
    x and dy from HBM once (3 passes: x, dy, dx), not a sums pass re-reading both first (5
    passes: rows over 4096 before). Up to 8192 a row is one chunk on 16 warps; rows up to
    16384 two chunks of 8192, each program reading the other chunk for the sums (mostly from
    L2; an estimate, not measured). `test_compile` compiles them for sm_90 and sm_80 without
    spills."""
    calls = _triton_kernels("layer_norm", shape, dtype, -1)
    backward = [eqn for eqn in calls if eqn.params["name"] != "normalize_forward_triton"]
    assert [eqn.params["name"] for eqn in backward] == ["normalize_backward_triton"]
    partial_bytes = sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize
                        for v in backward[0].outvars[1:])
    passes = 3 * np.prod(shape) * jnp.dtype(dtype).itemsize  # x and dy read, dx written
    moved = sum(eqn.params["cost_estimate"].bytes_accessed for eqn in backward)
    assert moved <= passes + partial_bytes + (1 << 20)  # + statistics and scale


@pytest.mark.parametrize("target", ["v5e", "v6e", "v4"])
@pytest.mark.parametrize("shape,dtype,axis", [
    ((1048576, 64), jnp.float32, 0), ((32, 56, 56, 256), jnp.bfloat16, (0, 1, 2)),
    ((4096, 8192), jnp.bfloat16, 0), ((8192, 8192), jnp.bfloat16, -1),
    ((64, 8, 8, 16), jnp.float32, -1), ((4096, 16), jnp.bfloat16, -1)], ids=str)
def test_mosaic_blocks_fit_the_vmem_budget(target, shape, dtype, axis):
    """Issue 10, finding 7: Mosaic blocks over leading axes come from the target's scoped
    VMEM (at most half of it for the heavier backward step), not a fixed 16384x128. Short
    rows count as VMEM holds them, 128 lanes wide: LayerNorm(16) over 4096 rows (the digits
    CNN of examples/train_digits.py) took 4096-row blocks needing 24 MiB and was declined.
    `tests/test_compile.py` compiles the device shapes with libtpu."""
    from kernels import _targets
    from kernels._pallas import on_target
    from kernels.normalize import common, mosaic

    axes = tuple(sorted(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)))
    _, (outer, groups, reduced, rows) = common.plan(shape, axes)
    p = common.Problem(outer, groups, reduced, rows, jnp.dtype(dtype), True, 1e-5, True, True)
    with on_target(_targets.TARGETS[target]):
        config = mosaic.resolve_config(p, None)
        assert mosaic.vmem_bytes(p, config) <= _targets.TARGETS[target].scoped_vmem // 2


def test_mosaic_short_rows_over_many_blocks():
    """LayerNorm(16) over 4096 rows on the Mosaic kernels (1024-row blocks, 4 grid steps),
    forward and gradients against float64 truth."""
    x, scale, offset = _inputs((4096, 16), -1, jnp.float32, seed=23)
    _check(normalize(x, scale, offset, axis=-1, implementation="mosaic"), x, scale, offset,
           axis=-1)
    grads = jax.jit(jax.grad(_loss(normalize, implementation="mosaic", axis=-1),
                             argnums=(0, 1, 2)))(x, scale, offset)
    with x64():
        want = jax.grad(_loss(reference_normalize, axis=-1), argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x, scale, offset)))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)



def _hbm_bytes(aval) -> int:
    """Bytes of an array in a TPU's HBM as XLA lays out a Mosaic call's operands (read from the
    compiled HLO for v5e): the last two dims tiled (8, 128) (16 sublanes for 16-bit types), or
    (1, 128) when the second-minor dim is 1."""
    *lead, sub, lane = (1, *aval.shape) if len(aval.shape) == 1 else aval.shape
    tile = 1 if sub == 1 else 32 // aval.dtype.itemsize
    return (int(np.prod(lead)) * -(-sub // tile) * tile * -(-lane // 128) * 128
            * aval.dtype.itemsize)


@pytest.mark.parametrize("shape", [(8192, 1024), (8192, 4096), (320, 16384)], ids=str)
def test_mosaic_statistics_are_lane_dense(shape):
    """Issue 10, finding 10: in the rows layout the saved mean and 1/std were (rows, 1) float32
    arrays, tiled 128 lanes wide in HBM: 4 MiB each at 8192 rows, written by the forward and
    read by the backward beside 16 MiB of bfloat16 x. Lane-dense, all padding together stays
    under 1% of the bytes the kernels must move."""
    from kernels import _targets
    from kernels.compile import launches

    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    scale = offset = jax.ShapeDtypeStruct(shape[-1:], jnp.bfloat16)
    loss = _loss(layer_norm, implementation="mosaic", interpret=False)
    calls = launches(jax.grad(loss, argnums=(0, 1, 2)), x, scale, offset,
                     target=_targets.TARGETS["v5e"])
    assert len(calls) == 2
    for eqn in calls:
        avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
        dense = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)
        assert sum(_hbm_bytes(a) for a in avals) <= 1.01 * dense, eqn.params["name"]


@pytest.mark.parametrize("shape,dtype,axis", [((1048576, 64), jnp.float32, 0),
                                             ((32, 56, 56, 256), jnp.bfloat16, (0, 1, 2))],
                         ids=str)
def test_mosaic_parameters_and_partials_are_lane_dense(shape, dtype, axis):
    """Issue 25, item 3: in the columns layout (batch-norm statistics over leading axes) scale,
    offset and the backward's partial dscale/doffset rows were (reduced, 1) arrays, tiled 128
    lanes wide in HBM: 512 MiB per float32 parameter at (1M, 64), 51 MiB at the ResNet batch
    norm, read or written beside a 256 MiB (25 MiB) x. Lane-dense (1, reduced) rows, each
    such operand takes at most its own bytes plus one tile."""
    from kernels import _targets
    from kernels.compile import launches

    x = jax.ShapeDtypeStruct(shape, dtype)
    param = jax.ShapeDtypeStruct(_param_shape(shape, axis), jnp.float32)
    loss = _loss(normalize, axis=axis, implementation="mosaic", interpret=False)
    calls = launches(jax.grad(loss, argnums=(0, 1, 2)), x, param, param,
                     target=_targets.TARGETS["v5e"])
    assert [eqn.params["name"] for eqn in calls] == ["normalize_forward_mosaic",
                                                     "normalize_backward_mosaic"]
    size = int(np.prod(shape))
    for eqn in calls:
        for aval in (v.aval for v in (*eqn.invars, *eqn.outvars)):
            if int(np.prod(aval.shape)) == size:
                continue  # x, dy, y, dx: laid out as the caller's array is
            dense = int(np.prod(aval.shape)) * aval.dtype.itemsize
            assert _hbm_bytes(aval) <= dense + 8 * 128 * 4, (eqn.params["name"], aval)


@pytest.mark.parametrize("shape,dtype,axis,lane_padding", [
    ((1048576, 64), jnp.float32, 0, 2), ((32, 56, 56, 256), jnp.bfloat16, (0, 1, 2), 1)],
    ids=["1Mx64", "batch_norm"])
def test_mosaic_cost_estimate_counts_the_tiles_blocks_move(shape, dtype, axis, lane_padding):
    """Issue 25, item 3: a Mosaic call's stated bytes (`_traffic.pipelined_bytes`, the design
    figures' source) count whole HBM tiles. The (1M, 64) standardization over axis 0 has its
    64 groups on the lanes, half of each 128-lane tile, so every pass of x moves twice its
    bytes: 6x x's bytes for its 3 passes (two phases: x read twice, y written), where the
    estimate said 3x. The batch norm's 256 channels fill whole tiles: 3x."""
    from kernels import _targets
    from kernels.compile import launches

    x = jax.ShapeDtypeStruct(shape, dtype)
    (forward,) = launches(lambda x: normalize(x, axis=axis, implementation="mosaic",
                                              interpret=False), x,
                          target=_targets.TARGETS["v5e"])
    phases = forward.params["grid_mapping"].grid[2]
    passes = phases + 1  # x read in each phase, y written once
    x_bytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    moved = forward.params["cost_estimate"].bytes_accessed
    assert passes == 3
    assert passes * lane_padding * x_bytes <= moved <= passes * lane_padding * x_bytes + (1 << 20)


@pytest.mark.parametrize("target,ranges", [("v5e", 1), ("v4", 2)])
@pytest.mark.parametrize("shape,axis,blocks", [((4096, 8192), -1, 256), ((1024, 65536), 0, 512)],
                         ids=["layer_norm_4096x8192", "columns_1024x65536"])
def test_mosaic_partial_rows_accumulate_across_group_blocks(target, ranges, shape, axis,
                                                            blocks):
    """Issue 25, item 3: the backward wrote a float32 dscale and doffset row per group block,
    which XLA read back to sum: at 4096x8192 bfloat16 (16-row blocks) 256 rows, 8 MiB per
    parameter each way beside the 192 MiB the kernel must move (x, dy, dx). Now a core walks
    its range of blocks in order and adds their column sums into one row in VMEM: one row per
    TensorCore, written once."""
    from kernels import _targets
    from kernels.compile import launches

    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    param = jax.ShapeDtypeStruct(_param_shape(shape, axis), jnp.float32)
    loss = _loss(normalize, axis=axis, implementation="mosaic", interpret=False)
    _, backward = launches(jax.grad(loss, argnums=(0, 1, 2)), x, param, param,
                           target=_targets.TARGETS[target])
    assert backward.params["name"] == "normalize_backward_mosaic"
    num_partials, blocks_per_range, phases, _ = backward.params["grid_mapping"].grid
    assert (num_partials, phases) == (ranges, 1)
    assert blocks_per_range * ranges == blocks
    reduced = _group_size(shape, axis)
    assert [v.aval.shape for v in backward.outvars[1:]] == [(ranges, 1, reduced)] * 2


@pytest.mark.parametrize("shape,axis,config", [
    ((40, 130), -1, NormalizeConfig(block_groups=8, block_reduced=130)),
    ((20, 300), 0, NormalizeConfig(block_groups=128, block_reduced=20))], ids=["rows", "columns"])
@pytest.mark.parametrize("target", ["v5e", "v4"])
def test_mosaic_partial_rows_across_ranges(target, shape, axis, config):
    """The accumulated dscale/doffset rows in TPU interpret mode, against float64 truth: v5e
    adds all group blocks into one row; the megacore v4 cuts them into 2 ranges, the second
    short (rows: 5 whole blocks as 3 + 2; columns: 3 as 2 + 1, the last ragged), so its extra
    step repeats the last block, which must add nothing."""
    from kernels import _targets
    from kernels._pallas import on_target

    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=31)
    loss = _loss(normalize, axis=axis, implementation="mosaic", config=config,
                 interpret="strict")
    with on_target(_targets.TARGETS[target]):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, offset)
    with x64():
        want = jax.grad(_loss(reference_normalize, axis=axis), argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x, scale, offset)))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def test_mosaic_statistics_of_ragged_row_blocks_second_order():
    """Lane-dense statistics of 37 rows in blocks of 8 (the last block ragged) carry the
    second-order cotangents back into the backward kernel: grad of grad against the
    reference's."""
    x, scale, offset = _inputs((37, 40), -1, jnp.float32, seed=29)
    config = NormalizeConfig(block_groups=8, block_reduced=40)

    def hessian_vector(fn, **kw):
        inner = jax.grad(_loss(fn, axis=-1, **kw), argnums=(0, 1, 2))
        return jax.jit(jax.grad(lambda x, s, o: sum(jnp.sum(jnp.tanh(g)) for g in inner(x, s, o)),
                                argnums=(0, 1, 2)))

    got = hessian_vector(normalize, implementation="mosaic", config=config)(x, scale, offset)
    want = hessian_vector(reference_normalize)(x, scale, offset)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.float32, reduction_length=x.size)

def _large_mean(shape):
    return jnp.asarray((1e4 + np.random.default_rng(6).standard_normal(shape)).astype(np.float32))


@pytest.mark.parametrize("shape,axis", [((64, 1000), -1), ((1000, 16), 0)], ids=str)
def test_large_mean_small_spread(implementation, shape, axis):
    """1e4 + N(0, 1): E[x²] - E[x]² would cancel catastrophically (float32 holds 1e8 to within
    8); the mean-first statistics keep the error at float32's resolution of the data."""
    x = _large_mean(shape)
    y = normalize(x, axis=axis, implementation=implementation)
    expected = _ground_truth(x, axis=axis)
    # The inputs' magnitude is 1e4 times their spread: the mean (and so y) can be no more
    # accurate than float32's roundings of 1e4-sized partial sums, so the tolerance scales by
    # that ratio; the sums are trees, log2(n) roundings deep. (E[x²] - E[x]² gives NaN here.)
    condition = float(jnp.max(jnp.abs(x))) / float(np.std(as_f64(x)))
    depth = int(np.ceil(np.log2(_group_size(shape, axis))))
    tol = tolerance(jnp.float32, reduction_length=depth)
    chex.assert_trees_all_close(as_f64(y), expected, rtol=tol["rtol"],
                                atol=tol["atol"] * condition)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape,axis", [((6, 40), -1), ((40, 6), 0)], ids=str)
def test_constant_groups_with_zero_epsilon(implementation, subtract_mean, shape, axis):
    """Constant groups have var = 0: with epsilon = 0 the reference gives 0·inf = NaN (layer
    norm) or x/|x| (RMS, NaN for all-zero groups); the kernels give NaN exactly there."""
    x = np.array(random(shape, jnp.float32, 7))
    if axis == -1:
        x[1], x[4] = 3.0, 0.0
    else:
        x[:, 1], x[:, 4] = 3.0, 0.0
    x = jnp.asarray(x)
    kwargs = dict(axis=axis, epsilon=0.0, subtract_mean=subtract_mean)
    y = normalize(x, implementation=implementation, **kwargs)
    want = reference_normalize(x, **kwargs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    assert np.isnan(want).any()
    finite = ~np.isnan(want)
    assert_close(np.asarray(y)[finite], _ground_truth(x, **kwargs)[finite], jnp.float32,
                 reduction_length=40)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nan_and_inf_propagate(implementation, subtract_mean, axis):
    x = random((9, 20), jnp.float32, 8).at[2, 3].set(jnp.nan).at[5, 7].set(jnp.inf)
    x = x.at[7, 11].set(-jnp.inf)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    y = normalize(x, implementation=implementation, **kwargs)
    want = reference_normalize(x, **kwargs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    finite = np.isfinite(want)
    assert_close(np.asarray(y)[finite], np.asarray(want)[finite], jnp.float32,
                 reduction_length=20)


def test_float64(implementation):
    with x64():
        x, scale, offset = _inputs((33, 250), -1, jnp.float64, seed=9,
                                   param_dtype=jnp.float64)
        if not SUPPORTS_FLOAT64[implementation]:
            with pytest.raises(NotImplementedError, match=f"{implementation}: float64"):
                normalize(x, scale, offset, implementation=implementation)
            return
        for axis in (-1, 0):
            x, scale, offset = _inputs((33, 250), axis, jnp.float64, seed=9,
                                       param_dtype=jnp.float64)
            y = normalize(x, scale, offset, axis=axis, implementation=implementation)
            _check(y, x, scale, offset, axis=axis)


def test_declining_kernel_falls_through_to_xla():
    with x64():
        x = random((8, 9), jnp.float64, 1)
        y = normalize(x, implementation=("mosaic", "xla"))
        _check(y, x, None, None, axis=-1)


@pytest.mark.parametrize("x_dtype,param_dtype", [(jnp.float32, jnp.bfloat16),
                                                 (jnp.float16, jnp.bfloat16)],
                         ids=["f32-bf16", "f16-bf16"])
def test_parameter_dtypes(implementation, x_dtype, param_dtype):
    """The output has x's dtype whatever scale's; scale's gradient has scale's dtype."""
    x, scale, offset = _inputs((12, 50), -1, x_dtype, seed=10, param_dtype=param_dtype)
    y = normalize(x, scale, offset, implementation=implementation)
    _check(y, x, scale, offset, axis=-1)
    loss = lambda s: jnp.sum(normalize(x, s, offset, implementation=implementation)
                             .astype(jnp.float32))
    assert jax.grad(loss)(scale).dtype == scale.dtype


def test_empty(implementation):
    for shape, axis in (((0, 5), -1), ((5, 0), -1), ((2, 0, 3), (0, 2))):
        x = jnp.zeros(shape)
        fn = jax.jit(lambda x: normalize(x, axis=axis, implementation=implementation))
        chex.assert_shape(fn(x), shape)
        chex.assert_shape(jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))(x), shape)


def test_aliases(implementation):
    x, scale, offset = _inputs((7, 90), -1, jnp.float32, seed=11)
    y = layer_norm(x, scale, offset, implementation=implementation)
    _check(y, x, scale, offset, axis=-1, epsilon=1e-5)
    y = rms_norm(x, scale, implementation=implementation)
    _check(y, x, scale, None, axis=-1, epsilon=1e-6, subtract_mean=False)
    chex.assert_trees_all_close(reference_layer_norm(x, scale, offset),
                                reference_normalize(x, scale, offset))
    chex.assert_trees_all_close(reference_rms_norm(x, scale),
                                reference_normalize(x, scale, epsilon=1e-6, subtract_mean=False))


def test_reference_is_the_tutorials_standardization():
    x = np.random.default_rng(12).standard_normal((500, 30)) * 3 + 5
    want = (x - x.mean(0)) / x.std(0)
    with x64():
        np.testing.assert_allclose(reference_normalize(jnp.asarray(x), axis=0, epsilon=0), want,
                                   rtol=1e-12, atol=1e-12)
    assert_close(reference_normalize(jnp.asarray(x, jnp.float32), axis=0, epsilon=0), want,
                 jnp.float32, reduction_length=500)


def test_vmap(implementation):
    x, scale, offset = _inputs((4, 17, 40), -1, jnp.float32, seed=14)
    fn = lambda x, s, o: normalize(x, s, o, implementation=implementation)
    _check(jax.vmap(fn, in_axes=(0, None, None))(x, scale, offset), x, scale, offset, axis=-1)
    # Batching over the last axis: each batch member of shape (4, 17) normalizes its columns.
    y = jax.vmap(lambda x: normalize(x, axis=0, implementation=implementation), in_axes=2,
                 out_axes=2)(x)
    _check(y, x, None, None, axis=0)


# jit and eager, no retrace, vmap of every operand: tests/test_contract.py, from this contract.
CONTRACT = Contract(
    call=lambda impl: lambda x, s=None, o=None: normalize(x, s, o, implementation=impl),
    example=lambda: _inputs((37, 130), -1, jnp.bfloat16, seed=13),
    repeated=lambda seed: (random((12, 20), jnp.float32, seed),),
    check=lambda y, x, s=None, o=None: _check(y, x, s, o, axis=-1))


def test_bitwise_identical_on_repeated_runs(implementation):
    x, scale, offset = _inputs((70, 300), -1, jnp.float32, seed=15)
    fn = jax.jit(jax.value_and_grad(lambda x, s, o: jnp.sum(jnp.sin(normalize(
        x, s, o, implementation=implementation))), argnums=(0, 1, 2)))
    first = jax.tree.map(np.asarray, fn(x, scale, offset))
    for _ in range(2):
        chex.assert_trees_all_equal(first, jax.tree.map(np.asarray, fn(x, scale, offset)))


def _loss(fn, **kwargs):
    return lambda x, s, o: jnp.sum(jnp.sin(fn(x, s, o, **kwargs)) * jnp.cos(x))


@pytest.mark.parametrize("shape,axis,subtract_mean", [
    ((13, 70), -1, True), ((13, 70), -1, False), ((70, 13), 0, True), ((4, 5, 6), (0, 2), False),
    ((3, 4, 10), (1, 2), True)], ids=str)
def test_gradients_match_reference(implementation, shape, axis, subtract_mean):
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=16)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    grads = jax.jit(jax.grad(_loss(normalize, implementation=implementation, **kwargs),
                             argnums=(0, 1, 2)))(x, scale, offset)
    want = jax.jit(jax.grad(_loss(reference_normalize, **kwargs), argnums=(0, 1, 2)))(
        x, scale, offset)
    for got, expected in zip(grads, want):
        chex.assert_equal_shape([got, expected])
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def test_gradients_without_parameters(implementation):
    x = random((9, 33), jnp.float32, 17)
    got = jax.grad(lambda x: _loss(normalize, implementation=implementation)(x, None, None))(x)
    want = jax.grad(lambda x: _loss(reference_normalize)(x, None, None))(x)
    assert_close(got, want, jnp.float32, reduction_length=33)


def test_gradients_bfloat16(implementation):
    x, scale, offset = _inputs((24, 64), -1, jnp.bfloat16, seed=18, param_dtype=jnp.bfloat16)
    # A linear loss: its cotangent does not depend on the (bfloat16-rounded) output.
    # bfloat16-representable, so the cotangent reaching the kernel (cast to y's dtype) is exact.
    weights = random(x.shape, jnp.bfloat16, seed=21).astype(jnp.float32)
    loss = lambda f, **kw: lambda x, s, o: jnp.sum(
        f(x, s, o, **kw).astype(jnp.float32) * weights)
    grads = jax.grad(loss(normalize, implementation=implementation), argnums=(0, 1, 2))(
        x, scale, offset)
    with x64():  # JAX's gradient of the reference in float64: the ground truth.
        want = jax.grad(loss(reference_normalize), argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x, scale, offset)))
    for got, expected, primal in zip(grads, want, (x, scale, offset)):
        assert got.dtype == primal.dtype
        assert_close(got, expected, jnp.bfloat16, reduction_length=64)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=lambda d: jnp.dtype(d).name)
def test_triton_backward_sums_two_chunks_in_program(dtype, subtract_mean):
    """Rows of two chunks (200 = 128 + a ragged 72 here; 16384 = 2 x 8192 on a GPU): each
    backward program sums both chunks of its groups itself, in half-chunk tiles (64, 64, 64
    and a ragged 8 here), no sums pass; gradients against float64 truth."""
    from kernels.compile import launches
    from kernels import _targets

    config = NormalizeConfig(block_groups=16, block_reduced=128)
    x, scale, offset = _inputs((20, 200), -1, dtype, seed=37, param_dtype=dtype)
    weights = random(x.shape, dtype, seed=38).astype(jnp.float32)
    kwargs = dict(axis=-1, subtract_mean=subtract_mean)
    loss = lambda f, **kw: lambda x, s, o: jnp.sum(
        f(x, s, o, **kwargs, **kw).astype(jnp.float32) * weights)
    kernel_loss = loss(normalize, implementation="triton", config=config)
    names = [eqn.params["name"] for eqn in launches(
        jax.grad(kernel_loss, argnums=(0, 1, 2)), x, scale, offset,
        target=_targets.DEFAULT["gpu"])]
    assert "normalize_backward_triton" in names and "normalize_sums_triton" not in names
    grads = jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2)))(x, scale, offset)
    with x64():
        want = jax.grad(loss(reference_normalize), argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x, scale, offset)))
    for got, expected in zip(grads, want):
        assert_close(got, expected, dtype, reduction_length=200)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
def test_grad_of_grad(implementation, subtract_mean):
    x, scale, offset = _inputs((5, 24), -1, jnp.float32, seed=19)
    kwargs = dict(subtract_mean=subtract_mean)

    def hessian_vector(fn, **kw):
        inner = jax.grad(_loss(fn, **kwargs, **kw), argnums=(0, 1, 2))
        return jax.jit(jax.grad(lambda x, s, o: sum(jnp.sum(jnp.tanh(g)) for g in inner(x, s, o)),
                                argnums=(0, 1, 2)))

    got = hessian_vector(normalize, implementation=implementation)(x, scale, offset)
    want = hessian_vector(reference_normalize)(x, scale, offset)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.float32, reduction_length=x.size)


@pytest.mark.parametrize("target", ["sm_90", "v5e"])
def test_first_order_backward_reads_no_statistics_cotangents(target):
    """The public functions return y alone, so the cotangents of the saved mean and 1/std are
    zero at first order: the backward kernel takes x, scale, mean, rstd and dy only (a
    materialized zero pair was padded to 128 lanes on a TPU). Grad of grad, whose cotangents
    reach the statistics, passes them (7 operands)."""
    from kernels import _targets
    from kernels.compile import implementation_for, launches

    implementation = implementation_for(target)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    scale = offset = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    loss = _loss(layer_norm, implementation=implementation, interpret=False)
    target = _targets.TARGETS[target]

    def backward_operands(fn):
        return [len(eqn.invars) for eqn in launches(fn, x, scale, offset, target=target)
                if "backward" in eqn.params["name"]]

    assert backward_operands(jax.grad(loss)) == [5]
    second_order = jax.grad(lambda x, s, o: jnp.sum(jax.grad(loss)(x, s, o) ** 2))
    assert 7 in backward_operands(second_order)


@pytest.mark.parametrize("implementation", [i for i in ("xla", "triton")
                                            if SUPPORTS_FLOAT64[i]])
@pytest.mark.parametrize("shape,axis,subtract_mean,order", [
    ((4, 9), -1, True, 2), ((4, 9), -1, False, 2), ((9, 4), 0, True, 1),
    ((3, 4, 5), (0, 2), False, 1)], ids=str)
def test_finite_differences_float64(implementation, shape, axis, subtract_mean, order):
    """Gradients (order 1) and gradients of gradients (order 2) against finite differences."""
    with x64():
        x, scale, offset = _inputs(shape, axis, jnp.float64, seed=20, param_dtype=jnp.float64)
        fn = jax.jit(lambda x, s, o: normalize(x, s, o, axis=axis, subtract_mean=subtract_mean,
                                               implementation=implementation))
        check_grads(fn, (x, scale, offset), order=order, modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,axis,config", [
    ((8192, 1024), -1, None), ((2, 65536), -1, None), ((10000, 100), 0, None),
    ((4, 6, 5), (0, 2), None), ((20, 300), -1, "chunked")], ids=_case_id)
def test_lowers_for_the_platform(implementation, dtype, shape, axis, config):
    if config == "chunked":
        config = _chunked_config(implementation, CHUNKED[0][2])
    x = jnp.ones(shape, dtype)
    scale = jnp.ones(_param_shape(shape, axis), jnp.float32)

    def forward(x, s):
        return normalize(x, s, s, axis=axis, implementation=implementation, interpret=False,
                         config=config)

    assert_lowers(forward, x, scale, implementation=implementation)
    backward = jax.grad(lambda x, s: jnp.sum(forward(x, s).astype(jnp.float32)),
                        argnums=(0, 1))
    assert_lowers(backward, x, scale, implementation=implementation, min_kernels=2)


def test_triton_lowers_float64():
    with x64():
        x, scale = jnp.ones((64, 300), jnp.float64), jnp.ones(300, jnp.float64)
        forward = lambda x, s: normalize(x, s, s, implementation="triton", interpret=False)
        assert_lowers(forward, x, scale, implementation="triton")
        backward = jax.grad(lambda x, s: jnp.sum(forward(x, s)), argnums=(0, 1))
        assert_lowers(backward, x, scale, implementation="triton", min_kernels=2)


@pytest.mark.parametrize("call,error,match", [
    (lambda impl: normalize(jnp.ones((4, 5)), jnp.ones(4), implementation=impl), ValueError,
     r"scale must have the shape of the normalized axes \(5,\).*got shape \(4,\)"),
    (lambda impl: normalize(jnp.ones((4, 5)), None, jnp.ones((1, 5)), implementation=impl),
     ValueError, r"offset must have the shape"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=2, implementation=impl), ValueError,
     "axis 2 is out of range for x of rank 2"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=(-3,), implementation=impl), ValueError,
     "axis -3 is out of range"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=(1, -1), implementation=impl), ValueError,
     "repeats an axis"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=1.0, implementation=impl), TypeError,
     "axis must be an int or a tuple of ints"),
    (lambda impl: normalize(jnp.ones((4, 5), jnp.int32), implementation=impl), TypeError,
     "x must have a floating-point dtype, got int32"),
    (lambda impl: normalize(jnp.ones((4, 5)), jnp.ones(5, jnp.int32), implementation=impl),
     TypeError, "scale must have a floating-point dtype"),
    (lambda impl: normalize(jnp.ones((4, 5)), epsilon=-1e-5, implementation=impl), ValueError,
     "epsilon must be >= 0, got -1e-05"),
    (lambda impl: normalize(jnp.ones((4, 5)), epsilon=float("nan"), implementation=impl),
     ValueError, "epsilon must be >= 0"),
    (lambda impl: normalize(jnp.ones((4, 5)), subtract_mean="yes", implementation=impl),
     TypeError, "subtract_mean must be True or False"),
    (lambda impl: rms_norm(jnp.ones((4, 5)), epsilon=-1.0, implementation=impl), ValueError,
     "rms_norm: epsilon must be >= 0"),
    (lambda impl: layer_norm(jnp.ones(()), implementation=impl), ValueError,
     "layer_norm: axis -1 is out of range for x of rank 0"),
    (lambda impl: normalize(jnp.ones((4, 5)), implementation=impl, config=(8, 128)), TypeError,
     "config must be a NormalizeConfig"),
])
def test_bad_input(implementation, call, error, match):
    with pytest.raises(error, match=match):
        call(implementation)


def test_bad_input_under_jit_raises_before_tracing_a_kernel():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        jax.jit(lambda x: normalize(x, epsilon=-1.0, implementation="triton"))(jnp.ones((3, 4)))
    with pytest.raises(TypeError, match="epsilon must be a concrete real number"):
        jax.jit(lambda x, e: normalize(x, epsilon=e, implementation="triton"))(
            jnp.ones((3, 4)), 1e-5)


@pytest.mark.parametrize("implementation,config,match", [
    ("triton", NormalizeConfig(block_reduced=100), "config.block_reduced must be a power of 2"),
    ("triton", NormalizeConfig(block_groups=3), "config.block_groups must be a power of 2"),
    ("triton", NormalizeConfig(num_partials=0), "config.num_partials must be a positive int"),
    ("mosaic", NormalizeConfig(block_reduced=100), "config.block_reduced=100 breaks TPU tiling"),
    ("mosaic", NormalizeConfig(block_groups=12), "config.block_groups=12 breaks TPU tiling"),
])
def test_bad_config(implementation, config, match):
    with pytest.raises(ValueError, match=match):
        normalize(jnp.ones((40, 300)), implementation=implementation, config=config)


# ----------------------------------------------------------------------------- the fused
# residual add and output dtype (issue 25, item 1)

# Rows (one chunk, a ragged 5000-element row, several rows per block), the columns layout and
# several or non-contiguous normalized axes.
RESIDUAL_CASES = [((3, 7), -1), ((129, 1000), -1), ((3, 5000), -1), ((300, 20), 0),
                  ((3, 5, 33), (1, 2)), ((4, 9, 6), (0, 2))]


def _residual_inputs(shape, axis, dtype, seed):
    x, scale, offset = _inputs(shape, axis, dtype, seed=seed)
    return x, random(shape, dtype, seed + 3), scale, offset


def _check_residual(y, total, x, residual, scale, offset, **kwargs):
    """The sum is XLA's own `x + residual` in x's dtype, bit for bit; y is within the tolerance
    of float64 truth normalizing the exact sum (the sum is normalized unrounded)."""
    assert total.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(total, np.float64),
                                  np.asarray(x + residual, np.float64))
    with x64():
        args = [None if a is None else jnp.asarray(as_f64(a)) for a in (x, scale, offset)]
        expected, _ = reference_normalize(*args, residual=jnp.asarray(as_f64(residual)),
                                          **kwargs)
    assert y.dtype == x.dtype
    assert_close(y, np.asarray(expected), x.dtype,
                 reduction_length=_group_size(x.shape, kwargs["axis"]))


@pytest.mark.parametrize("shape,axis", RESIDUAL_CASES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_residual_matches_float64_ground_truth(implementation, shape, axis, dtype):
    """`(normalize(x + residual), x + residual)` against float64 truth (`_check_residual`)."""
    subtract_mean = len(shape) != 3  # RMS for the 3-D cases
    x, residual, scale, offset = _residual_inputs(shape, axis, dtype, seed=40)
    y, total = normalize(x, scale, offset, axis=axis, subtract_mean=subtract_mean,
                         residual=residual, implementation=implementation)
    _check_residual(y, total, x, residual, scale, offset, axis=axis,
                    subtract_mean=subtract_mean)


def _residual_loss(fn, use_sum=True, **kwargs):
    """Linear in both outputs (see `weighted_sum`), so the gradients carry only the backward's
    rounding; `use_sum=False` leaves the sum unused (its cotangent is a symbolic zero)."""
    def loss(x, r, s, o):
        y, total = fn(x, s, o, residual=r, **kwargs)
        return weighted_sum(y) + (weighted_sum(total[::-1]) if use_sum else 0.0)
    return loss


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("use_sum", [True, False], ids=["sum_used", "sum_unused"])
@pytest.mark.parametrize("shape,axis,subtract_mean,config", [
    ((13, 70), -1, True, None), ((70, 13), 0, False, None),
    # Two chunks: the backward's programs sum both, and add dsum where dx is written.
    ((20, 200), -1, True, NormalizeConfig(block_groups=16, block_reduced=128))], ids=_case_id)
def test_residual_gradients_match_float64_truth(implementation, dtype, use_sum, shape, axis,
                                                subtract_mean, config):
    """dx = dresidual = the normalization's input gradient plus the sum's cotangent; scale and
    offset gradients too, against JAX's float64 gradient of the reference.

    The backward saves one array, the sum as the forward returned it, rounded to x's dtype (as
    a model saving its residual stream does, and as flash-attention's fused add-norm does),
    with the statistics of the unrounded sum. That rounding reaches every gradient, so it is
    counted: the tolerance adds twice what it changes the float64 truth by (the truth at the
    rounded sum against the truth at the exact one; nil for float32 data)."""
    x, residual, scale, offset = _residual_inputs(shape, axis, dtype, seed=42)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    blocks = {} if config is None or implementation == "xla" else dict(
        config=_chunked_config(implementation, config))
    grads = jax.jit(jax.grad(_residual_loss(normalize, use_sum, implementation=implementation,
                                            **blocks, **kwargs), argnums=(0, 1, 2, 3)))(
        x, residual, scale, offset)

    def at_the_sum(total, s, o):
        y = reference_normalize(total, s, o, **kwargs)
        return weighted_sum(y) + (weighted_sum(total[::-1]) if use_sum else 0.0)

    with x64():
        exact = jax.grad(_residual_loss(reference_normalize, use_sum, **kwargs),
                         argnums=(0, 1, 2, 3))(*(jnp.asarray(as_f64(a))
                                                 for a in (x, residual, scale, offset)))
        dtotal, dscale, doffset = jax.grad(at_the_sum, argnums=(0, 1, 2))(
            *(jnp.asarray(as_f64(a)) for a in (x + residual, scale, offset)))
    for got, want, at_rounded, primal in zip(grads, exact, (dtotal, dtotal, dscale, doffset),
                                             (x, residual, scale, offset)):
        assert got.dtype == primal.dtype
        rule = tolerance(primal.dtype, reduction_length=x.size)
        sum_rounding = 2 * float(np.max(np.abs(np.asarray(at_rounded) - np.asarray(want))))
        chex.assert_trees_all_close(np.asarray(got, np.float64), np.asarray(want),
                                    rtol=rule["rtol"], atol=rule["atol"] + sum_rounding)


@pytest.mark.parametrize("implementation,shape,axis,config",
                         [(name, *case) for name in KERNELS for case in CHUNKED]
                         + [("triton", *case[:3]) for case in TRITON_SCHEDULES[1:]],
                         ids=_case_id)
def test_residual_over_chunks_and_splits(implementation, shape, axis, config):
    """Groups longer than a block: the sum is written once per chunk by the pass that writes
    y (Triton's looped chunks and its split normalize pass; Mosaic's phase 1), and dsum is
    added where dx is written."""
    config = _chunked_config(implementation, config)
    x, residual, scale, offset = _residual_inputs(shape, axis, jnp.float32, seed=43)

    def loss(fn, **kw):
        def with_outputs(x, r, s, o):
            y, total = fn(x, s, o, axis=axis, residual=r, **kw)
            return weighted_sum(y) + weighted_sum(total[::-1]), (y, total)
        return jax.jit(jax.grad(with_outputs, argnums=(0, 1, 2, 3), has_aux=True))

    grads, (y, total) = loss(normalize, implementation=implementation, config=config)(
        x, residual, scale, offset)
    _check_residual(y, total, x, residual, scale, offset, axis=axis)
    want, _ = loss(reference_normalize)(x, residual, scale, offset)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


def test_residual_grad_of_grad(implementation):
    x, residual, scale, offset = _residual_inputs((5, 24), -1, jnp.float32, seed=44)

    def hessian_vector(fn, **kw):
        def loss(x, r, s, o):
            y, total = fn(x, s, o, residual=r, **kw)
            return jnp.sum(jnp.sin(y) * jnp.cos(x)) + jnp.sum(jnp.sin(total))
        inner = jax.grad(loss, argnums=(0, 1, 2, 3))
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.tanh(g)) for g in inner(*a)),
                                argnums=(0, 1, 2, 3)))

    got = hessian_vector(layer_norm, implementation=implementation)(x, residual, scale, offset)
    want = hessian_vector(reference_layer_norm)(x, residual, scale, offset)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.float32, reduction_length=x.size)


@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.bfloat16, jnp.float32),
                                               (jnp.float32, jnp.bfloat16),
                                               (jnp.float16, jnp.bfloat16)], ids=str)
def test_out_dtype(implementation, x_dtype, out_dtype):
    """y is rounded once, to out_dtype (not to x's dtype first); dx keeps x's dtype."""
    x, scale = _inputs((33, 200), -1, x_dtype, seed=45)[:2]
    y = rms_norm(x, scale, out_dtype=out_dtype, implementation=implementation)
    assert y.dtype == jnp.dtype(out_dtype)
    want = _ground_truth(x, scale, None, axis=-1, subtract_mean=False, epsilon=1e-6)
    assert_close(y, want, out_dtype, reduction_length=200)
    loss = lambda f, **kw: lambda x, s: weighted_sum(f(x, s, out_dtype=out_dtype, **kw))
    grads = jax.grad(loss(rms_norm, implementation=implementation), argnums=(0, 1))(x, scale)
    with x64():
        want = jax.grad(loss(reference_rms_norm), argnums=(0, 1))(
            jnp.asarray(as_f64(x)), jnp.asarray(as_f64(scale)))
    for got, expected, primal in zip(grads, want, (x, scale)):
        assert got.dtype == primal.dtype
        assert_close(got, expected, primal.dtype, reduction_length=200)


@pytest.mark.parametrize("implementation,target", [("triton", "sm_90"), ("mosaic", "v5e")])
@pytest.mark.parametrize("use_sum", [True, False], ids=["sum_used", "sum_unused"])
def test_fused_residual_moves_each_array_once(implementation, target, use_sum):
    """Issue 25, item 1, at a transformer's pre-norm (8192 tokens x 1024, bfloat16): one
    forward kernel reads x and the residual and writes y and the sum (4 passes; XLA adding
    them first and a kernel normalizing costs 5), one backward kernel reads the sum, dy and
    dsum (when the sum is used) and writes dx, which is both x's and the residual's gradient
    (4 passes, not a kernel's 3 plus XLA's 3 adding dsum). Nothing else in the program touches
    an array of that size: no add, cast or copy outside the kernels."""
    from kernels import _targets
    from kernels._pallas import on_target
    from kernels.compile import launches
    from kernels.compile.launches import equations

    shape, dtype = (8192, 1024), jnp.bfloat16
    size = np.prod(shape)
    spec, param = jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((1024,), jnp.float32)
    loss = jax.grad(_residual_loss(layer_norm, use_sum, implementation=implementation,
                                   interpret=False), argnums=(0, 1, 2, 3))
    calls = launches(loss, spec, spec, param, param, target=_targets.TARGETS[target])
    assert [eqn.params["name"] for eqn in calls] == [f"normalize_forward_{implementation}",
                                                     f"normalize_backward_{implementation}"]
    forward, backward = calls
    array = size * jnp.dtype(dtype).itemsize
    assert [np.prod(v.aval.shape) for v in forward.invars][:2] == [size, size]
    view_operands = [v for v in backward.invars if np.prod(v.aval.shape) == size]
    assert len(view_operands) == 3 if use_sum else 2  # the sum, dy (and dsum)
    small = 1 << 20  # statistics, parameters, partial dscale/doffset rows
    assert 4 * array <= forward.params["cost_estimate"].bytes_accessed <= 4 * array + small
    partial_rows = sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize
                       for v in backward.outvars[1:])
    backward_passes = (4 if use_sum else 3) * array
    assert backward.params["cost_estimate"].bytes_accessed <= backward_passes + partial_rows + small

    def full_size_work(fn):
        with on_target(_targets.TARGETS[target]):
            jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(spec, spec, param,
                                                                        param).jaxpr
        return {eqn.primitive.name for eqn in equations(jaxpr)
                if any(np.prod(v.aval.shape) == size for v in eqn.outvars)}

    def unfused(x, s, o, residual, **kw):  # what a model without the fused op runs
        return layer_norm(x + residual, s, o, **kw), x + residual

    # The loss's own work on y and the sum (weights, casts, reversal) and the containers.
    loss_work = {"mul", "rev", "convert_element_type", "broadcast_in_dim", "reshape", "jit",
                 "pjit", "custom_vjp_call", "pallas_call"}
    assert full_size_work(_residual_loss(layer_norm, use_sum, implementation=implementation,
                                         interpret=False)) <= loss_work
    assert "add" in full_size_work(_residual_loss(unfused, use_sum,
                                                  implementation=implementation,
                                                  interpret=False))
