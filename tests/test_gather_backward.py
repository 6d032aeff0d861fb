"""gather's gradients for every registered implementation (the scatter-add kernels, against
NumPy's `np.add.at` in float64), the kernels' schedules (Triton's scatter-add pieces, Mosaic's DMA
ring), and lowering for each platform, forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from kernels.gather import gather
from kernels.reference.gather import gather as reference_gather
from tests.support import assert_close, assert_lowers, kernels_of, random, x64

KERNELS = kernels_of("gather")  # this op's kernels (`tests.support.implementations_of`)
from tests.test_gather import (MODES, SPECIAL_INDICES, _ids, assert_exact, expected_gather,
                               expected_gradient)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


# ---------------------------------------------------------------- gradients


def _gradient_case(implementation, mode, dtype=jnp.float32, axis=1):
    x = random((3, 10, 4), dtype, seed=13)
    indices = jnp.asarray([[3, 3, -1, 10], [-11, 0, 9, 3], [2**31 - 1, -2**31, 11, -10]],
                          jnp.int32)
    out_shape = x.shape[:axis] + indices.shape + x.shape[axis + 1:]
    ct = random(out_shape, dtype, seed=14)

    def vjp(fn):
        _, pullback = jax.vjp(lambda x: fn(x, indices, axis=axis, mode=mode), x)
        return pullback(ct)[0]

    dx = vjp(functools.partial(gather, implementation=implementation))
    return x, indices, ct, dx, vjp(reference_gather)


@pytest.mark.parametrize("mode", MODES, ids=_ids)
def test_gradients_match_jax(implementation, mode):
    x, indices, ct, dx, dx_reference = _gradient_case(implementation, mode)
    assert_close(dx, expected_gradient(x.shape, ct, indices, 1, mode), jnp.float32,
                 reduction_length=4)
    assert_close(dx, dx_reference, jnp.float32, reduction_length=4)


def test_gradient_matches_jax_of_at_get(implementation):
    """Against JAX's own gradients of `x.at[i].get(mode)` (in-range-for-int32 indices)."""
    x = random((10, 4), jnp.float32, seed=15)
    indices = jnp.asarray(SPECIAL_INDICES, jnp.int32)
    ct = random((len(SPECIAL_INDICES), 4), jnp.float32, seed=16)
    for mode in ("clip", None, "fill"):
        ours = functools.partial(gather, indices=indices, mode=mode,
                                 implementation=implementation)
        dx = jax.vjp(ours, x)[1](ct)[0]
        expected = jax.vjp(lambda x, mode=mode: x.at[indices].get(mode=mode), x)[1](ct)[0]
        assert_close(dx, expected, jnp.float32, reduction_length=4)


def test_16_bit_gradients_accumulate_in_float32(implementation):
    x = jnp.zeros((4, 8), jnp.bfloat16)
    indices = jnp.asarray([1] * 140 + [2, -1], jnp.int32)
    ct = jnp.asarray(np.random.default_rng(17).uniform(0.5, 1.5, (142, 8)), jnp.bfloat16)
    dx = jax.vjp(lambda x: gather(x, indices, implementation=implementation), x)[1](ct)[0]
    assert dx.dtype == jnp.bfloat16
    # A bfloat16 running sum of 140 terms is off by many bfloat16 roundings; float32 is not.
    assert_close(dx, expected_gradient(x.shape, ct, indices), jnp.bfloat16)


@pytest.mark.parametrize("interpret", [True, "strict"], ids=_ids)
def test_mosaic_16_bit_rows_of_constants_under_jit(interpret):
    """The Mosaic kernels move 16-bit rows as 32-bit words of row pairs. With the table and the
    cotangent known at trace time, XLA folds constants through the interpreted word view: a
    view built by bitcasts came out with columns paired instead of rows (jax 0.10-0.12)."""
    x, ct = random((33, 130), jnp.bfloat16, seed=30), random((8, 130), jnp.bfloat16, seed=31)
    indices = np.asarray([0, 1, 32, 31, -1, 5, 5, 2], np.int32)

    def forward_and_gradient():
        out, pullback = jax.vjp(lambda t: gather(t, jnp.asarray(indices), implementation="mosaic",
                                                 interpret=interpret), jnp.asarray(x))
        return out, pullback(jnp.asarray(ct))[0]

    out, dx = jax.jit(forward_and_gradient)()
    assert_exact(out, expected_gather(x, indices))
    assert_close(dx, expected_gradient(x.shape, ct, indices), jnp.bfloat16)


