"""conv2d rows: ResNet-style 3x3 layers, a depthwise layer, and the denoise example's blur.

The blur row (examples/denoise.py: a 5x5 Gaussian per colour channel of scikit-image's cat photo,
"same" padding) also times the tutorial's original `scipy.signal.convolve2d` per channel as a
baseline; it needs the `examples` extra and is left out without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels.reference.conv2d import conv2d as reference_conv2d
from kernels.reference.conv2d import geometry as make_geometry
from bench.harness import WITH_BACKWARD, Case, backward
from kernels.conv2d import OP, conv2d, mosaic
from kernels.conv2d.common import flops_and_bytes, make_problem
from kernels._cases import random

SHAPES = OP.cases.BENCH  # per shape set, in kernels/conv2d/cases.py
# The denoise example's image, whole or (strict: the simulator is slow) a corner of it.
BLUR_CROP = {"native": None, "cpu": None, "interpret": None, "strict": 32}


def _reference(options):
    return lambda x, w: reference_conv2d(x, w, precision="highest", **options)


def _case(x_shape, w_shape, options, dtype) -> Case:
    x, w = random(x_shape, dtype, seed=1), random(w_shape, dtype, seed=2)
    geometry = make_geometry(x.shape, w.shape, data_format="NHWC",
                             **{"stride": 1, "padding": "SAME", "dilation": 1,
                                "feature_group_count": 1, **options})
    problem = make_problem(x.shape, w.shape, x.dtype, w.dtype, geometry, x.dtype)
    flops, nbytes = flops_and_bytes(problem)
    described = ", ".join(f"{k}={v}" for k, v in options.items())
    return Case(
        op="conv2d", shape=f"{'x'.join(map(str, x_shape))} * {'x'.join(map(str, w_shape))}"
        + (f" ({described})" if described else ""),
        dtype=jnp.dtype(dtype).name, args=(x, w),
        run=lambda name, interpret: lambda x, w: conv2d(x, w, implementation=name,
                                                        interpret=interpret, **options),
        expected=_reference(options)(x.astype(jnp.float32), w.astype(jnp.float32)),
        flops=flops, bytes=nbytes,
        # The Mosaic kernel's input staging copy (padding in the wrapper), timed alone:
        # its ratio to xla is what that copy costs next to a whole convolution.
        parts={"mosaic's input padding copy": jax.jit(
            lambda x, w: mosaic.staged_input(x, problem))} if _stages(problem) else {})


def _stages(problem) -> bool:
    try:
        mosaic.check(problem, None)
        return True
    except NotImplementedError:
        return False


def _blur_case(crop: int | None) -> Case | None:
    try:
        from examples import denoise
        image = denoise.load_image(crop)
    except ImportError:  # the `examples` extra (scikit-image, scipy) is not installed
        return None
    noisy = jnp.asarray(denoise.add_noise(image))
    kernel = denoise.gaussian_kernel()
    h, w, c = noisy.shape
    geometry = make_geometry((1, h, w, c), (5, 5, 1, c), stride=1, padding="SAME",
                                         dilation=1, feature_group_count=c, data_format="NHWC")
    flops, nbytes = flops_and_bytes(make_problem((1, h, w, c), (5, 5, 1, c), noisy.dtype,
                                                 noisy.dtype, geometry, noisy.dtype))

    def scipy_blur(image):
        from scipy.signal import convolve2d

        image = np.asarray(image)
        return np.stack([convolve2d(image[..., i], kernel, mode="same") for i in range(c)], -1)

    return Case(
        op="conv2d", shape=f"denoise blur {h}x{w}x{c} * 5x5 depthwise", dtype="float32",
        args=(noisy,),
        run=lambda name, interpret: lambda image: denoise.filter_channels(
            image, kernel, implementation=name, interpret=interpret),
        expected=scipy_blur(noisy), flops=flops, bytes=nbytes,
        baselines={"scipy.signal.convolve2d": scipy_blur})


def cases(shapes: str) -> list[Case]:
    """`shapes`: a key of `SHAPES`; native and interpreted sizes also get the gradient's rows."""
    out = []
    for x_shape, w_shape, options in SHAPES[shapes]:
        for dtype in (jnp.float32, jnp.bfloat16):
            out.append(_case(x_shape, w_shape, options, dtype))
            if shapes in WITH_BACKWARD:
                out.append(backward(out[-1], _reference(options), wrt=(0, 1)))
    blur = _blur_case(BLUR_CROP[shapes])
    return out + ([blur] if blur is not None else [])
