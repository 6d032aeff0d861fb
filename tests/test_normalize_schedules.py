"""normalize's kernel schedules, checked on the kernels the ops launch: Triton's programs against an
H100, Mosaic's blocks against each TPU's VMEM, lane-dense statistics and partial rows, what each
pass reads, and lowering for each platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.normalize import NormalizeConfig, layer_norm, normalize
from kernels.reference.normalize import normalize as reference_normalize
from tests.support import as_f64, assert_close, assert_lowers, kernels_of, random, weighted_sum, x64

KERNELS = kernels_of("normalize")  # this op's kernels (`tests.support.implementations_of`)
from tests.test_normalize import (CHUNKED, TRITON_SCHEDULES, _case_id, _check, _chunked_config,
                                  _group_size, _inputs, _loss, _param_shape)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


def _triton_schedule(shape, axis, config):
    from kernels.normalize import common, triton

    axes = tuple(sorted(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)))
    _, (outer, groups, reduced, rows) = common.plan(shape, axes)
    p = common.Problem(outer, groups, reduced, rows, jnp.dtype(jnp.float32), True, 1e-5, True,
                       True)
    return triton.schedule_of(p, triton.resolve_config(p, config))


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
    passes: rows over 4096 before). Up to 4096 a row is one chunk; rows up to 8192 two chunks
    of 4096 (`config._BACKWARD_MAX_CHUNK`), up to 16384 two of 8192, each program reading the
    other chunk for the sums (mostly from L2; an estimate, not measured). `test_compile`
    compiles them for sm_90 and sm_80 without spills, two CTAs an SM at the bench's shapes."""
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
