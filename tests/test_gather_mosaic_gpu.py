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
from tests.support import assert_close, needs, random, skip_without_xla_gpu_compiler
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
@pytest.mark.parametrize("block_indices,block_columns,plan", [
    (10, 2048, (5, 256, 2, 1, 6, 4)), (None, None, (8, 256, 1, 5, 1, 20))],
    ids=["runs", "groups"])
def test_rows_of_several_pieces(mode, block_indices, block_columns, plan):
    """Rows of 1100 float32 (4400 bytes, not whole 128-byte lines: 5 pieces of 256 columns, the
    last ragged), out-of-range ids, 11 ids. In runs of 10 ids: a CTA stages its ids, then walks
    2 tiles of 5 ids x 5 pieces through a ring of 6 slots; the second run is one ragged tile
    (its positions past the ids read row 0, dropped by the store). By default on an H100 (2
    tiles, under two waves of its SMs): 5 CTAs per tile take a piece each, one slot."""
    from kernels.gather.mosaic_gpu.config import forward_plan

    config = GatherConfig(block_indices=block_indices, block_columns=block_columns)
    x = random((2, 37, 1100), jnp.float32, seed=1)
    ids = jnp.asarray([5, -1, 36, 40, -38, 0, 7, 7, 12, 99, 3], jnp.int32)
    schedule = forward_plan(Problem(2, 37, 1100, 11, jnp.dtype(jnp.float32), "clip", None),
                            config)
    assert (schedule.tile_rows, schedule.box, schedule.run_tiles, schedule.groups,
            schedule.slots, schedule.programs) == plan
    out = gather(x, ids, axis=1, mode=mode, fill_value=-3.0, implementation="mosaic_gpu",
                 config=config)
    assert_exact(out, expected_gather(x, ids, 1, mode, -3.0))


@needs_mosaic_gpu
@pytest.mark.parametrize("mode", [None, "fill"])
def test_whole_rows_in_runs_of_tiles(mode):
    """Rows of 64 float32 (256 bytes) move in one linear TMA copy an id, 32 ids a tile; runs of
    200 ids are 7 tiles of 29 ids (203) through a ring of 6 (it wraps), the second run 4 tiles,
    the last ragged (in two batch slices: the store of the first slice's ragged tile stays out
    of the second's rows, `stored_shape`); a run's ids are staged by one copy of 204, the
    second run's past the last id zero-filled."""
    from kernels.gather.mosaic_gpu.config import forward_plan

    config = GatherConfig(block_indices=200)
    x = random((2, 50, 64), jnp.float32, seed=2)
    ids = jnp.asarray(np.random.default_rng(3).integers(-60, 60, 300), jnp.int32)
    schedule = forward_plan(Problem(2, 50, 64, 300, jnp.dtype(jnp.float32), "clip", None),
                            config)
    assert (schedule.box, schedule.num_pieces, schedule.in_bounds) == (64, 1, True)
    assert (schedule.tile_rows, schedule.run_tiles, schedule.slots, schedule.programs) == (
        29, 7, 6, 4)
    out = gather(x, ids, axis=1, mode=mode, fill_value=2.5, implementation="mosaic_gpu",
                 config=config)
    assert_exact(out, expected_gather(x, ids, 1, mode, 2.5))


@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_the_embedding_streams_by_design(target):
    """By design at the bench's embedding (a 32000x4096 bfloat16 table, 8192 ids) on an H100
    and a B200. The forward moves each row by one linear TMA copy (one copy an id), over one
    wave of CTAs within 3% of even, 5 tiles in flight a CTA; its model (`forward_seconds`:
    `_targets.COPY_SHARE`, `_targets.MEMORY_LATENCY`) reaches 85% of the H100's bandwidth
    or more, 84% of the B200's (whose 8 TB/s streams the bytes in 19 us, beside the one
    latency that fills the pipeline).
    The scatter-add's CTAs own whole rows in one span: each block's ids are walked once, by
    one CTA, with 24 KiB of cotangent rows in flight. (Its time against XLA's recorded one:
    `test_the_embedding_gradient_beats_xla_by_design`.)"""
    from kernels import _targets
    from kernels._pallas.lowering import on_target
    from kernels.gather.common import gather_bytes
    from kernels.gather.mosaic_gpu.config import backward_plan, forward_plan, forward_seconds

    p = Problem(1, 32000, 4096, 8192, jnp.dtype(jnp.bfloat16), "clip", None)
    with on_target(_targets.TARGETS[target]):
        spec = _targets.current("gpu")
        forward, backward = forward_plan(p, None), backward_plan(p, None)
        assert (forward.num_pieces, forward.box, forward.in_bounds) == (1, 4096, True)
        assert forward.programs * forward.run_tiles * forward.tile_rows <= 1.03 * p.num_indices
        assert (forward.slots - 1) * forward.tile_rows * 8192 >= 40 * 1024
        share = gather_bytes(p) / forward_seconds(forward) / spec.memory_bandwidth
        assert share >= (0.85 if target == "sm_90" else 0.84), share
        assert (backward.spans, backward.programs) == (1, backward.blocks), backward
        assert (backward.slots - 1) * backward.span_pieces * 256 * 2 >= 24 * 1024