@pytest.mark.parametrize("shape,axis", [((20, 600), 0), ((2, 20, 300), 1)], ids=str)
def test_hot_ids_over_many_steps_and_row_blocks(implementation, shape, axis):
    """Wide rows (the Triton backward sums 8 cotangent rows per step at 512 columns): a row hit
    100 times spans many steps and a piece (its first 64 positions summed by its owner, the
    rest in a piece's partial sum), rows sit in several row blocks, the last one partial, and a
    leading batch dim has its own pieces."""
    x = jnp.zeros(shape, jnp.float32)
    indices = jnp.asarray([3] * 100 + [17] * 9 + [0, 19, 8, 3, -1], jnp.int32)
    ct_shape = (*shape[:axis], indices.size, *shape[axis + 1:])
    ct = random(ct_shape, jnp.float32, seed=23)
    dx = jax.vjp(lambda x: gather(x, indices, axis=axis, implementation=implementation),
                 x)[1](ct)[0]
    want = jax.vjp(lambda x: jnp.take(x, indices, axis=axis, mode="fill"), x)[1](ct)[0]
    assert_close(dx, want, jnp.float32, reduction_length=100)


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_backward_in_the_fast_interpreter(implementation):
    """The fast interpreter's own schedule (triton: 64 rows side by side; mosaic: one DMA in
    flight): a hot row through pieces, the last row of a table whose last row block is
    partial, a leading batch dim, 16-bit word-rows."""
    x = random((2, 1100, 512), jnp.bfloat16, seed=33)
    indices = jnp.asarray([3] * 300 + [1099] * 40 + list(range(0, 1100, 7)), jnp.int32)
    ct = random((2, indices.size, 512), jnp.bfloat16, seed=32)
    out, pullback = jax.vjp(lambda x: gather(x, indices, axis=1, implementation=implementation,
                                             interpret=True), x)
    assert_exact(out, expected_gather(x, indices, axis=1))  # mosaic: a ring across 4 steps
    assert_close(pullback(ct)[0], expected_gradient(x.shape, ct, indices, axis=1),
                 jnp.bfloat16)


