"""conv2d's forward (and, run on the output gradient, its input gradient) and weight gradient
on the Mosaic GPU matmul kernel with shifted rows (the package's docstring has the loop nests).

Block schedules
---------------
Both passes are launches of `kernels.gemm.mosaic_gpu` (persistent, warp-specialized: a TMA
producer and wgmma consumers on Hopper, tcgen05 on Blackwell; its docstring has the CTA's
schedule) on the tap rows of the input (`config.TapRows`, one XLA copy of KW times the input):
  - forward: one batch per group; the CTA tile is block_m output-grid rows x block_n output
    channels; K step k = (tap row kh, block_k of the KW·C/G row) loads the (block_m, block_k)
    tile of the tap rows shifted by `shift(kh)` and the (block_n, block_k) weight tile, and the
    epilogue (bias per group, activation; z where saved) is fused. One K split.
  - weight gradient: one batch per (group, tap row kh): the (width, O/G) product of the tap rows
    shifted by `shift(kh)`, transposed, with the output gradient on the same grid (zeros past
    OH and OW), over the grid's pixels, split along them where the tiles leave SMs idle
    (float32 partials that XLA sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import pad_to
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.mosaic_gpu import depthwise
from kernels.conv2d.mosaic_gpu.config import (forward_plan, forward_problem, forward_terms,
                                              is_depthwise, summed_depthwise, tap_rows,
                                              tap_rows_matrix, weight_grad_problem,
                                              weight_grad_reads_shifted)
from kernels.matmul.common import make_problem as matmul_problem
from kernels.gemm.mosaic_gpu.config import plan_of
from kernels.gemm.mosaic_gpu.launch import Shifts, Terms, bfloat16_parts, launch, matmul
from kernels.gemm.mosaic_gpu.tiles import ONE_TERM

__all__ = ["conv", "weight_grad"]


def conv(x: jax.Array, w: jax.Array, bias: jax.Array | None, p: Problem, *,
         config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The convolution of a problem that `check` accepted, with `p.epilogue`: (N, OH, OW, O)
    in p.out_dtype, and the pre-activation beside it where the epilogue saves it."""
    del precision  # `p.highest`: declined by `check`
    if is_depthwise(p):
        return depthwise.conv(x, w, bias, p, interpret=interpret)
    if summed_depthwise(p):
        return depthwise.summed_conv(x, w, bias, p, interpret=interpret)
    layout, gemm, pairs = tap_rows(p), forward_problem(p), forward_terms(p)
    plan = forward_plan(p, config)
    split = pairs != ONE_TERM  # Blackwell's float32: each operand's parts once (`Terms`)
    x_parts, w_parts = (bfloat16_parts(x), bfloat16_parts(w)) if split else ([x], [w])
    # A config's tile of more than `ROW_BLOCK` rows reads past them: its last window whole.
    last_window = pl.cdiv(gemm.m, plan.block_m) * plan.block_m + layout.max_shift
    rows = max(layout.num_rows, last_window)
    a = jnp.concatenate([pad_to(tap_rows_matrix(part, p, layout, gemm.a_dtype), rows,
                                layout.width) for part in x_parts], axis=-1)

    def weights(part):  # (G, O/G padded, KH, width)
        b = part.reshape(p.kh, p.kw * p.cg, p.groups, p.og).transpose(2, 3, 0, 1)
        return pad_to(b.astype(gemm.b_dtype), gemm.n, p.kh, layout.width)

    b = jnp.stack([weights(part) for part in w_parts], axis=3).reshape(
        p.groups, gemm.n, len(w_parts) * gemm.k)
    if layout.width % plan.block_k or plan.splits != 1:
        raise AssertionError(f"tap rows of {layout.width} in K steps of {plan}")
    terms = Terms(pairs, layout.width // plan.block_k)  # a segment a tap row
    shifts = Shifts(layout.shift, layout.max_shift, per_step=True,
                    steps_per_shift=len(x_parts) * terms.blocks)
    outs = launch(a, b, None if bias is None else bias.reshape(p.groups, p.og), None, gemm,
                  plan, len(pairs) * flops_and_bytes(p)[0], interpret, shifts, name="conv2d",
                  terms=terms if split else None)

    def to_nhwc(out):
        out = out.reshape(p.groups, p.n, layout.rows, layout.cols, gemm.n)
        out = out[:, :, :p.oh, :p.ow, :p.og].transpose(1, 2, 3, 0, 4)
        return out.reshape(p.n, p.oh, p.ow, p.o)

    return jax.tree.map(to_nhwc, outs)


def weight_grad(x: jax.Array, dy: jax.Array, p: Problem, *, precision, interpret: bool | str,
                dtype) -> jax.Array:
    """dW (KH, KW, C/G, O) in `dtype` of the convolution `p` for its output gradient dy."""
    if is_depthwise(p):
        return depthwise.weight_grad(x, dy, p, interpret=interpret, dtype=dtype)
    layout, gemm = tap_rows(p), weight_grad_problem(p, dy.dtype, dtype)
    dy = dy.reshape(p.n, p.oh, p.ow, p.groups, p.og)
    dy = jnp.pad(dy, ((0, 0), (0, layout.rows - p.oh), (0, layout.cols - p.ow), (0, 0), (0, 0)))
    dy = dy.transpose(3, 0, 1, 2, 4).reshape(p.groups, layout.phase_rows, p.og)
    flops = flops_and_bytes(p)[0]
    if weight_grad_reads_shifted(p, dy.dtype, dtype):  # 16-bit: transposed, shifted
        plan = plan_of(gemm, None)
        a = tap_rows_matrix(x, p, layout, gemm.a_dtype)
        b = pad_to(dy.astype(gemm.b_dtype), gemm.k, gemm.n)
        shifts = Shifts(lambda batch: layout.shift(batch % p.kh), layout.max_shift,
                        per_step=False)
        dw = launch(a, b, None, None, gemm, plan, flops, interpret, shifts,
                    name="conv2d_weight_grad")
    else:  # each tap row's windows copied by XLA, then K-major (TF32) or split by the matmul
        a = tap_rows_matrix(x, p, layout, x.dtype)
        windows = jnp.stack([lax.slice_in_dim(a, shift, shift + layout.phase_rows, axis=1)
                             for shift in map(layout.shift, range(p.kh))], axis=1)
        dy = dy[:, None]
        dw = matmul(windows, dy, None, None, matmul_problem(windows, dy, True, False, dtype),
                    config=None, precision=precision, interpret=interpret)
    dw = dw.reshape(p.groups, p.kh, layout.width, -1)[:, :, :p.kw * p.cg, :p.og]
    dw = dw.reshape(p.groups, p.kh, p.kw, p.cg, p.og).transpose(1, 2, 3, 0, 4)
    return dw.reshape(p.kh, p.kw, p.cg, p.o).astype(dtype)
