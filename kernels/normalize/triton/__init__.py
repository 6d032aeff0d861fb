"""normalize as Pallas kernels lowered through Triton (GPU): forward and backward.

Each kernel's loop nest, per program (tiles and schedule: `config.py`); x[o, b, c] is
the tile of slab o, group block b and chunk c of the reduced axis:

    forward (fused), program (o, b), where with a residual x[o, b, c] means x + r, added on
    load, and the loop writing y also writes it to sum[o, b, c]:
        mean, rstd = merge(moments(x[o, b, c]) for c in chunks)  # one chunk: in registers
        for c in chunks: y[o, b, c] = affine((x[o, b, c] - mean) * rstd)
    moments (split), program (o, b, s):  mean and M2 of the chunks of split s; XLA merges
    normalize (split), program (o, b, c):  y[o, b, c] = affine((x[o, b, c] - mean) * rstd)
    sums (unless sums_in_program), program (o, b, s):  sum(dy·scale), sum(dy·scale·x̂) of split s
    backward, program (c, o, q):
        for b in (q, q + partials, ...):
            sums = the group sums: of tile (o, b, c) with one chunk; of chunks (o, b, 0) and
                   (o, b, 1), re-read in half-chunk tiles, with two; else the sums pass's
            dx[o, b, c] = input_gradient(x[o, b, c], dy[o, b, c], sums)
                          (+ dsum[o, b, c], the sum output's cotangent, with a residual)
            dscale_acc += column sums of dy·x̂;  doffset_acc += column sums of dy
        dscale_partial[o·partials + q, c], doffset_partial[o·partials + q, c] = the accs

Every kernel works on the 3-D view of `common` (rows `(1, groups, reduced)` or columns
`(outer, reduced, groups)`) with 2-D tiles of `block_groups` groups by `block_reduced` elements
(`(block_groups, block_reduced)` for rows, `(block_reduced, block_groups)` for columns); a group
is `num_chunks = cdiv(reduced, block_reduced)` chunks. Every load and store is masked to the
array: the ragged tail of the groups and of the reduced axis reads 0 and writes nothing, so any
shape works without padding copies.

Programs vs the GPU
-------------------
A GPU wants two waves of programs or more (`Target.min_programs`: 264 on an H100's 132 SMs).
Groups give `outer · num_blocks` programs (num_blocks = cdiv(groups, block_groups)); where that
is fewer than the SMs and a group is several chunks long (batch-norm-style statistics over
leading axes, e.g. (1M, 64) over axis 0: 2 group blocks of 8192 chunks), the groups are split
along the reduced axis into `splits` ranges of `per_split` chunks (`schedule_of`), at least two
waves of them, reduced in parallel and merged by XLA, and the elementwise pass gets one
program per tile.

CTAs vs an SM: the backward's programs keep their partial dscale/doffset accumulators in
registers, so a program holding a whole row of 8192 takes 16 warps of 123 registers, one CTA
an SM, whose next row's loads wait for this row's reductions and stores. Its chunks are at most
`config._BACKWARD_MAX_CHUNK` elements where a row would be one chunk (`backward_config`): two
CTAs an SM, one loading while the other computes, as the forward's (the figures beside that
constant; each kernel's `ctas_per_sm` in the compile reports).
"""

from kernels.normalize.triton.backward import backward
from kernels.normalize.triton.config import check, resolve_config, schedule_of
from kernels.normalize.triton.forward import forward

__all__ = ["forward", "backward", "check", "resolve_config", "schedule_of"]
