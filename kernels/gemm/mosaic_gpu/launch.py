"""The Mosaic GPU GEMM's launches: `gemm`, a product of arrays (operands laid out, plan,
split-K's sum: matmul's forward and backward, conv2d's float32 weight gradient), and
`launch`, the kernel on operands laid out or on NHWC images (conv2d's passes); and the
bfloat16 parts of Blackwell's float32 products. The kernels are `hopper.py` and
`blackwell.py`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels import _epilogue
from kernels._blocks import round_to_tf32, round_up
from kernels._pallas.mosaic_gpu import mosaic_gpu_call, pad_to
from kernels.gemm.mosaic_gpu import blackwell, hopper
from kernels.gemm.mosaic_gpu.config import (TCGEN05, Plan, is_split, kernel_problem, plan_of,
                                           split_terms)
from kernels.gemm.mosaic_gpu.tiles import Pixels, PixelSums, Terms
from kernels.matmul.common import MatmulConfig, Problem, flops_and_bytes, moved_bytes

__all__ = ["gemm", "Terms", "Pixels", "PixelSums", "launch", "bfloat16_parts",
           "split_parts"]


def bfloat16_parts(x: jax.Array) -> list[jax.Array]:
    """`x` as bfloat16 parts that sum to it (`config.split_terms`): itself where it is
    bfloat16, else hi and lo."""
    if x.dtype == jnp.bfloat16:
        return [x]
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    wide = hi.astype(jnp.float32)
    # Where hi is infinite (x is, or rounds past bfloat16's largest), lo is 0, not inf - inf.
    return [hi, jnp.where(jnp.isfinite(wide), x - wide, 0).astype(jnp.bfloat16)]


def split_parts(a: jax.Array, b: jax.Array, p: Problem, kernel: Problem, plan: Plan
                ) -> tuple[jax.Array, jax.Array, Terms]:
    """Blackwell's float32 and mixed products as bfloat16 ones (`config.split_terms`): each
    operand's parts (`bfloat16_parts`) laid side by side along K once, each padded to the
    plan's K slices of every split (one fused XLA pass an operand), and the `Terms` the
    kernel walks them by."""
    terms = Terms(split_terms(p), plan.splits * plan.k_blocks_per_split(kernel))
    k = terms.blocks * plan.block_k
    a_shape = (k, kernel.m) if p.transpose_a else (kernel.m, k)
    b_shape = (kernel.n, k) if p.transpose_b else (k, kernel.n)
    a = jnp.concatenate([pad_to(part, *a_shape) for part in bfloat16_parts(a)],
                        axis=-2 if p.transpose_a else -1)
    b = jnp.concatenate([pad_to(part, *b_shape) for part in bfloat16_parts(b)],
                        axis=-1 if p.transpose_b else -2)
    return a, b, terms


def _operands(a: jax.Array, b: jax.Array, p: Problem, plan: Plan
              ) -> tuple[jax.Array, jax.Array, Problem, Terms | None]:
    """The operands laid out as `kernel_problem(p)` takes them, that problem and its split
    parts' `Terms` (or None): on Hopper cast to float32 and copied K-major where the product
    runs as TF32 (one fused XLA pass), on Blackwell split into bfloat16 parts (`split_parts`);
    padded with zeros where M, K or N is odd (zeros along K add nothing; the caller cuts the
    output back)."""
    kernel = kernel_problem(p)
    if is_split(p):
        a, b, terms = split_parts(a, b, p, kernel, plan)
        return a, b, kernel, terms
    a = jnp.swapaxes(a, -1, -2) if kernel.transpose_a != p.transpose_a else a
    b = jnp.swapaxes(b, -1, -2) if kernel.transpose_b != p.transpose_b else b
    a, b = a.astype(kernel.a_dtype), b.astype(kernel.b_dtype)
    m, k, n = kernel.m, kernel.k, kernel.n
    a = pad_to(a, *((k, m) if kernel.transpose_a else (m, k)))
    b = pad_to(b, *((n, k) if kernel.transpose_b else (k, n)))
    return a, b, kernel, None


def gemm(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
         p: Problem, *, config: MatmulConfig | None, interpret: bool | str
         ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`op(a) @ op(b)` of arrays with `p.epilogue`, for a problem that `check` accepted (or the
    backward of one): the operands laid out as the kernel takes them (`_operands`), the
    launch, and out_batch + (M, N) cut back from its tiles, with the pre-activation beside it
    where the epilogue saves it. 16-bit products are exact in float32; float32 runs as TF32
    on Hopper, as split bfloat16 on Blackwell (`check` declines HIGHEST)."""
    products = len(split_terms(p)) if is_split(p) else 1  # the MMAs the split parts take
    flops, (m, n) = products * flops_and_bytes(p)[0], (p.m, p.n)
    plan = plan_of(p, config)
    a, b, p, terms = _operands(a, b, p, plan)
    a = a.reshape(math.prod(p.a_batch), *a.shape[-2:])
    b = b.reshape(math.prod(p.b_batch), *b.shape[-2:])
    # The epilogue's windows are swizzled in shared memory: TMA's tensor copy stores them, which
    # drops what falls past the rows (`stored_shape` needs no padding here).
    if residual is not None:
        residual = residual.reshape(p.num_batches, m, n)
    outs = launch(a, b, bias, residual, p, plan, flops, interpret, terms=terms)
    outs = jax.tree.map(lambda out: out[:, :m, :n], outs)
    return jax.tree.map(lambda out: out.reshape(*p.out_batch, m, n), outs)


