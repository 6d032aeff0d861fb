"""The shared matmul suite, run against every implementation."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from kernels import reference
from kernels import registry
from kernels.matmul import MatmulConfig, matmul
from tests.support import (FLOAT_DTYPES, SUPPORTS_FLOAT64, Contract, as_f64, assert_close,
                           assert_lowers, dot_platform, implementations_of, kernels_of, needs,
                           random, standard_promotion, tf32_rounded, tolerance,
                           walked_pipeline_bytes, weighted_sum, x64)

KERNELS = kernels_of("matmul")  # this op's kernels (`tests.support.implementations_of`)
IMPLEMENTATIONS = implementations_of("matmul")

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")

SHAPES = [  # (M, N, K): none a multiple of any block but 256/512/384
    (1, 1, 1), (7, 13, 5), (129, 257, 65), (256, 512, 384), (1000, 3, 1000), (16, 16, 0)]
BATCHED = [((3, 65, 33), (33, 17)), ((2, 1, 8, 9), (4, 9, 8)), ((9, 8), (4, 8, 5)),
           ((1, 5, 7), (3, 7, 2))]
RANK_1 = [((33,), (33,)), ((33,), (33, 7)), ((5, 33), (33,)), ((33,), (2, 33, 7))]


def _check_against_ground_truth(a, b, out, dtype=None, dot=True, implementation=None):
    expected = np.matmul(as_f64(a), as_f64(b))
    chex.assert_shape(out, expected.shape)
    with standard_promotion():
        assert out.dtype == jnp.matmul(a, b).dtype
    assert_close(out, expected, dtype or out.dtype, reduction_length=a.shape[-1], dot=dot,
                 platform=dot_platform(implementation))


# Mosaic GPU's interpreter takes about 1.5 s a call here (registry: no fast interpreter): its
# kernel runs every shape in bfloat16 and the odd and the padded ones in float32 and float16
# (casts and K-major copies are XLA's), and some of each batched and rank-1 class, forward and
# gradient.
SLOW = "mosaic_gpu"


@pytest.mark.parametrize("implementation,dtype,m,n,k", [
    (impl, dtype, *shape) for impl in IMPLEMENTATIONS for dtype in FLOAT_DTYPES
    for shape in SHAPES
    if impl != SLOW or dtype == jnp.bfloat16 or shape in ((7, 13, 5), (1000, 3, 1000))],
    ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else None)
def test_matches_float64_ground_truth(implementation, m, n, k, dtype):
    a, b = random((m, k), dtype, seed=1), random((k, n), dtype, seed=2)
    _check_against_ground_truth(a, b, matmul(a, b, implementation=implementation),
                                implementation=implementation)


def test_reference_matches_float64_ground_truth():
    a, b = random((129, 65), jnp.float32, 1), random((65, 257), jnp.float32, 2)
    _check_against_ground_truth(a, b, reference.matmul(a, b))


@pytest.mark.parametrize("implementation,a_shape,b_shape", [
    (impl, *shapes) for impl in IMPLEMENTATIONS for shapes in BATCHED + RANK_1
    if impl != SLOW or shapes in (BATCHED[0], BATCHED[1], RANK_1[0], RANK_1[3])])
def test_batch_dims_and_rank_1(implementation, a_shape, b_shape):
    a, b = random(a_shape, jnp.float32, 3), random(b_shape, jnp.float32, 4)
    _check_against_ground_truth(a, b, matmul(a, b, implementation=implementation),
                                implementation=implementation)


@pytest.mark.parametrize("a_dtype,b_dtype", [(jnp.bfloat16, jnp.float16),
                                             (jnp.float32, jnp.bfloat16),
                                             (jnp.float16, jnp.float32)],
                         ids=["bf16-f16", "f32-bf16", "f16-f32"])
def test_mixed_dtypes_promote_like_jnp_matmul(implementation, a_dtype, b_dtype):
    a, b = random((19, 40), a_dtype, 5), random((40, 23), b_dtype, 6)
    with standard_promotion():
        out = matmul(a, b, implementation=implementation)
    assert out.dtype == jnp.float32
    # The ground truth multiplies the same rounded inputs: a float32 product's tolerance.
    _check_against_ground_truth(a, b, out, jnp.float32, implementation=implementation)
    # Under the suite's strict promotion the op raises where jnp.matmul does, and a
    # preferred_element_type makes both take the mixed operands.
    with pytest.raises(jax.dtypes.TypePromotionError):
        jnp.matmul(a, b)
    with pytest.raises(jax.dtypes.TypePromotionError):
        matmul(a, b, implementation=implementation)
    out = matmul(a, b, preferred_element_type=jnp.float32, implementation=implementation)
    _check_against_ground_truth(a, b, out, jnp.float32, implementation=implementation)


def test_preferred_element_type(implementation):
    a, b = random((20, 300), jnp.bfloat16, 7), random((300, 9), jnp.bfloat16, 8)
    out = matmul(a, b, preferred_element_type=jnp.float32, implementation=implementation)
    assert out.dtype == jnp.float32
    # float32 output of float32 accumulation: float32's tolerance, not bfloat16's.
    assert_close(out, as_f64(a) @ as_f64(b), jnp.float32, reduction_length=300, dot=True,
                 platform=dot_platform(implementation))


def test_precision_highest(implementation):
    a, b = random((33, 70), jnp.float32, 9), random((70, 17), jnp.float32, 10)
    if implementation == "mosaic_gpu":  # float32 as TF32 (Hopper) or split bfloat16 (Blackwell)
        with pytest.raises(NotImplementedError, match="mosaic_gpu: .*HIGHEST runs in xla"):
            matmul(a, b, precision=jax.lax.Precision.HIGHEST, implementation=implementation)
        out = matmul(a, b, precision=jax.lax.Precision.HIGHEST,
                     implementation=(implementation, "xla"))  # falls through
        _check_against_ground_truth(a, b, out, dot=False)
        return
    out = matmul(a, b, precision=jax.lax.Precision.HIGHEST, implementation=implementation)
    _check_against_ground_truth(a, b, out, dot=False)


def test_float64(implementation):
    with x64():
        a, b = random((40, 150), jnp.float64, 11), random((150, 21), jnp.float64, 12)
        if not SUPPORTS_FLOAT64[implementation]:
            with pytest.raises(NotImplementedError, match=f"{implementation}: float64"):
                matmul(a, b, implementation=implementation)
            return
        out = matmul(a, b, implementation=implementation)
        assert out.dtype == jnp.float64
        _check_against_ground_truth(a, b, out)


def test_declining_kernel_falls_through_to_xla():
    with x64():
        a, b = random((8, 9), jnp.float64, 1), random((9, 3), jnp.float64, 2)
        out = matmul(a, b, implementation=("mosaic", "xla"))
        _check_against_ground_truth(a, b, out)


def test_empty_dims(implementation):
    a, b = jnp.zeros((0, 5)), jnp.zeros((5, 3))
    chex.assert_shape(matmul(a, b, implementation=implementation), (0, 3))
    out = matmul(jnp.ones((2, 4, 0)), jnp.ones((0, 6)), implementation=implementation)
    np.testing.assert_array_equal(out, np.zeros((2, 4, 6)))


def test_nan_and_inf_propagate(implementation):
    a = random((9, 20), jnp.float32, 1).at[2, 3].set(jnp.nan).at[5, 0].set(jnp.inf)
    b = jnp.abs(random((20, 11), jnp.float32, 2))
    out, want = matmul(a, b, implementation=implementation), jnp.matmul(a, b)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(want))


def test_vmap(implementation):
    a, b = random((4, 17, 40), jnp.float32, 1), random((4, 40, 9), jnp.float32, 2)
    out = jax.vmap(lambda a, b: matmul(a, b, implementation=implementation))(a, b)
    _check_against_ground_truth(a, b, out, implementation=implementation)
    out = jax.vmap(lambda a: matmul(a, b[0], implementation=implementation))(a)
    _check_against_ground_truth(a, b[0], out, implementation=implementation)


# jit and eager, no retrace, vmap of every operand: tests/test_contract.py, from this contract.
CONTRACT = Contract(
    call=lambda impl: lambda a, b: matmul(a, b, implementation=impl),
    example=lambda: (random((37, 130), jnp.bfloat16, 1), random((130, 18), jnp.bfloat16, 2)),
    repeated=lambda seed: (random((12, 20), jnp.float32, seed),
                           random((20, 7), jnp.float32, seed + 1)),
    check=lambda out, a, b, implementation: _check_against_ground_truth(
        a, b, out, implementation=implementation),
    small=lambda **kw: matmul(jnp.ones((3, 3)), jnp.ones((3, 3)), **kw))


@pytest.mark.parametrize("impl", KERNELS)
def test_repeated_eager_calls_trace_the_kernel_once(impl, monkeypatch):
    """Eager callers (tests of model code on a CPU) get jit's cache, not a re-trace per call."""
    from kernels.matmul import OP

    module = OP.module(impl)
    traces = []
    kernel = module.matmul
    monkeypatch.setattr(module, "matmul", lambda *a, **k: traces.append(1) or kernel(*a, **k))
    for seed in range(3):
        a, b = random((11, 21), jnp.float32, seed), random((21, 6), jnp.float32, seed + 1)
        _check_against_ground_truth(a, b, matmul(a, b, implementation=impl), implementation=impl)
    assert len(traces) <= 1