@pytest.mark.parametrize("num_ids", [8192, 1 << 20])
def test_triton_scatter_add_work_per_program(num_ids):
    """Issue 10, finding 9, at a 128k vocabulary: programs own blocks of rows (not one
    program per mostly-zero row), and no loop grows with how often an id repeats: whatever the
    ids, a row's owner runs at most about 2·sqrt(m)/8 load steps (its first piece, then the
    partial sums of its other pieces), where one id hit m times took m/8 steps before (1024 and
    131072 here)."""
    import math

    from kernels import _targets
    from kernels.compile import pallas_calls
    from kernels.gather.triton import config as gather_triton
    from kernels.gather.common import Problem

    p = Problem(1, 131072, 512, num_ids, jnp.dtype(jnp.bfloat16), "clip", None)
    assert gather_triton.longest_loop(p) <= 4 * math.sqrt(num_ids) / 8
    table = jax.ShapeDtypeStruct((131072, 512), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((num_ids,), jnp.int32)
    grad = jax.grad(lambda t, ids: jnp.sum(gather(t, ids, implementation="triton",
                                                  interpret=False).astype(jnp.float32)))
    calls = {eqn.params["name"]: eqn
             for eqn in pallas_calls(grad, table, ids, target=_targets.DEFAULT["gpu"])}
    rows_programs, column_programs = calls["scatter_add_triton"].params["grid_mapping"].grid
    assert rows_programs <= 131072 // 8 and column_programs == 1
    piece_programs = calls["scatter_add_pieces_triton"].params["grid_mapping"].grid[0]
    assert piece_programs == gather_triton.pieces(p, 512).count


# (ids, whether to run the gradient too: interpret mode is slow, the hot layouts suffice)
PIECE_LAYOUTS = {"one": ([5] * 1000, True), "two": ([0] * 500 + [9] * 499 + [3], False),
                 "spread": (list(range(-10, 990)), False),
                 "dropped": ([7] * 300 + [99] * 700, True)}


@pytest.mark.parametrize("layout", PIECE_LAYOUTS)
def test_triton_scatter_add_pieces_cover_each_row_once(layout):
    """The backward's piece table: past its first `length` positions, every sorted position
    of a row lies in exactly one piece of that row, and no piece is longer than `length`; the
    gradient through many pieces is JAX's."""
    from kernels.gather.common import Problem, piece_table, scatter_plan
    from kernels.gather.triton import config

    ids, run_gradient = PIECE_LAYOUTS[layout]
    n = 20
    p = Problem(1, n, 512, len(ids), jnp.dtype(jnp.float32), "fill", None)
    layout = config.pieces(p, 512)
    plan = scatter_plan(jnp.asarray(ids, jnp.int32), n, "drop")
    table = piece_table(plan, p, layout)
    row_starts, row_pieces = np.asarray(plan.row_starts), np.asarray(table.row_pieces)
    bounds = np.asarray(table.bounds)
    assert layout.count > 0 and np.all(bounds[:, 1] - bounds[:, 0] <= layout.length)
    for row in range(n):
        covered = [q for lo, hi in bounds[row_pieces[row]:row_pieces[row + 1]]
                   for q in range(lo, hi)]
        assert covered == list(range(row_starts[row] + layout.length, row_starts[row + 1]))
    assert np.all(bounds[row_pieces[n]:] == 0)  # unused pieces are empty
    if not run_gradient:
        return
    x, indices = jnp.zeros((n, 512), jnp.float32), jnp.asarray(ids, jnp.int32)
    ct = random((len(ids), 512), jnp.float32, seed=5)
    dx = jax.vjp(lambda x: gather(x, indices, implementation="triton"), x)[1](ct)[0]
    assert_close(dx, expected_gradient(x.shape, ct, indices), jnp.float32,
                 reduction_length=len(ids))


@pytest.mark.parametrize("scatter_mode", ["clip", "drop", "wrap"])
def test_scatter_plan_matches_numpy_without_a_loop(scatter_mode):
    """The backward's plan (sorted positions, each row's segment start) and the Triton piece
    table are NumPy's stable argsort and searchsorted, computed with no XLA while loop (issue
    25: `jnp.searchsorted`'s default method is a loop of about log2(m) steps, each a launch on
    a GPU, twice per backward)."""
    from kernels.gather.common import Problem, piece_table, scatter_plan
    from kernels.gather.triton import config

    n, ids = 20, np.r_[[5] * 600, -3, 25, -30, np.arange(-20, 40), [19] * 300].astype(np.int32)
    plan = scatter_plan(jnp.asarray(ids), n, scatter_mode)
    rows = {"clip": np.clip(np.where(ids < 0, ids + n, ids), 0, n - 1), "wrap": ids % n,
            "drop": np.where((ids >= -n) & (ids < n), np.where(ids < 0, ids + n, ids), n)}
    targets = rows[scatter_mode]
    order = np.argsort(targets, kind="stable")
    np.testing.assert_array_equal(plan.order, order)
    np.testing.assert_array_equal(plan.targets, targets[order])
    np.testing.assert_array_equal(plan.row_starts,
                                  np.searchsorted(targets[order], np.arange(n + 1), "left"))
    p = Problem(1, n, 512, len(ids), jnp.dtype(jnp.float32), "fill", None)
    layout = config.pieces(p, 512)
    program = jax.jit(lambda i: piece_table(scatter_plan(i, n, scatter_mode), p,
                                            layout)).lower(jnp.asarray(ids))
    assert layout.count > 0 and "while" not in program.as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=_ids)
