"""A probe of the Mosaic GPU conv2d's A operand read straight from an NHWC image (jax 0.12.0.1):
the facts an implicit GEMM without tap rows rests on, proved in the interpreter and by the real
compilers for sm_90a (wgmma) and sm_100a (tcgen05). The probe kernel (`probe_conv`) is
deliberately plain (a CTA an output tile, one K step in flight, stride 1): the schedule is the
GEMM engine's to have; what is probed is the A tile.

A K step is (tap kh, kw; a slice of `block_k` channels). An output tile is `rows` whole output
rows of `cols` pixels (OW rounded up to TMA's 8-row tile), rows of the flattened (image, output
row) grid, so a tile may span two images. Its A tile is one TMA box a row:
`x[n, oh + kh + top, ow0 + kw + left : +cols, c0 : c0 + block_k]` into rows `r * cols` of the
(block_m, block_k) slot, the top and left padding being negative starts. What it shows:

- **Layout inference wants tile-aligned starts.** Copied into the slot's tiled view (8-row
  tiles, the one wgmma and tcgen05 read), Mosaic GPU's layout inference requires each box's
  start along W to be a multiple of the 8-row tile, which a tap's column (`kw - left`) is not
  (it fails an assertion while diagnosing it). The box goes instead through a swizzle-only view
  of the same bytes (`plgpu.RefUnion` of the two views): with `block_k` times the itemsize equal
  to the swizzle (128 bytes), the tiled and the swizzle-only layouts of a (rows, block_k) slot
  are the same bytes, 8 rows of 128 bytes a swizzle atom.
- **Padding is the hardware's.** A start before the image (the top and left padding) or past it
  (the right and bottom, a tile's rows past the last image) is read as zeros by TMA's tensor
  copy; Mosaic GPU takes a negative traced start (a static one is rejected at trace time).
- **The output is stored in NHWC** by one TMA box a row, which drops the columns past OW.
- **What the interpreter cannot run, and what runs instead.** It zero-fills a box past an
  array's end as TMA does, but takes a negative start as NumPy does (from the end), and keeps
  a `RefUnion`'s views apart (the tiled view reads what the other never wrote: NaN). So
  interpreted, x is padded at the top and left by XLA (one copy, starts shifted by the padding)
  and each box goes to the tiled view directly; the union of views and the negative starts are
  proved by compiling (`test_probe_compiles`), not by numerics.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.support import assert_close, needs, skip_without_xla_gpu_compiler, subprocess_env

pytestmark = needs("mosaic_gpu")

TMA_ROWS = 8  # a swizzled shared-memory tile's rows
SWIZZLE = 128  # bytes: block_k x itemsize, so the slot's two views are the same bytes


def probe_conv(x: jax.Array, w: jax.Array, *, padding: int, interpret: bool,
               tcgen05: bool = False, block_m: int = 128, block_n: int = 64) -> jax.Array:
    """A stride-1 convolution (N, H, W, C) x (KH, KW, C, O) with `padding` on every side, in
    float32, by the probe kernel (the module's docstring)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from kernels._pallas import pl
    from kernels._pallas.mosaic_gpu import mosaic_gpu_call

    images, height, width, channels = x.shape
    kh, kw, _, out_channels = w.shape
    out_h, out_w = height + 2 * padding - kh + 1, width + 2 * padding - kw + 1
    cols = pl.cdiv(out_w, TMA_ROWS) * TMA_ROWS
    rows = block_m // cols  # whole output rows a tile
    block_k = SWIZZLE // x.dtype.itemsize
    channel_blocks = channels // block_k
    b = w.reshape(kh * kw * channels, out_channels)
    if interpret:  # negative starts as the padding XLA adds (the module's docstring)
        x = jnp.pad(x, ((0, 0), (padding, 0), (padding, 0), (0, 0)))
    origin = 0 if interpret else -padding

    def tiled(shape, dtype):
        swizzle = plgpu.SwizzleTransform(SWIZZLE)
        tiling = plgpu.TilingTransform((TMA_ROWS, SWIZZLE // jnp.dtype(dtype).itemsize))
        return plgpu.SMEM(shape, dtype, transforms=(tiling, swizzle))

    def swizzled(shape, dtype):
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(SWIZZLE),))

    a_slot = ((block_m, block_k), x.dtype)
    slot = tiled(*a_slot) if interpret else plgpu.RefUnion(swizzled(*a_slot), tiled(*a_slot))

    def body(x_gmem, b_gmem, out_gmem):
        m_tile, n_tile = lax.axis_index("m"), lax.axis_index("n")
        channels_out = pl.ds(n_tile * block_n, block_n)

        def image_row(r):  # (image, output row) of the tile's row r; past the last: zeros
            flat = m_tile * rows + r
            return flat // out_h, flat % out_h

        @functools.partial(pl.run_scoped, a=slot, b_smem=tiled((block_k, block_n), b.dtype),
                           out_smem=tiled((block_m, block_n), jnp.float32),
                           loaded=plgpu.Barrier(num_arrivals=rows + 1))
        def _(a, b_smem, out_smem, loaded):
            boxes, a_smem = (a, a) if interpret else a

            acc_type = (plgpu.TMEM((block_m, block_n), jnp.float32) if tcgen05
                        else plgpu.ACC((block_m, block_n), jnp.float32))
            done = dict(done=plgpu.Barrier(orders_tensor_core=True)) if tcgen05 else {}

            @functools.partial(pl.run_scoped, acc=acc_type, **done)
            def _(acc, done=None):
                def step(k, carry):
                    tap, c0 = k // channel_blocks, k % channel_blocks * block_k
                    i, j = tap // kw, tap % kw
                    for r in range(rows):
                        image, row = image_row(r)
                        plgpu.copy_gmem_to_smem(
                            x_gmem.at[image, row + i + origin, pl.ds(j + origin, cols),
                                      pl.ds(c0, block_k)],
                            boxes.at[pl.ds(r * cols, cols)], loaded)
                    plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(k * block_k, block_k), channels_out],
                                            b_smem, loaded)
                    plgpu.barrier_wait(loaded)
                    if tcgen05:
                        plgpu.tcgen05_mma(acc, a_smem, b_smem, done, accumulate=k > 0)
                        plgpu.barrier_wait(done)
                    else:
                        plgpu.wgmma(acc, a_smem, b_smem)
                        plgpu.wgmma_wait(0)
                    return carry

                lax.fori_loop(0, kh * kw * channel_blocks, step, None)
                if tcgen05:
                    out_smem[...] = plgpu.async_load_tmem(acc)
                    plgpu.wait_load_tmem()
                else:
                    out_smem[...] = acc[...]
            plgpu.commit_smem()
            zero = m_tile - m_tile  # a traced start: a static box wider than OW is rejected
            for r in range(rows):
                image, row = image_row(r)
                plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(r * cols, cols)],
                                        out_gmem.at[image, row, pl.ds(zero, cols), channels_out])
            plgpu.wait_smem_to_gmem(0)

    out = jax.ShapeDtypeStruct((images, out_h, out_w, out_channels), jnp.float32)
    grid = (pl.cdiv(images * out_h, rows), pl.cdiv(out_channels, block_n))
    return mosaic_gpu_call(body, out_shape=[out], grid=grid, grid_names=("m", "n"),
                           interpret=interpret, name="nhwc_probe")(x, b)[0]