def _loss(implementation):
    """A scalar of the product that weighs every output element differently."""
    if implementation == "reference":
        return lambda a, b: weighted_sum(reference.matmul(a, b))
    return lambda a, b: weighted_sum(matmul(a, b, implementation=implementation))


@pytest.mark.parametrize("implementation,a_shape,b_shape", [
    (impl, *shapes) for impl in IMPLEMENTATIONS
    for shapes in [((17, 40), (40, 9))] + BATCHED + RANK_1
    if impl != SLOW or shapes in (((17, 40), (40, 9)), BATCHED[1], RANK_1[3])])
def test_gradients_match_reference(implementation, a_shape, b_shape):
    a, b = random(a_shape, jnp.float32, 1), random(b_shape, jnp.float32, 2)
    grads = jax.grad(_loss(implementation), argnums=(0, 1))(a, b)
    want = jax.grad(_loss("reference"), argnums=(0, 1))(a, b)
    for got, expected in zip(grads, want):
        chex.assert_equal_shape([got, expected])
        assert_close(got, expected, jnp.float32, reduction_length=2 * max(a_shape + b_shape),
                     dot=True, platform=dot_platform(implementation))


@pytest.mark.parametrize("impl", KERNELS)
def test_gradients_bfloat16_accumulate_in_float32(impl):
    # Kernels only: how XLA accumulates its own bfloat16 gradient dots is XLA's choice (jax
    # 0.12 on a CPU accumulates dB's batch-folded contraction in bfloat16).
    a, b = random((2, 24, 40), jnp.bfloat16, 1), random((40, 9), jnp.bfloat16, 2)
    grads = jax.grad(lambda a, b: jnp.sum(matmul(a, b, implementation=impl)
                                          .astype(jnp.float32)), argnums=(0, 1))(a, b)
    ones = np.ones((2, 24, 9))
    want = (ones @ as_f64(b).T, np.einsum("bmk,bmn->kn", as_f64(a), ones))
    for got, expected, x in zip(grads, want, (a, b)):
        assert got.dtype == x.dtype
        assert_close(got, expected, jnp.bfloat16, reduction_length=48, dot=True)