def test_mosaic_row_copies_keep_a_megabyte_in_flight(dtype):
    """Issue 25, item 2, at the 32000x4096 embedding with 8192 ids on v5e: the scatter-add and
    the 16-bit forward (which moves word-rows through VMEM) keep 32-64 row DMAs and 1 MiB or
    more in flight (the ring was 8 copies, 32-128 KiB, whatever the row's size), each with its
    own buffer and semaphore; indices are staged into 3 SMEM blocks so the next block arrives
    while one is used, and the forward's index blocks run in order on one core (an "arbitrary"
    grid axis) so its ring crosses grid steps instead of draining at each. (TPU interpret mode
    runs a DMA when it is waited on and poisons scratch memory with NaN, so the numerics tests
    would fail if a row were read before its own copy was waited on.)"""
    from kernels import _targets
    from kernels.compile import pallas_calls

    table = jax.ShapeDtypeStruct((32000, 4096), dtype)
    ids = jax.ShapeDtypeStruct((8192,), jnp.int32)
    grad = jax.grad(lambda t, i: jnp.sum(gather(t, i, implementation="mosaic",
                                                interpret=False).astype(jnp.float32)))
    calls = pallas_calls(grad, table, ids, target=_targets.TARGETS["v5e"])
    ringed = {"scatter_add_mosaic"} | ({"gather_mosaic"} if dtype == jnp.bfloat16 else set())
    for eqn in calls:
        name = eqn.params["name"]
        if name not in ringed:
            continue
        scratch = eqn.params["grid_mapping"].scratch_avals
        semaphores = [a.shape for a in scratch if "sem" in str(a.dtype)]
        (ring,) = [a.shape for a in scratch if len(a.shape) == 3]
        depth, _, columns = ring
        assert 32 <= depth <= 64 and depth * columns * 4 >= 1 << 20, (name, ring)
        assert semaphores == [(depth,), ()], (name, semaphores)
        staging = [a.shape for a in scratch if "smem" in str(a)]
        assert staging and all(shape == (3 * 128,) for shape in staging), (name, staging)
        if name == "gather_mosaic":
            params = eqn.params["compiler_params"]
            params = params["mosaic_tpu"] if isinstance(params, dict) else params
            semantics = params.dimension_semantics
            assert [str(s).lower() for s in semantics][-1].endswith("arbitrary"), semantics
        ringed.discard(name)
    assert not ringed


@pytest.mark.parametrize("target,num_random,ranges", [
    ("v5e", 350, (1, 4)), ("v4", 350, (2, 2)), ("v4", 230, (2, 2))], ids=str)