def launch(a: jax.Array, b: jax.Array, bias: jax.Array | None, residual: jax.Array | None,
           p: Problem, plan: Plan, flops: int, interpret: bool | str,
           name: str = "matmul", terms: Terms | None = None,
           pixels: Pixels | PixelSums | None = None,
           out_shape: tuple[int, ...] | None = None
           ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel on operands laid out as `kernel_problem(p)` takes them (`p` is that problem):
    (num_batches, M, N) outputs (`out_shape` where `pixels` store them as NHWC images:
    `tiles.Pixels`), the epilogue applied (by XLA after the partials' sum where
    `plan` splits K). `bias` is (N,), or (num_batches, N) where each batch has its own
    (unsplit plans); at most N columns, zero-padded to whole tiles. float32 operands (TF32
    products) are rounded to TF32 here (`round_to_tf32`), in the XLA pass that lays them out
    where there is one: TMA feeds the MMA from shared memory, with no register stage where the
    kernel could round them, and the MMA would truncate them."""
    if interpret and jax.config.jax_enable_x64:
        raise NotImplementedError(
            "Mosaic GPU's interpreter (jax 0.12.0.1) fails MLIR verification on a "
            "warp-specialized pipeline under jax_enable_x64 (JAX's own Hopper matmul too); "
            "the compiled kernel is traced with 32-bit defaults and is unaffected")
    a, b = (round_to_tf32(x) if x.dtype == jnp.float32 else x for x in (a, b))
    shape = out_shape or (p.num_batches, p.m, p.n)
    bias = None if bias is None else bias.reshape(-1, bias.shape[-1])
    if plan.splits > 1:  # float32 partials; the epilogue runs in XLA's reduction
        if isinstance(pixels, Pixels):
            raise AssertionError("pixels of the output take one K split")
        partials = p._replace(epilogue=_epilogue.Epilogue())
        out = _launch(a, b, [], partials, plan, jax.ShapeDtypeStruct(
            (plan.splits * p.num_batches, p.m, p.n), jnp.float32), flops, interpret,
            f"{name}_split_k_mosaic_gpu", terms, pixels)
        summed = out.reshape(plan.splits, *shape).sum(axis=0)
        if bias is not None:  # zeros past N, as the caller cuts the output back
            if bias.shape[0] > 1:
                raise AssertionError("a bias per batch is applied by unsplit plans only")
            bias = pad_to(bias[0], p.n)
        if residual is not None:
            residual = pad_to(residual, p.m, p.n)
        return _epilogue.apply_after_sum(summed, bias, residual, p.epilogue, p.out_dtype)
    if bias is not None:  # float32 whole tiles: the epilogue's vector loads stay in bounds
        bias = pad_to(bias.astype(jnp.float32), round_up(p.n, plan.block_n))
    if residual is not None:  # its values are the output dtype's (its dtype is in the
        # result's promotion; a broadcast one was widened for its gradient's sum only)
        residual = pad_to(residual.astype(p.out_dtype), p.m, p.n)
    return _launch(a, b, _epilogue.operands(bias, residual), p, plan,
                   _epilogue.out_shapes(shape, p.out_dtype, p.epilogue), flops, interpret,
                   f"{name}_mosaic_gpu", terms, pixels)


def _launch(a, b, epilogue_operands, p: Problem, plan: Plan, out_shape, flops: int,
            interpret: bool | str, name: str, terms: Terms | None,
            pixels: Pixels | PixelSums | None):
    shapes = jax.tree.leaves(out_shape)
    partial_bytes = 2 * math.prod(shapes[0].shape) * 4 if plan.splits > 1 else 0
    # Traced with 32-bit defaults: under x64, the warp-specialized pipeline's loops (jax
    # 0.12.0.1) would carry int64 steps beside its int32 indices.
    with jax.enable_x64(False):
        outs = _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret,
                     name, terms, pixels)
    return outs[0] if len(shapes) == 1 else tuple(outs)


def _call(a, b, epilogue_operands, p, plan, shapes, flops, partial_bytes, interpret, name,
          terms, pixels):
    if plan.mma == TCGEN05:
        body = functools.partial(blackwell.kernel, terms=terms)
        warpgroups = blackwell.WARPGROUPS
    elif terms is not None:
        raise AssertionError("split parts are Blackwell's (tcgen05 has no TF32 kind)")
    else:
        body, warpgroups = hopper.kernel, hopper.WARPGROUPS
    # TMA loads each term's parts: the bytes of a product along a K that many times longer.
    loaded = p if terms is None else p._replace(k=len(terms.pairs) * p.k)
    return mosaic_gpu_call(
        functools.partial(body, p=p, plan=plan, pixels=pixels),
        out_shape=shapes,
        grid=(plan.num_ctas,), grid_names=("sm",), interpret=interpret, name=name,
        flops_and_bytes=(flops, moved_bytes(loaded, plan.block_m, plan.block_n,
                                            partial_bytes)),
        warpgroups=warpgroups)(a, b, *epilogue_operands)