def test_grad_of_grad(implementation):
    a, b = random((6, 10), jnp.float32, 1), random((10, 4), jnp.float32, 2)

    def second(impl):
        inner = jax.grad(_loss(impl), argnums=0)
        return jax.grad(lambda a, b: jnp.sum(inner(a, b) ** 2), argnums=(0, 1))(a, b)

    for got, want in zip(second(implementation), second("reference")):
        assert_close(got, want, jnp.float32, reduction_length=40, dot=True,
                     platform=dot_platform(implementation))


@pytest.mark.parametrize("impl", [i for i in ("xla", "triton") if SUPPORTS_FLOAT64[i]])
def test_finite_differences_float64(impl):
    with x64():
        a, b = random((2, 5, 7), jnp.float64, 1), random((7, 3), jnp.float64, 2)
        # order=2 also checks grad of grad against finite differences.
        check_grads(lambda a, b: matmul(a, b, implementation=impl), (a, b), order=2,
                    modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(129, 65, 257), (128, 64, 256)], ids=["ragged", "even"])
def test_lowers_forward_and_backward(impl, dtype, m, k, n):
    a, b = random((3, m, k), dtype, 1), random((k, n), dtype, 2)

    def forward(a, b):
        return matmul(a, b, implementation=impl, interpret=False)

    def backward(a, b):
        return jax.grad(lambda a, b: jnp.sum(forward(a, b).astype(jnp.float32)),
                        argnums=(0, 1))(a, b)

    assert_lowers(forward, a, b, implementation=impl)
    assert_lowers(backward, a, b, implementation=impl, min_kernels=2)