def test_mosaic_ring_across_staging_blocks_and_ranges(target, num_random, ranges):
    """The 16-bit rings of issue 25 (64 copies in flight here), in TPU interpret mode: the
    forward's ring runs across the steps of its range of index blocks (v5e: one range of 4;
    the megacore v4: 2 ranges, each refilled at its start; with 3 blocks the second range's
    extra step repeats its block and does nothing), fetching each next staging block while
    one is used; the backward's starts mid-block at each row block's first sorted position,
    and a hot row's 150 positions span two staging blocks."""
    from kernels import _targets
    from kernels._blocks import core_ranges
    from kernels._pallas import on_target
    from kernels.gather.mosaic import config as mosaic_config

    x = random((301, 130), jnp.bfloat16, seed=40)
    ids = np.r_[np.random.default_rng(41).integers(-310, 310, num_random), [7] * 150]
    ids = ids.astype(np.int32)
    ct = random((ids.size, 130), jnp.bfloat16, seed=42)
    with on_target(_targets.TARGETS[target]):
        assert mosaic_config.ring_depth(130) == 64
        assert core_ranges(-(-ids.size // 128)) == ranges
        out, pullback = jax.vjp(lambda t: gather(t, jnp.asarray(ids), mode="fill",
                                                 implementation="mosaic", interpret="strict"), x)
        dx = pullback(ct)[0]
    assert_exact(out, expected_gather(x, ids, mode="fill"))
    assert_close(dx, expected_gradient(x.shape, ct, ids, mode="fill"), jnp.bfloat16,
                 reduction_length=150)


def test_backward_is_deterministic(implementation):
    x = jnp.zeros((5, 16), jnp.float32)
    indices = jnp.asarray(np.random.default_rng(18).integers(0, 5, 140), jnp.int32)
    ct = random((140, 16), jnp.float32, seed=19)
    grad = jax.jit(lambda ct: jax.vjp(
        lambda x: gather(x, indices, implementation=implementation), x)[1](ct)[0])
    first = np.asarray(grad(ct))
    np.testing.assert_array_equal(np.asarray(grad(ct)), first)
    assert_close(first, expected_gradient(x.shape, ct, indices), jnp.float32,
                 reduction_length=40)


def test_grad_of_grad(implementation):
    x = random((6, 3), jnp.float32, seed=20)
    indices = jnp.asarray([0, 5, 5, -1, 7, -9], jnp.int32)
    weights, v = random((6, 3), jnp.float32, seed=21), random((6, 3), jnp.float32, seed=22)

    def hvp(fn):
        def loss(x):
            return jnp.sum(jnp.sin(fn(x, indices, mode="clip")) * weights)
        return jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x), v))(x)

    expected = hvp(reference_gather)
    assert_close(hvp(functools.partial(gather, implementation=implementation)), expected,
                 jnp.float32, reduction_length=6)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("mode", ["clip", "fill", "wrap", None])
def test_finite_differences_float64(implementation, mode):
    with x64():
        x = random((7, 3), jnp.float64, seed=23)
        # The default mode's gradient drops the out-of-range indices its forward clamps (JAX's
        # rule), so only in-range indices have a finite-difference derivative there.
        values = [0, 6, 6, -1, -7] + ([] if mode is None else [8, -9])
        indices = jnp.asarray(values, jnp.int32)
        check_grads(lambda x: gather(x, indices, mode=mode, fill_value=0.0,
                                     implementation=implementation),
                    (x,), order=1, modes=["rev"])


def test_integer_table_has_float0_gradient(implementation):
    x = jnp.arange(12, dtype=jnp.int32).reshape(6, 2)
    indices = jnp.asarray([1, -1, 9], jnp.int32)
    out, pullback = jax.vjp(lambda x: gather(x, indices, mode="fill",
                                             implementation=implementation), x)
    (dx,) = pullback(np.zeros(out.shape, jax.dtypes.float0))
    assert dx.dtype == jax.dtypes.float0 and dx.shape == x.shape


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=_ids)
@pytest.mark.parametrize("shape,axis,mode", [((1000, 256), 0, None), ((4, 37, 129), 1, "fill"),
                                             ((16, 300), -1, "wrap"), ((64, 130), 0, "clip")],
                         ids=str)
def test_lowers_forward_and_backward(kernel, dtype, shape, axis, mode):
    x, indices = jnp.zeros(shape, dtype), jnp.zeros((3, 7), jnp.int32)

    def forward(x, i):
        return gather(x, i, axis=axis, mode=mode, implementation=kernel, interpret=False)

    def forward_and_backward(x, i):
        return jax.value_and_grad(lambda x: forward(x, i).astype(jnp.float32).sum())(x)

    assert_lowers(forward, x, indices, implementation=kernel)
    assert_lowers(forward_and_backward, x, indices, implementation=kernel, min_kernels=2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_lowers_int64_indices_and_grad_of_grad(kernel):
    with x64():
        x, indices = jnp.zeros((100, 128), jnp.float32), jnp.zeros((9,), jnp.int64)

        def loss(x):
            out = gather(x, indices, mode="fill", implementation=kernel, interpret=False)
            return jnp.sum(out ** 2)

        assert_lowers(lambda x: jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(x), x,
                      implementation=kernel, min_kernels=2)
