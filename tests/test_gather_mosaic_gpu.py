"""What gather's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12) adds to
the op's shared test base (which runs it too): its plans in Mosaic GPU's interpreter with its
race detector (a forward ring over more pieces than slots, ragged tiles, the fill row; a
backward whose segments outrun the ring of cotangent rows, over several row blocks), and what
it rejects and declines. On an older jax it declines with the reason. Its compiled kernels,
whole programs and export: tests/test_mosaic_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import registry
from kernels.gather import GatherConfig, gather
from kernels.gather.common import Problem
from tests.support import assert_close, needs, random
from tests.test_gather import assert_exact, expected_gather, expected_gradient

needs_mosaic_gpu = needs("mosaic_gpu")
pytestmark = pytest.mark.usefixtures("strict_interpret")


@pytest.mark.skipif(registry.unavailable("mosaic_gpu") is None,
                    reason="this jax has Mosaic GPU")
def test_an_older_jax_declines_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"gather: mosaic_gpu: needs jax >= 0.12"):
        gather(jnp.ones((4, 128)), jnp.asarray([1]), implementation="mosaic_gpu")


@needs_mosaic_gpu
@pytest.mark.parametrize("mode", [None, "fill", "wrap"])
@pytest.mark.parametrize("block_columns,plan", [(2048, (4, 1, 8)), (None, (1, 5, 40))],
                         ids=["ring", "groups"])
def test_rows_of_several_pieces(mode, block_columns, plan):
    """Rows of 1100 float32 (5 pieces of 256 columns, the last ragged), out-of-range ids, in
    tiles of 3 ids (the last ragged: its positions past the ids repeat the last one, their rows
    dropped by the store). One CTA walks a tile's 5 pieces through a ring of 4 slots; or, by
    default on an H100 (8 tiles, under two waves of its SMs), 5 CTAs take a piece each, one
    slot (a load, then its store)."""
    from kernels.gather.mosaic_gpu.config import forward_plan

    config = GatherConfig(block_indices=3, block_columns=block_columns)
    x = random((2, 37, 1100), jnp.float32, seed=1)
    ids = jnp.asarray([5, -1, 36, 40, -38, 0, 7, 7, 12, 99], jnp.int32)
    schedule = forward_plan(Problem(2, 37, 1100, 10, jnp.dtype(jnp.float32), "clip", None),
                            config)
    assert (schedule.slots, schedule.groups, schedule.programs) == plan
    out = gather(x, ids, axis=1, mode=mode, fill_value=-3.0, implementation="mosaic_gpu",
                 config=config)
    assert_exact(out, expected_gather(x, ids, 1, mode, -3.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8], ids=str)
@pytest.mark.parametrize("columns", [1, 3, 8, 33, 100, 256, 300])
def test_each_tile_row_starts_where_tma_can_write(dtype, columns):
    """A tile's rows are loaded by one TMA copy each, at the row's offset in shared memory,
    which TMA needs at a multiple of `TMA_SMEM_ALIGNMENT` bytes: rows of 16-byte multiples
    (what the GMEM side needs) raised CUDA_ERROR_MISALIGNED_ADDRESS on an H100. A short row's
    box is the row rounded up; the copy zero-fills the columns past it."""
    from kernels._pallas.mosaic_gpu import PIECE, TMA_SMEM_ALIGNMENT
    from kernels.gather.mosaic_gpu.config import forward_plan

    itemsize = jnp.dtype(dtype).itemsize
    plan = forward_plan(Problem(1, 1000, columns, 64, jnp.dtype(dtype), "clip", None), None)
    assert plan.box * itemsize % TMA_SMEM_ALIGNMENT == 0
    assert plan.box == PIECE or plan.box * itemsize - plan.aligned * itemsize < TMA_SMEM_ALIGNMENT
    assert plan.num_pieces * plan.box >= plan.aligned


@needs_mosaic_gpu
def test_segments_longer_than_the_ring_over_row_blocks():
    """One id hit 40 times (more than the 16 cotangent rows in flight), its neighbours once or
    not at all, over blocks of 4 table rows (the last ragged) and 2 pieces; against float64."""
    from kernels.gather.mosaic_gpu.config import backward_plan

    config = GatherConfig(block_rows=4)
    ids = np.concatenate([np.full(40, 6), [0, 5, 7, 13, -1, 14, 2, 6]]).astype(np.int32)
    np.random.default_rng(2).shuffle(ids)
    x = random((14, 300), jnp.bfloat16, seed=3)
    ct = random((ids.size, 300), jnp.bfloat16, seed=4)
    plan = backward_plan(Problem(1, 14, 300, ids.size, jnp.dtype(jnp.bfloat16), "clip", None),
                         config)
    assert (plan.tile_rows, plan.blocks, plan.num_pieces, plan.pieces.count) == (4, 4, 2, 0)
    assert plan.slots < 40
    dx = jax.vjp(lambda x: gather(x, jnp.asarray(ids), implementation="mosaic_gpu",
                                  config=config), x)[1](ct)[0]
    # bfloat16 terms summed in float32, rounded once to bfloat16.
    assert_close(dx, expected_gradient(x.shape, ct, ids), jnp.bfloat16, reduction_length=1)


@needs_mosaic_gpu
def test_a_hot_id_is_summed_in_pieces():
    """One id hit 250 times of 300 (a padding id, say): its owner sums its first 64 positions
    and 3 pieces of up to 64 the rest, each a CTA of its own (no CTA's walk grows with the
    hits); the other rows' owners walk theirs compacted. Against float64, in two batch
    slices."""
    from kernels.gather.mosaic_gpu.config import backward_plan

    ids = np.concatenate([np.full(250, 3), np.arange(-25, 25)]).astype(np.int32)
    np.random.default_rng(5).shuffle(ids)
    x = random((2, 40, 132), jnp.float32, seed=6)
    ct = random((2, ids.size, 132), jnp.float32, seed=7)
    plan = backward_plan(Problem(2, 40, 132, ids.size, jnp.dtype(jnp.float32), "clip", None),
                         None)
    assert plan.pieces == (64, 4)
    dx = jax.vjp(lambda x: gather(x, jnp.asarray(ids), axis=1, mode="clip",
                                  implementation="mosaic_gpu"), x)[1](ct)[0]
    assert_close(dx, expected_gradient(x.shape, ct, ids, 1, "clip"), jnp.float32,
                 reduction_length=250)


@needs_mosaic_gpu
def test_padding_a_long_table_declines_and_a_sequence_falls_through():
    """A last-axis gather of rows of 100000 float32: its (4, 100000, 1) view's rows of 4 bytes
    would be padded to 16, a copy of 8 MB for a gather of 56 bytes."""
    x, ids = random((4, 100000), jnp.float32, seed=8), jnp.asarray([7, -1], jnp.int32)
    with pytest.raises(NotImplementedError, match=r"mosaic_gpu: rows of 1 float32 are not a "
                                                  r"multiple of 16 bytes"):
        gather(x, ids, axis=1, implementation="mosaic_gpu")
    out = gather(x, ids, axis=1, implementation=("mosaic_gpu", "xla"))
    assert_exact(out, expected_gather(x, ids, 1))


@needs_mosaic_gpu
@pytest.mark.parametrize("config,message", [
    (GatherConfig(block_indices=0), r"config.block_indices must be a positive int in "
                                    r"\[1, 256\]"),
    (GatherConfig(block_indices=257), r"config.block_indices must be a positive int in "
                                      r"\[1, 256\]"),
    (GatherConfig(block_rows=300), r"config.block_rows must be a positive int in \[1, 256\]"),
    (GatherConfig(block_columns=-1), r"config.block_columns must be a positive int, got -1"),
    (GatherConfig(block_indices=256), r"config.block_indices=256: a tile of 256 rows of 256 "
                                      r"float32 is over the \d+ bytes of shared memory"),
    (GatherConfig(block_rows=256), r"config.block_rows=256: \d+ bytes of shared memory, over "
                                   r"the \d+ a CTA plans"),
])
def test_a_config_it_cannot_run_is_rejected(config, message):
    with pytest.raises(ValueError, match=message):
        gather(jnp.ones((300, 256)), jnp.arange(300), implementation="mosaic_gpu",
               config=config)


@needs_mosaic_gpu
def test_64_bit_tables_decline_and_a_sequence_falls_through():
    with jax.enable_x64(True):
        x, ids = jnp.arange(12, dtype=jnp.int64).reshape(6, 2), jnp.asarray([1, -1])
        with pytest.raises(NotImplementedError,
                           match="int64 tables are not supported on Mosaic GPU"):
            gather(x, ids, implementation="mosaic_gpu")
        assert_exact(gather(x, ids, implementation=("mosaic_gpu", "xla")),
                     expected_gather(x, ids))