@pytest.mark.parametrize("a,b,error,match", [
    (jnp.float32(1), jnp.ones((3,)), ValueError, "a must have rank >= 1"),
    (jnp.ones((3,)), jnp.float32(1), ValueError, "b must have rank >= 1"),
    (jnp.ones((4, 5)), jnp.ones((6, 3)), ValueError, "contracting dims"),
    (jnp.ones((2, 4, 5)), jnp.ones((3, 5, 3)), ValueError, "batch dims"),
    (jnp.ones((4, 5), bool), jnp.ones((5, 3)), TypeError, "a must have a numeric dtype"),
    (np.array([["x"]]), jnp.ones((1, 3)), TypeError, "a must have a numeric dtype"),
])
def test_bad_input(implementation, a, b, error, match):
    with pytest.raises(error, match=match):
        matmul(a, b, implementation=implementation)


# A bad implementation, interpret or config type: tests/test_contract.py, for every op.


@pytest.mark.parametrize("impl,config,match", [
    ("triton", MatmulConfig(block_m=24), "block_m must be a power of 2 >= 16"),
    ("triton", MatmulConfig(block_k=8), "block_k must be a power of 2 >= 16"),
    ("triton", MatmulConfig(num_warps=3), "num_warps"),
    ("triton", MatmulConfig(split_k=0), "split_k must be a positive int"),
    pytest.param("mosaic_gpu", MatmulConfig(split_k=0), "split_k must be a positive int",
                 marks=needs("mosaic_gpu")),
    ("mosaic", MatmulConfig(block_n=100), "block_n=100 breaks TPU tiling"),
    ("mosaic", MatmulConfig(block_m=12), "block_m=12 breaks TPU tiling"),
])
def test_config_that_breaks_a_constraint(impl, config, match):
    a, b = jnp.ones((300, 600)), jnp.ones((600, 700))
    with pytest.raises(ValueError, match=match):
        matmul(a, b, implementation=impl, config=config)


@pytest.mark.parametrize("impl,config", [
    ("triton", MatmulConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=2)),
    ("mosaic", MatmulConfig(block_m=16, block_n=128, block_k=128)),
])
def test_explicit_config_with_ragged_edges(impl, config):
    # Many blocks in every dim, none dividing the shape: exercises the grouped order (triton)
    # and the masked K edge (mosaic).
    a, b = random((2, 50, 300), jnp.bfloat16, 1), random((300, 140), jnp.bfloat16, 2)
    out = matmul(a, b, implementation=impl, config=config)
    _check_against_ground_truth(a, b, out, implementation=impl)


@pytest.mark.parametrize("a_shape,b_shape,config", [
    ((2, 5, 300), (300, 7), MatmulConfig(block_k=16, split_k=3)),  # 19 K blocks: 7, 7, 5
    ((33, 129), (129, 17), MatmulConfig(block_k=16, split_k=100)),  # more splits than K blocks
    ((1000, 1000), (1000, 3), None),  # chosen by shape: few tiles, a long K
])
def test_triton_split_k(a_shape, b_shape, config):
    """Split-K programs each sum a range of K into float32 partials, added afterwards: every
    range, the ragged last one included, counted once (forward and both gradients)."""
    from kernels.matmul import common, triton

    a, b = random(a_shape, jnp.float32, 1), random(b_shape, jnp.float32, 2)
    p = common.make_problem(a, b, False, False, jnp.float32)
    assert triton.resolve_config(p, config).split_k > 1
    out = matmul(a, b, implementation="triton", config=config)
    _check_against_ground_truth(a, b, out, implementation="triton")
    # The gradient kernels pick their own configs: dB of the last case splits K by shape.
    grads = jax.grad(_loss("triton"), argnums=(0, 1))(a, b)
    with x64():
        want = jax.grad(_loss("reference"), argnums=(0, 1))(as_f64(a), as_f64(b))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=2 * max(a_shape + b_shape),
                     dot=True, platform="gpu")