@needs_mosaic_gpu
@pytest.mark.timeout(300)
def test_the_embedding_gradient_beats_xla_by_design():
    """The embedding's gradient on an H100, by its model (`backward_seconds`: the launches of
    XLA's that sort the ids, counted in the compiled training program, and the scatter-add as
    a copy) under half the time XLA's own took in the H100 record; and the whole training
    program moves at most 0.62x the bytes XLA's moves."""
    import json
    import pathlib

    from kernels.compile import CASES
    from kernels.compile.programs import layer_program
    from kernels.gather.mosaic_gpu.config import backward_plan, backward_seconds

    skip_without_xla_gpu_compiler()
    case = next(c for c in CASES["gather"] if c.design)
    p = Problem(1, 32000, 4096, 8192, jnp.dtype(jnp.bfloat16), "clip", None)
    assert [a.shape for a in case.args] == [(32000, 4096), (8192,)]
    launches, nbytes = layer_program(case, "sm_90", "mosaic_gpu")
    _, xla_bytes = layer_program(case, "sm_90", "xla")
    assert nbytes <= 0.62 * xla_bytes, (nbytes, xla_bytes)
    record = json.loads((pathlib.Path(__file__).parents[1] / "bench" / "records"
                         / "nvidia_h100_80gb_hbm3.json").read_text())
    runs = [record["rows"], *(run["rows"] for run in record["mosaic_gpu_runs"]["runs"])]
    xla_seconds = min(1e-3 * r["median_ms"] for rows in runs for r in rows
                      if r["op"] == "gather backward" and r["implementation"] == "xla")
    kernels_launched = 3  # the forward, the pieces and the scatter-add
    seconds = backward_seconds(p, backward_plan(p, None), launches - kernels_launched)
    assert seconds < 0.5 * xla_seconds, (seconds, xla_seconds)


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
@pytest.mark.parametrize("columns,hits,span", [(4352, 66, (17, 9, 2, True, 1)),
                                               (4400, 3, (18, 9, 2, False, 0))],
                         ids=["whole_pieces", "ragged"])
def test_rows_wider_than_a_span(columns, hits, span):
    """Rows of over 4096 float32 are summed a span at a time, each span walking the ids again:
    17 whole pieces in two spans of 9, the second starting at piece 8 (one piece summed and
    stored twice, the same bits), by one linear copy a span, one id hit 66 times (its last two
    positions a piece of their own); or 4400 columns, 18 pieces, a copy each, the last ragged.
    Against float64."""
    from kernels.gather.mosaic_gpu.config import backward_plan

    ids = np.concatenate([np.full(hits, 4), [0, 9, 2, -1]]).astype(np.int32)
    np.random.default_rng(9).shuffle(ids)
    x = random((10, columns), jnp.float32, seed=10)
    ct = random((ids.size, columns), jnp.float32, seed=11)
    plan = backward_plan(Problem(1, 10, columns, ids.size, jnp.dtype(jnp.float32), "clip",
                                 None), None)
    assert (plan.num_pieces, plan.span_pieces, plan.spans, plan.whole,
            plan.pieces.count) == span
    dx = jax.vjp(lambda x: gather(x, jnp.asarray(ids), implementation="mosaic_gpu"), x)[1](ct)[0]
    assert_close(dx, expected_gradient(x.shape, ct, ids), jnp.float32, reduction_length=hits)


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
                                    r"\[1, 2048\] \(ids a CTA stages\)"),
    (GatherConfig(block_indices=2049), r"config.block_indices must be a positive int in "
                                       r"\[1, 2048\]"),
    (GatherConfig(block_rows=0), r"config.block_rows must be a positive int, got 0"),
    (GatherConfig(block_columns=-1), r"config.block_columns must be a positive int, got -1"),
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
