"""What normalize's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12) adds
to the op's shared test base (which runs it too): its plans (ragged blocks and pieces, streamed
rows, CTAs walking blocks, the backward's summed terms, the mean's correction) in Mosaic GPU's
interpreter against float64 truth, and what it rejects and declines. On an older jax it
declines with the reason. The compiled kernels, whole programs and exports of every Mosaic GPU
op: tests/test_mosaic_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import registry
from kernels.normalize import NormalizeConfig, layer_norm
from tests.support import assert_close, needs, random, weighted_sum

needs_mosaic_gpu = needs("mosaic_gpu")
pytestmark = pytest.mark.usefixtures("strict_interpret")


def _truth(x, scale, offset, subtract_mean=True, residual=None, epsilon=1e-5):
    x = np.asarray(x, np.float64) + (0 if residual is None else np.asarray(residual, np.float64))
    mean = x.mean(-1, keepdims=True) if subtract_mean else 0.0
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + epsilon)
    y = y if scale is None else y * np.asarray(scale, np.float64)
    return y if offset is None else y + np.asarray(offset, np.float64)


@pytest.mark.skipif(registry.unavailable("mosaic_gpu") is None,
                    reason="this jax has Mosaic GPU")
def test_an_older_jax_declines_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"layer_norm: mosaic_gpu: needs jax >= 0.12"):
        layer_norm(jnp.ones((4, 128)), implementation="mosaic_gpu")


@needs_mosaic_gpu
@pytest.mark.parametrize("case", ["large_mean", "small_spread"])
def test_statistics_where_epsilon_and_cancellation_matter(case):
    """A large mean with a unit spread (1e4 + N(0, 1): the mean is subtracted before the
    squares, in float32 as XLA does), and a spread of 1e-3, where epsilon (1e-5) is most of
    the variance: a kernel that dropped or misplaced epsilon is off by 30% there."""
    base = np.random.default_rng(12).standard_normal((37, 1024))
    x = jnp.asarray((1e4 + base) if case == "large_mean" else 1e-3 * base, jnp.float32)
    y = layer_norm(x, implementation="mosaic_gpu")
    # Two sums of 1024 terms reach y (the mean's, then the variance's): XLA's own float32
    # layer norm is 9.1e-4 off the float64 truth at the large mean, within that rule's 9.8e-4.
    assert_close(y, _truth(x, None, None), jnp.float32, reduction_length=2 * 1024)


def _float64_gradients(loss, *args):
    with jax.enable_x64(True):
        return jax.grad(loss("xla"), argnums=tuple(range(len(args))))(
            *[a.astype(jnp.float64) for a in args])


@needs_mosaic_gpu
@pytest.mark.parametrize("shape,config,resident,accumulate", [
    ((40, 128), NormalizeConfig(block_groups=1, num_partials=3), True, True),
    ((40, 300), NormalizeConfig(block_groups=3, num_partials=4), True, True),
    ((5, 12288), NormalizeConfig(block_groups=2, num_partials=2), False, True),
    ((2, 20480), NormalizeConfig(block_groups=1), False, False)],
    ids=["walking", "walking-ragged", "streamed", "partial-rows-per-block"])
def test_backward_dscale_and_doffset_terms(shape, config, resident, accumulate):
    """The backward's ways to dscale and doffset: CTAs walking one-row (and 3-row, a ragged
    last block of ragged rows) blocks in two buffers, the next block's copies in flight while
    one computes, each CTA summing its blocks' terms over their rows in shared memory before
    writing them (`config.num_partials`: the CTAs, as the Triton backward's partials); rows
    too long for two blocks (2 x 12288 float32 inputs) streamed, 2 CTAs walking 3 blocks,
    their terms still summed; and rows whose terms do not fit (2 x 20480 float32
    accumulators), each block writing its own partial row. All against float64 truth."""
    from kernels.normalize.common import Problem
    from kernels.normalize.mosaic_gpu.config import plan_of

    problem = Problem(1, shape[0], shape[1], True, jnp.dtype(jnp.float32), True, 1e-5, True,
                      True)
    plan = plan_of(problem, config, backward=True)
    assert (plan.resident, plan.accumulate) == (resident, accumulate)
    assert plan.programs == (config.num_partials if accumulate else plan.num_blocks)
    x = random(shape, jnp.float32, seed=13)
    scale, offset = random(shape[-1:], jnp.float32, 14), random(shape[-1:], jnp.float32, 15)

    def loss(implementation):
        return lambda x, s, o: weighted_sum(layer_norm(
            x, s, o, implementation=implementation,
            config=None if implementation == "xla" else config))

    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, scale, offset)
    want = _float64_gradients(loss, x, scale, offset)
    assert_close(got[0], want[0], jnp.float32, reduction_length=shape[1])
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, jnp.float32, reduction_length=shape[0])


@needs_mosaic_gpu
@pytest.mark.parametrize("shape,config,resident,staged,walks", [
    ((800, 300), NormalizeConfig(block_groups=3), True, True, True),
    ((3, 7300), None, True, False, False),
    ((2, 16384), None, False, False, False)],
    ids=["walking", "outputs-through-rings", "streamed"])
def test_forward_blocks(shape, config, resident, staged, walks):
    """The forward's ways through its blocks, with a residual, scale and offset: CTAs walking
    3-row blocks of two pieces (267 over an H100's 132 SMs: three CTAs walk three, so a buffer
    is refilled; the last block ragged) in two buffers, the next block's copies in flight while
    one computes, y and the sum staged whole, scale and offset staged once; rows whose staged
    outputs do not fit beside two blocks (7300 float32 columns of x and the residual) writing
    through rings and reading scale/offset from GMEM; rows too long for two blocks (2 x 16384
    float32 inputs), streamed per pass. Against float64."""
    from kernels.normalize.common import Problem
    from kernels.normalize.mosaic_gpu.config import plan_of

    problem = Problem(1, *shape, True, jnp.dtype(jnp.float32), True, 1e-5, True, True, True)
    plan = plan_of(problem, config)
    assert (plan.resident, plan.staged) == (resident, staged)
    assert (plan.programs < plan.num_blocks) == walks, plan
    x, residual = random(shape, jnp.float32, seed=16), random(shape, jnp.float32, seed=17)
    scale, offset = random(shape[-1:], jnp.float32, 18), random(shape[-1:], jnp.float32, 19)
    y, summed = layer_norm(x, scale, offset, residual=residual, implementation="mosaic_gpu",
                           config=config)
    want_sum = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
    assert_close(summed, want_sum, jnp.float32)
    assert_close(y, _truth(want_sum, scale, offset), jnp.float32, reduction_length=2 * shape[1])


@needs_mosaic_gpu
@pytest.mark.parametrize("config,message", [
    (NormalizeConfig(block_reduced=0), "config.block_reduced must be a positive int"),
    (NormalizeConfig(block_groups=0), "config.block_groups must be an int in"),
    (NormalizeConfig(block_groups=17), r"config.block_groups must be an int in \[1, 16\]"),
])
def test_a_config_it_cannot_run_is_rejected(config, message):
    with pytest.raises(ValueError, match=message):
        layer_norm(jnp.ones((256, 4096)), implementation="mosaic_gpu", config=config)


@needs_mosaic_gpu
def test_float64_declines_and_a_sequence_falls_through():
    with jax.enable_x64(True):
        x = jnp.ones((4, 128), jnp.float64)
        with pytest.raises(NotImplementedError, match="float64 is not supported on Mosaic GPU"):
            layer_norm(x, implementation="mosaic_gpu")
        assert layer_norm(x, implementation=("mosaic_gpu", "xla")).dtype == jnp.float64


@needs_mosaic_gpu
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
@pytest.mark.parametrize("shape", [(4096, 8192), (8192, 1024)], ids=["4096x8192", "8192x1024"])
@pytest.mark.parametrize("subtract_mean,residual", [(True, False), (False, False), (True, True),
                                                    (False, True)],
                         ids=["layer", "rms", "layer+residual", "rms+residual"])
def test_design_shapes_stream(target, shape, subtract_mean, residual):
    """By design, at the bench's bfloat16 shapes on an H100 and a B200: each kernel runs one
    CTA an SM, walking blocks with 32 KiB or more of input rows in flight (the next block while
    it computes on one); the forward moves its minimum bytes (x and the residual read once, y
    and the sum written once) and stages scale/offset once a CTA; the backward writes one
    partial row per SM at most and moves at most 5% more than x, dy (and dsum) read and dx
    written once."""
    from kernels import _targets
    from kernels._pallas.lowering import on_target
    from kernels.normalize.common import Problem, backward_flops_and_bytes, minimum_bytes
    from kernels.normalize.mosaic_gpu.backward import _cost as backward_cost
    from kernels.normalize.mosaic_gpu.forward import _cost as forward_cost
    from kernels.normalize.mosaic_gpu.config import plan_of

    bf16 = jnp.dtype(jnp.bfloat16)
    p = Problem(1, *shape, True, bf16, subtract_mean, 1e-5, True, subtract_mean, residual)
    with on_target(_targets.TARGETS[target]):
        forward_plan = plan_of(p, None)
        backward_plan = plan_of(p, None, backward=True, has_gsum=residual)
        num_sms = _targets.current("gpu").num_sms
        for plan in (forward_plan, backward_plan):
            assert plan.resident and plan.in_flight_per_sm >= 32 * 1024, plan
            assert plan.programs <= num_sms and plan.ctas_per_sm == 1, plan
        assert forward_plan.staged and backward_plan.accumulate
        _, moved = forward_cost(p, forward_plan)
        assert moved <= 1.01 * minimum_bytes(p), (moved, minimum_bytes(p))
        _, moved = backward_cost(p, backward_plan, backward_plan.programs, False, residual)
        _, minimum = backward_flops_and_bytes(p, 0, False, residual)
        assert moved <= 1.05 * minimum, (moved, minimum)