# Named shapes (dtype bfloat16) and the programs the Triton kernel launched for them before
# shape-class configs: one 128x128 tile config for every shape.
H100_SHAPES = {
    "square 1024": ((1024, 1024), (1024, 1024)),  # was 64 programs
    "decode 16 x 4096": ((16, 4096), (4096, 4096)),  # was 32
    "dense dW 512 x 512 over 65536 tokens": ((512, 65536), (65536, 512)),  # was 16
    "square 4096": ((4096, 4096), (4096, 4096)),  # was 1024
}


@pytest.mark.parametrize("name", H100_SHAPES)
def test_triton_programs_fill_an_h100(name):
    """Design property (no device needed): every SM of an H100 gets a program; products whose
    tiles alone would not give two waves split K, with partials costing at most half the
    operands' traffic."""
    from kernels import _targets
    from kernels.matmul import common, triton

    a_shape, b_shape = H100_SHAPES[name]
    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (a_shape, b_shape))
    p = common.make_problem(a, b, False, False, jnp.bfloat16)
    config = triton.resolve_config(p, None)
    tiles = -(-p.m // config.block_m) * -(-p.n // config.block_n)
    h100 = _targets.TARGETS["sm_90"]
    assert tiles * config.split_k >= h100.num_sms, config
    if tiles < h100.num_sms:
        assert tiles * config.split_k >= h100.min_programs, config
    if config.split_k > 1:
        partial_bytes = 2 * config.split_k * p.m * p.n * 4
        assert partial_bytes <= common.flops_and_bytes(p)[1] / 2, config
    assert min(config.block_m, config.block_n) >= min(64, p.m, p.n), config




@pytest.mark.parametrize("a_shape,b_shape", [
    ((2048, 2048), (2048, 2048)),  # 4x4 tiles, 4 K blocks: every step copies both blocks
    ((2048, 256), (256, 2048)),    # one K block: A's block stays over a row of tiles
    ((3, 512, 1024), (1024, 256)),  # batched, B broadcast over the batch, one column tile
    ((512, 256), (4, 256, 512)),   # one tile per batch, one K block
], ids=str)
def test_cost_estimates_count_the_bytes_the_schedule_moves(a_shape, b_shape):
    """Design figures come from the kernels' cost estimates, so those must count re-reads,
    not each operand once: Mosaic's equals the bytes its pipeline copies (simulated from the
    launch's own grid and index maps, output included); Triton's counts each tile program
    reading its A and B panels."""
    from kernels import _targets
    from kernels.compile import launches
    from kernels.matmul import common, triton

    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (a_shape, b_shape))
    out_bytes = jax.eval_shape(jnp.matmul, a, b).size * 2
    (mosaic,) = launches(lambda a, b: matmul(a, b, implementation="mosaic", interpret=False),
                         a, b, target=_targets.TARGETS["v5e"])
    assert mosaic.params["cost_estimate"].bytes_accessed == walked_pipeline_bytes(mosaic)

    p = common.make_problem(a, b, False, False, jnp.bfloat16)
    config = triton.resolve_config(p, None)
    if config.split_k == 1:
        (gpu,) = launches(lambda a, b: matmul(a, b, implementation="triton", interpret=False),
                          a, b, target=_targets.TARGETS["sm_90"])
        row_tiles, column_tiles = -(-p.m // config.block_m), -(-p.n // config.block_n)
        panels = p.num_batches * 2 * p.k * (p.m * column_tiles + p.n * row_tiles)
        assert gpu.params["cost_estimate"].bytes_accessed == panels + out_bytes

def test_triton_float32_k_major_copies():
    """TF32 dots take K-major tiles: at default precision the Triton wrapper copies the
    MN-major float32 operands transposed where they are reused enough (the forward's B, and A
    and dC of dB = Aᵀ @ dC: this product's every dim is >= `K_MAJOR_MIN_REUSE`), never at
    HIGHEST. The copied layouts give the same values and gradients (their 16-byte loads are
    checked in the compiled PTX by tests/test_compile.py)."""
    from kernels.matmul.common import make_problem
    from kernels.matmul.triton.config import k_major_copies

    a, b = random((2, 128, 256), jnp.float32, 1), random((256, 256), jnp.float32, 2)
    forward = make_problem(a.reshape(256, 256), b, False, False, jnp.float32)
    weight_gradient = make_problem(a.reshape(256, 256), b, True, False, jnp.float32)
    assert k_major_copies(forward, None) == (False, True)
    assert k_major_copies(weight_gradient, "default") == (True, True)
    assert k_major_copies(forward, "highest") == (False, False)
    assert k_major_copies(forward._replace(m=100), None) == (False, False)  # too few rows
    grads = jax.grad(_loss("triton"), argnums=(0, 1))(a, b)
    want = jax.grad(_loss("reference"), argnums=(0, 1))(a, b)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=512, dot=True, platform="gpu")
    _check_against_ground_truth(a, b, matmul(a, b, implementation="triton"),
                                implementation="triton")


