"""16-bit and 8-bit table rows as 32-bit "word-rows", the unit a TPU DMA can move at any row.

A TPU tile packs 2 (16-bit) or 4 (8-bit) adjacent rows into each 32-bit word, so a DMA cannot
start at any row of such a table; viewed as int32 (`Ref.bitcast`, free: the same tiles) it is
(n / rows_per_word, columns) word-rows, and the row wanted is shifted out of each word in
registers (`row_of_word`). Used by both Mosaic kernels (`forward.py`, `backward.py`): the
forward's table and the backward's cotangent. On a CPU the view is made by XLA instead
(`interpreted_word_rows`, which says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import pl, pltpu

__all__ = ["BITS", "UNSIGNED", "rows_per_word_of", "word_rows", "word_operands",
           "interpreted_word_rows", "row_of_word", "start_row_copy", "tail_group"]

BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}
UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def rows_per_word_of(dtype) -> int:
    """Table rows that share each 32-bit word of a TPU tile: 1 for 32-bit data, 2 for 16-bit,
    4 for 8-bit (the packed layout stacks adjacent rows of a tile into one word)."""
    return 4 // jnp.dtype(dtype).itemsize


def word_rows(ref, n: int, rows_per_word: int):
    """The (n // rows_per_word, columns) int32 view of the whole word-rows of the (n, columns)
    ref `ref`: a free reinterpretation of its packed tiles (`Ref.bitcast`), or `ref` itself
    where it is int32 (the view `interpreted_word_rows` made, or 32-bit bits). None when
    n < rows_per_word."""
    whole = n // rows_per_word * rows_per_word
    if not whole:
        return None
    if ref.dtype == jnp.int32:
        return ref
    return (ref if whole == n else ref.at[pl.ds(0, whole)]).bitcast(jnp.int32)


def word_operands(x: jax.Array, interpret: bool | str) -> tuple[jax.Array, jax.Array]:
    """`x` (batch, n, columns) and its last, partial word-row zero-padded to whole
    (`tail_group`), as the word kernels take them (`interpreted_word_rows`)."""
    tail = tail_group(x, rows_per_word_of(x.dtype))
    return interpreted_word_rows(x, interpret), interpreted_word_rows(tail, interpret)


def interpreted_word_rows(x: jax.Array, interpret: bool | str) -> jax.Array:
    """`x` (batch, n, columns) viewed as `word_rows` does, made by XLA where the kernel is
    interpreted, else `x` itself for the kernel to view. The simulator cannot follow a bitcast
    ref through a DMA, and XLA's constant folding gets the interpreter's bitcast of a constant
    table wrong (both jax 0.10-0.12): so words are built with shifts, exact and layout-free."""
    rows_per_word = rows_per_word_of(x.dtype)
    batch, n, columns = x.shape
    whole = n // rows_per_word * rows_per_word
    if not interpret or not whole or x.dtype == jnp.int32:
        return x
    bits = 32 // rows_per_word
    rows = lax.bitcast_convert_type(x[:, :whole], UNSIGNED[x.dtype.itemsize])
    rows = rows.astype(jnp.uint32).reshape(batch, whole // rows_per_word, rows_per_word, columns)
    words = functools.reduce(jnp.bitwise_or, (rows[:, :, r] << (bits * r)
                                              for r in range(rows_per_word)))
    return lax.bitcast_convert_type(words, jnp.int32)


def row_of_word(words: jax.Array, offset: jax.Array, rows_per_word: int) -> jax.Array:
    """Row `offset` of an int32 word-row whose words each hold `rows_per_word` rows (row 0 in
    the low bits), sign-extended: shifted to the word's top, then arithmetically back."""
    if rows_per_word == 1:
        return words
    bits = 32 // rows_per_word
    return (words << (bits * (rows_per_word - 1 - offset))) >> (bits * (rows_per_word - 1))


def start_row_copy(words_hbm, tail_hbm, row: jax.Array, n: int, rows_per_word: int, vmem,
                    sem) -> None:
    """Starts the DMA of the word-row holding row `row` of an (n, columns) table into the
    (1, columns) int32 `vmem`. `words_hbm` is the table's whole word-rows (`word_rows`);
    the last, partial one (n not a multiple of rows_per_word) comes from `tail_hbm`, a copy of
    its rows zero-padded to a whole word-row, so no read leaves the table."""
    word_row, whole = row // rows_per_word, n // rows_per_word

    def start(source):
        pltpu.make_async_copy(source, vmem, sem).start()

    if whole * rows_per_word == n:
        start(words_hbm.at[pl.ds(word_row, 1)])
        return
    if whole:
        pl.when(word_row < whole)(lambda: start(words_hbm.at[pl.ds(word_row, 1)]))
    pl.when(word_row >= whole)(lambda: start(tail_hbm))


def tail_group(x: jax.Array, rows: int) -> jax.Array:
    """(batch, rows, columns): the rows of `x` (batch, n, columns) past its last whole group of
    `rows`, zero-padded to a whole group (a copy of fewer than `rows` rows)."""
    whole = x.shape[1] // rows * rows
    tail = x[:, whole:, :]
    return jnp.pad(tail, ((0, 0), (0, rows - tail.shape[1]), (0, 0)))