def _truth(x, w, padding: int) -> np.ndarray:
    """The convolution in float64 (NumPy): the sum over taps of shifted windows."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw = w.shape[:2]
    padded = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    out_h, out_w = padded.shape[1] - kh + 1, padded.shape[2] - kw + 1
    return sum(padded[:, i:i + out_h, j:j + out_w] @ w[i, j]
               for i in range(kh) for j in range(kw))


# (x, w): a tile of 16 rows of 7 pixels (8 columns) spans images; 14 is two tiles of 8 columns
# a row; 28 is 32 columns, 4 rows a tile; two channel slices a tap.
SHAPES = [((3, 7, 7, 64), (3, 3, 64, 64)), ((1, 14, 14, 64), (3, 3, 64, 128)),
          ((2, 28, 28, 128), (3, 3, 128, 64))]


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
def test_interpreted_probe_is_the_convolution(x_shape, w_shape):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape).astype(jnp.bfloat16)
    w = jax.random.normal(kw, w_shape).astype(jnp.bfloat16)
    got = probe_conv(x, w, padding=1, interpret=True)
    assert_close(got, _truth(x, w, 1), jnp.float32, reduction_length=9 * x_shape[-1], dot=True)


# Run in a process of its own a target: Mosaic GPU keeps the first GPU generation a process
# compiled for (`kernels.compile.mosaic_gpu.OWN_PROCESS`).
_COMPILE = """
import functools, json, sys
from kernels.compile import use_compile_only_devices
use_compile_only_devices()
import jax, jax.numpy as jnp
from kernels.compile.api import compile_kernels
from tests.test_conv2d_nhwc_probe import probe_conv
target, shapes = sys.argv[1], json.loads(sys.argv[2])
for x_shape, w_shape in shapes:
    fn = functools.partial(probe_conv, padding=1, interpret=False, tcgen05=target == "sm_100")
    [report] = compile_kernels(fn, jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
                               jax.ShapeDtypeStruct(w_shape, jnp.bfloat16), target=target,
                               implementation="mosaic_gpu")
    print(json.dumps(dict(error=report.error, spills=report.spill_bytes, mma=report.mma,
                          tma=report.tma)))
"""


@pytest.mark.parametrize("target,mma", [("sm_90", "wgmma.mma_async"), ("sm_100", "tcgen05.mma")])
def test_probe_compiles(target, mma):
    """Negative starts, the union of the slot's views and the NHWC stores compile, at the
    small shapes and the ResNet layer's 56x56x64 (a tile of two rows of 56)."""
    skip_without_xla_gpu_compiler()
    shapes = [SHAPES[0], ((32, 56, 56, 64), (3, 3, 64, 64))]
    proc = subprocess.run([sys.executable, "-c", _COMPILE, target, json.dumps(shapes)],
                          capture_output=True, text=True, timeout=600,
                          env=subprocess_env(cpu_only=False), cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(shapes)
    for report in reports:
        assert report["error"] is None and report["spills"] == 0, report
        assert report["mma"] and all(i.startswith(mma) for i in report["mma"]), report
        assert report["tma"]["load"] > 0 and report["tma"]["store"] > 0, report