def test_triton_float32_highest_stays_off_the_tensor_cores():
    """Compiled by Triton for sm_90: a float32 product at HIGHEST precision (IEEE float32, as
    promised) issues no tensor-core instruction, forward or backward. (At default precision
    the compile suite checks the opposite: TF32 on wgmma / mma.sync.)"""
    from kernels import _targets
    from kernels.compile import pallas_calls, report

    a = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    b = jax.ShapeDtypeStruct((512, 768), jnp.float32)
    loss = lambda a, b: jnp.sum(matmul(a, b, implementation="triton", interpret=False,  # noqa: E731
                                       precision="highest"))
    target = _targets.TARGETS["sm_90"]
    calls = pallas_calls(jax.value_and_grad(loss, argnums=(0, 1)), a, b, target=target)
    assert len(calls) == 3
    for eqn in calls:
        r = report(eqn, target)
        assert r.fits and r.mma == (), (r.operands, r.mma, r.error)


def test_tolerance_rule_rejects_a_wrong_kernel():
    """The tolerance is tight enough that a kernel dropping a 16-wide K slice would fail, on
    this process's dots and as a GPU's TF32 dots."""
    a, b = random((16, 300), jnp.float32, 1), random((300, 8), jnp.float32, 2)
    truncated = as_f64(a)[:, :284] @ as_f64(b)[:284]
    error = np.max(np.abs(truncated - as_f64(a) @ as_f64(b)))
    for allowed in [tolerance(dtype, 300) for dtype in FLOAT_DTYPES] + [
            tolerance(jnp.float32, 300, dot=True, platform="gpu")]:
        assert error > allowed["atol"] + allowed["rtol"] * np.max(np.abs(truncated))


# A TF32 product's error against float64 truth, relative to its largest output, for this
# suite's normal samples at 256x512x256 (`kernels._blocks.round_to_tf32`), on the host: 2.9e-4
# with both operands rounded to nearest (what cuBLAS's TF32 products make), 8.7e-4 with both
# truncated (what a TF32 instruction does to an operand that reaches it unrounded), 4.4e-4 with
# one of each.
TF32_ROUNDED_ERROR = 4e-4
GPU_KERNELS = tuple(k for k in KERNELS if dot_platform(k) == "gpu")


