"""The DMA ring both Mosaic gather kernels walk (`forward.py`, `backward.py`), and the SMEM
staging of the index vectors its copies read.

The ring (`Ring`; its depth from `config.ring_depth`): `depth` buffers of one word-row
each, with a semaphore each, as many as hold 1 MiB, between 8 and 64: at least 1 MiB in
flight for rows of 4096 columns and more, 64 copies of narrower ones (256 KiB at 1024
columns).

Indices are staged from HBM into SMEM `INDEX_BLOCK` (128) at a time into `staged_blocks()`
slots (3 on a TPU), the next block arriving while one is used, so the ring fills once per
sequence of positions and drains once at its end, not at each staging block. Staging copies
start at multiples of 128 (1-D int32 arrays are tiled by 128 words); the wrapper pads the index
vector to a multiple of 128 (`padded_to_blocks`) so every staging copy stays inside it, and no
step uses a padded entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import pl, pltpu
from kernels.gather.mosaic.config import INDEX_BLOCK, positions_per_iteration, staged_blocks

__all__ = ["Ring", "padded_to_blocks", "stage", "staged_scratch", "staged_value"]


def padded_to_blocks(vector: jax.Array) -> jax.Array:
    """`vector` padded to a multiple of the SMEM staging block, so staging copies from aligned
    offsets stay inside it (the padding is never used)."""
    padding = -vector.shape[0] % INDEX_BLOCK
    return jnp.pad(vector, (0, padding)) if padding else vector


def _index_block(block: jax.Array, start: jax.Array | None = None):
    """The slice of 128-entry index block `block` (aligned: a 1-D int32 tile is 128 words),
    starting at `start` (a multiple of 128; default: the block's own offset)."""
    start = block * INDEX_BLOCK if start is None else start
    return pl.ds(pl.multiple_of(start, INDEX_BLOCK), INDEX_BLOCK)


def stage(hbm, block: jax.Array, smem) -> None:
    """Copies the 128-entry block `block` of an int32 vector in HBM into SMEM."""
    pltpu.sync_copy(hbm.at[_index_block(block)], smem)


def staged_scratch() -> Any:
    """SMEM for one vector `Ring` stages: `staged_blocks()` blocks of 128 int32."""
    return pltpu.SMEM((staged_blocks() * INDEX_BLOCK,), jnp.int32)


def staged_value(smem, j: jax.Array) -> jax.Array:
    """Position `j`'s entry of a vector staged by `Ring` (block b in SMEM slot b % slots; a
    mask where the slots are a power of two)."""
    size = smem.shape[0]
    return smem[j & (size - 1) if size & (size - 1) == 0 else j % size]


@dataclasses.dataclass(frozen=True)
class Ring:
    """Row DMAs for the positions [first, end) of a sequence, `depth` of them in flight, each
    into its own buffer with its own semaphore: position j + depth's copy starts as soon as
    position j's row has been used. The index vectors the copies read are staged into SMEM a
    128-entry block at a time, the next block while this one is used (`staged_blocks()` slots),
    so the ring fills once at the sequence's start (`fill`) and drains once at its end, not at
    every staging block; `run` walks the positions of one block.

    Preconditions: `depth` <= 128 (`ring_depth`: a copy runs at most one staging block ahead
    of its use, which 3 slots suffice for); `fill(first)` with first < end, then `run` over
    contiguous, ascending ranges [lo, hi), each inside one 128-position block, up to `end`.

    `staged`: (HBM vector, SMEM scratch of `staged_scratch()`) pairs, read through
    `staged_value`. `start_copy(j, buffer, sem)` starts position j's row copy; `use(j,
    buffer)` reads it once landed. `wait_like`: an HBM ref of a buffer's shape, whose
    descriptor waits for any row copy on a semaphore (every copy has that shape).
    `staging_sem`: one semaphore, since at most one block's staging is in flight."""

    buffers: Any
    sems: Any
    staging_sem: Any
    wait_like: Any
    staged: tuple[tuple[Any, Any], ...]
    end: jax.Array
    start_copy: Callable[..., None]
    use: Callable[..., None]

    def __post_init__(self):
        assert self.depth <= INDEX_BLOCK, self.depth

    @property
    def depth(self) -> int:
        return self.buffers.shape[0]

    def _staging(self, block: jax.Array) -> list[Any]:
        slots = self.staged[0][1].shape[0] // INDEX_BLOCK
        slot = _index_block(block, block % slots * INDEX_BLOCK)
        return [pltpu.make_async_copy(hbm.at[_index_block(block)], smem.at[slot],
                                      self.staging_sem)
                for hbm, smem in self.staged]

    def _start_staging(self, block: jax.Array) -> None:
        for copy in self._staging(block):
            copy.start()

    def _wait_staging(self, block: jax.Array) -> None:
        for copy in self._staging(block):
            copy.wait()

    def _start(self, j: jax.Array) -> None:
        slot = j % self.depth
        self.start_copy(j, self.buffers.at[slot], self.sems.at[slot])

    def _wait_and_use(self, j: jax.Array) -> None:
        slot = j % self.depth
        pltpu.make_async_copy(self.wait_like, self.buffers.at[slot], self.sems.at[slot]).wait()
        self.use(j, self.buffers.at[slot])

    def fill(self, first: jax.Array) -> None:
        """Stages `first`'s block (and the next block, when first + depth crosses into it
        and it is below `end`), starts the copies of [first, first + depth), and starts
        staging the block after them if it is below `end`. The first one or two stagings are
        waited for here: a scatter-add step with short segments pays their SMEM round trips."""
        block = first // INDEX_BLOCK
        self._start_staging(block)
        self._wait_staging(block)
        next_start = (block + 1) * INDEX_BLOCK
        spans_two = jnp.logical_and(first + self.depth > next_start, next_start < self.end)

        @pl.when(spans_two)
        def _():
            self._start_staging(block + 1)
            self._wait_staging(block + 1)

        following = block + 1 + spans_two.astype(jnp.int32)
        pl.when(following * INDEX_BLOCK < self.end)(lambda: self._start_staging(following))

        def start(j, carry):
            self._start(j)
            return carry

        lax.fori_loop(first, jnp.minimum(first + self.depth, self.end), start, 0)

    def run(self, lo: jax.Array, hi: jax.Array) -> None:
        """Uses positions [lo, hi) of one staged block, starting the copy `depth` positions
        ahead after each use while there is one. The use of position `cross_at` starts the
        first copy whose index lies in the next block: before it, that block's staging is
        waited for and the one after it started (its slot held the block before this one,
        all used)."""
        block = lo // INDEX_BLOCK
        cross_at = (block + 1) * INDEX_BLOCK - self.depth
        drain_from = jnp.clip(self.end - self.depth, lo, hi)
        next_block_from = jnp.clip(cross_at, lo, drain_from)

        def step(j, carry):
            self._wait_and_use(j)
            self._start(j + self.depth)  # into the buffer just used
            return carry

        def drain(j, carry):
            self._wait_and_use(j)
            return carry

        # Loops rather than one with branches: a branch around a DMA into the ring makes the
        # interpreter copy the whole ring at every position.
        self._walk(lo, next_block_from, step)

        @pl.when(jnp.logical_and(cross_at >= lo, cross_at < drain_from))
        def _():
            self._wait_staging(block + 1)
            pl.when((block + 2) * INDEX_BLOCK < self.end)(
                lambda: self._start_staging(block + 2))

        self._walk(next_block_from, drain_from, step)
        self._walk(drain_from, hi, drain)

    def _walk(self, lo: jax.Array, hi: jax.Array, body: Callable[..., Any]) -> None:
        """`body(j, carry)` for j in [lo, hi), in order, `positions_per_iteration` positions to a
        loop iteration (the rest in a loop of one)."""
        per, start = positions_per_iteration(), lo
        if per > 1:
            def positions(i, carry):
                for k in range(per):
                    body(lo + i * per + k, carry)
                return carry

            whole = jnp.maximum(hi - lo, 0) // per
            lax.fori_loop(jnp.int32(0), whole, positions, 0)
            start = lo + whole * per
        lax.fori_loop(start, hi, body, 0)
