"""Denoise a photograph with `kernels.conv2d`: the image-processing pipeline of JAX's
convolution tutorial, every filter a depthwise convolution.

    python examples/denoise.py [--implementation xla|triton|mosaic] [--output stages.png]

Loads scikit-image's `data.chelsea()` (a cat), scales it to float32 in [0, 1], adds Gaussian
noise, blurs it with a 5x5 Gaussian kernel (sigma 1) per colour channel with "same" padding,
sharpens the blur with the normalized 5x5 kernel that has 50 at the centre and -1 elsewhere,
clips to [0, 1], and writes the four stages side by side as a PNG. Each filter is
`conv2d(..., feature_group_count=3)` on the (1, H, W, 3) image. The result is checked against
the tutorial's original NumPy/SciPy code (`scipy.signal.convolve2d` per channel, float64) and the
largest difference is printed. Needs the `examples` extra (scipy, scikit-image, pillow).

On a machine without a GPU or TPU, `--implementation triton` or `mosaic` runs the kernel in
Pallas' fast interpreter (`--crop` filters only a corner of the image).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.conv2d import conv2d  # noqa: E402  (the function exported as kernels.conv2d)


def gaussian_kernel(size: int = 5, sigma: float = 1.0) -> np.ndarray:
    """A normalized size x size Gaussian kernel."""
    offsets = np.arange(size) - (size - 1) / 2
    profile = np.exp(-offsets**2 / (2 * sigma**2))
    kernel = np.outer(profile, profile)
    return (kernel / kernel.sum()).astype(np.float32)


def sharpen_kernel(size: int = 5) -> np.ndarray:
    """-1 everywhere, 50 at the centre, normalized to sum 1."""
    kernel = -np.ones((size, size), np.float32)
    kernel[size // 2, size // 2] = 50
    return kernel / kernel.sum()


def load_image(crop: int | None = None) -> np.ndarray:
    """The cat, float32 in [0, 1], (H, W, 3); `crop` keeps the top-left crop x crop pixels."""
    from skimage import data

    image = data.chelsea().astype(np.float32) / 255
    return image[:crop, :crop] if crop else image


def add_noise(image: np.ndarray, scale: float = 0.1, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).standard_normal(image.shape).astype(np.float32)
    return image + scale * noise


def filter_channels(image: jax.Array, kernel: np.ndarray, *, implementation=None,
                    interpret=None) -> jax.Array:
    """Convolves each channel of an (H, W, C) image with a 2-D kernel, "same" size.

    `conv2d` correlates, as every deep-learning convolution does; flipping the kernel makes it
    the convolution of `scipy.signal.convolve2d`.
    """
    channels = image.shape[-1]
    w = jnp.broadcast_to(jnp.asarray(kernel[::-1, ::-1])[:, :, None, None],
                         (*kernel.shape, 1, channels))
    out = conv2d(image[None], w, padding="SAME", feature_group_count=channels,
                 implementation=implementation, interpret=interpret)
    return out[0]


def denoise(noisy: jax.Array, *, implementation=None, interpret=None) -> tuple[jax.Array, ...]:
    """(blurred, sharpened and clipped) stages of the pipeline."""
    blurred = filter_channels(noisy, gaussian_kernel(), implementation=implementation,
                              interpret=interpret)
    sharpened = filter_channels(blurred, sharpen_kernel(), implementation=implementation,
                                interpret=interpret)
    return blurred, jnp.clip(sharpened, 0, 1)


def scipy_denoise(noisy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tutorial's original code: `scipy.signal.convolve2d` per channel, in float64."""
    from scipy.signal import convolve2d

    def per_channel(image, kernel):
        return np.stack([convolve2d(image[..., c], kernel.astype(np.float64), mode="same")
                         for c in range(image.shape[-1])], axis=-1)

    blurred = per_channel(noisy.astype(np.float64), gaussian_kernel())
    return blurred, np.clip(per_channel(blurred, sharpen_kernel()), 0, 1)


def save_stages(path: str, stages: list[np.ndarray]) -> None:
    from PIL import Image

    strip = np.concatenate([np.clip(np.asarray(s, np.float64), 0, 1) for s in stages], axis=1)
    Image.fromarray((strip * 255).round().astype(np.uint8)).save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", default=None,
                        help="xla, triton or mosaic (default: the platform's choice)")
    parser.add_argument("--output", default="denoise.png", help="PNG of the four stages")
    parser.add_argument("--noise", type=float, default=0.1, help="noise standard deviation")
    parser.add_argument("--crop", type=int, default=None,
                        help="use only the top-left CROP x CROP pixels (faster when interpreted)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    image = load_image(args.crop)
    noisy = add_noise(image, args.noise, args.seed)
    blurred, result = jax.block_until_ready(
        denoise(jnp.asarray(noisy), implementation=args.implementation))
    want_blurred, want_result = scipy_denoise(noisy)
    blur_error = float(np.max(np.abs(np.asarray(blurred, np.float64) - want_blurred)))
    error = float(np.max(np.abs(np.asarray(result, np.float64) - want_result)))
    print(f"image {image.shape}, implementation {args.implementation or 'default'}")
    print(f"max |kernels.conv2d - scipy.signal.convolve2d|: blur {blur_error:.2e}, "
          f"sharpened and clipped {error:.2e}")
    save_stages(args.output, [image, noisy, blurred, result])
    print(f"wrote {args.output} (original, noisy, blurred, sharpened)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