@pytest.mark.parametrize("layout", ["nn", "tn", "nt"])
@pytest.mark.parametrize("impl", GPU_KERNELS)
def test_float32_products_multiply_operands_rounded_to_tf32(impl, layout):
    """The GPU kernels' float32 products are TF32 products of operands rounded to nearest, as
    their device computes them and the interpreter now does too (the kernels round before the
    MMA, whose products of rounded operands are exact in float32): equal to the float64
    product of the rounded operands within float32 accumulation, far from the float32 product
    (so nothing reaches the MMA unrounded), and within cuBLAS-like error of the truth."""
    a, b = random((256, 512), jnp.float32, 1), random((512, 256), jnp.float32, 2)
    stored_a = a.T if layout == "tn" else a  # the weight gradient's Aᵀ, dA's Bᵀ
    stored_b = b.T if layout == "nt" else b
    out = jax.jit(lambda a, b: matmul(a.T if layout == "tn" else a, b.T if layout == "nt" else b,
                                      implementation=impl))(stored_a, stored_b)
    rounded, truth = tf32_rounded(a) @ tf32_rounded(b), as_f64(a) @ as_f64(b)
    assert_close(out, rounded, jnp.float32, reduction_length=512)
    error, largest = np.max(np.abs(as_f64(out) - truth)), np.max(np.abs(truth))
    exact = tolerance(jnp.float32, 512)  # what a float32 product would meet
    assert error > 10 * (exact["atol"] + exact["rtol"] * largest)
    assert error < TF32_ROUNDED_ERROR * largest


@pytest.mark.parametrize("impl", GPU_KERNELS)
def test_default_matmul_precision_highest_keeps_float32(impl):
    """`jax.default_matmul_precision("highest")` makes precision=None IEEE float32, as it does
    for `lax.dot_general`: Triton multiplies the operands unrounded (float32's tolerance, which
    TF32 products miss), and Mosaic GPU, which has no IEEE float32 product, declines as it does
    HIGHEST."""
    a, b = random((64, 256), jnp.float32, 1), random((256, 32), jnp.float32, 2)
    with jax.default_matmul_precision("highest"):
        if impl == "mosaic_gpu":
            with pytest.raises(NotImplementedError, match="HIGHEST"):
                matmul(a, b, implementation=impl)
            return
        out = matmul(a, b, implementation=impl)
    assert_close(out, as_f64(a) @ as_f64(b), jnp.float32, reduction_length=256)


def test_round_to_tf32_rounds_to_nearest_ties_away_and_keeps_special_values():
    from kernels._blocks import round_to_tf32

    ulp = 2.0 ** -10
    x = np.array([1 + ulp / 2, 1 + ulp / 2 - 2.0 ** -23, 1 + 1.5 * ulp, -(1 + ulp / 2), 3e38,
                  np.finfo(np.float32).max, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    got = np.asarray(round_to_tf32(jnp.asarray(x)), np.float64)
    want = [1 + ulp, 1, 1 + 2 * ulp, -(1 + ulp), tf32_rounded(np.float32(3e38)), np.inf,
            np.inf, -np.inf, np.nan, 0.0, -0.0]
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[-1])
    normal = np.asarray(random((4096,), jnp.float32, 3))
    np.testing.assert_array_equal(np.asarray(round_to_tf32(jnp.asarray(normal)), np.float64),
                                  tf32_rounded(normal))


def test_remat(implementation):
    a, b = random((9, 20), jnp.float32, 1), random((20, 5), jnp.float32, 2)
    if "strict" in registry.get(implementation).interpreter_callbacks:
        # TPU interpret mode and Mosaic GPU's interpreter run kernels through ordered IO
        # callbacks, which JAX's remat refuses to partial-evaluate; the kernel itself
        # rematerializes, as lowering shows.
        remat_grad = jax.grad(jax.checkpoint(lambda a, b: jnp.sum(jnp.sin(
            matmul(a, b, implementation=implementation, interpret=False)))), argnums=(0, 1))
        assert_lowers(remat_grad, a, b, implementation=implementation, min_kernels=3)
        return
    loss = _loss(implementation)
    got = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(a, b)
    for g, want in zip(got, jax.grad(_loss("reference"), argnums=(0, 1))(a, b)):
        assert_close(g, want, jnp.float32, reduction_length=20, dot=True,
                     platform=dot_platform(implementation))


@pytest.mark.parametrize("impl,dtype", [("triton", jnp.float64), ("mosaic", jnp.float32)])
def test_lowers_under_x64(impl, dtype):
    # With x64 on, index arithmetic must stay 32-bit for Mosaic's verifier, and Triton's
    # float64 dot needs tiles of at least 16x8x16.
    with x64():
        a, b = random((2, 20, 9), dtype, 1), random((9, 3), dtype, 2)
        grad = jax.grad(lambda a, b: jnp.sum(matmul(a, b, implementation=impl,
                                                    interpret=False)), argnums=(0, 1))
        assert_lowers(grad, a, b, implementation=impl, min_kernels=2)


@pytest.mark.parametrize("precision", [jax.lax.Precision.HIGH, "high",
                                       (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT)],
                         ids=["HIGH", "high", "HIGH-DEFAULT"])
def test_precision_high_compiles_for_tpu(precision):
    # Mosaic takes DEFAULT or HIGHEST for both operands; HIGH and mixed pairs become HIGHEST.
    from kernels.compile import compile_kernels

    a = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    loss = lambda a, b: jnp.sum(matmul(a, b, precision=precision, implementation="mosaic",
                                       interpret=False))
    reports = compile_kernels(jax.grad(loss, argnums=(0, 1)), a, a.update(shape=(256, 128)),
                              target="v5e")
    assert len(reports) == 3 and all(r.fits for r in reports), [r.error for r in reports]
    x, y = random((33, 70), jnp.float32, 9), random((70, 17), jnp.float32, 10)
    _check_against_ground_truth(x, y, matmul(x, y, precision=precision, implementation="mosaic"))


@needs("mosaic_gpu")
@pytest.mark.parametrize("target,shape,dtype,tile,stages,splits", [
    ("sm_90", (4096, 4096, 4096), jnp.bfloat16, (256, 128), 4, 1),
    ("sm_90", (8192, 1024, 4096), jnp.float32, (256, 128), 3, 1),
    ("sm_90", (1024, 1024, 1024), jnp.bfloat16, (128, 64), 4, 1),
    ("sm_90", (16, 4096, 4096), jnp.bfloat16, (128, 64), 4, 2),
    ("sm_100", (4096, 4096, 4096), jnp.bfloat16, (128, 256), 4, 1),
    ("sm_100", (1024, 1024, 1024), jnp.bfloat16, (128, 64), 4, 1),
    ("sm_100", (16, 4096, 4096), jnp.bfloat16, (128, 64), 4, 2)],
    ids=["square", "float32", "small", "decode", "b200-square", "b200-small", "b200-decode"])
def test_mosaic_gpu_plan(target, shape, dtype, tile, stages, splits):
    """Design, no device: the Mosaic GPU kernel's persistent grid has at most one CTA per SM
    (an H100's 132, a B200's 148), every one busy where there are tiles enough; its TMA ring is
    as deep as shared memory holds beside the epilogue's buffers (JAX's Hopper matmul's 4
    stages at 256x128x64 bfloat16); a product whose largest tiles would leave SMs idle takes
    smaller tiles first (1024^3: 128 of 128x64, no split), and a decode product (one row of
    output tiles) then splits K into one round of work items. On a B200 the tile is tcgen05's
    128 rows by up to 256 columns (two accumulators fill tensor memory's 512 columns)."""
    from kernels import _targets
    from kernels._pallas import on_target
    from kernels.matmul.common import make_problem
    from kernels.gemm.mosaic_gpu.config import (TCGEN05, WGMMA, epilogue_bytes,
                                                  kernel_problem, plan_of)

    m, n, k = shape
    target = _targets.TARGETS[target]
    p = make_problem(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype),
                     False, False, dtype)
    with on_target(target):
        plan = plan_of(p, None)
    kernel = kernel_problem(p)
    assert ((plan.block_m, plan.block_n), plan.stages, plan.splits) == (tile, stages, splits), plan
    assert plan.mma == (TCGEN05 if target.compute_capability == 100 else WGMMA)
    items = plan.tiles(kernel) * plan.splits
    assert plan.num_ctas == min(target.num_sms, items), plan
    assert splits == 1 or items <= target.num_sms, plan
    stage = (plan.block_m + plan.block_n) * plan.block_k * kernel.a_dtype.itemsize
    assert (plan.stages * stage + epilogue_bytes(kernel, plan.block_m, plan.block_n, plan.splits,
                                                 plan.mma) <= target.shared_memory), plan
