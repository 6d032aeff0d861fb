"""Custom JAX kernels written in Pallas, each with the exact meaning of its `reference` op.

Every op takes keyword-only `implementation=None` ("xla", "triton", "mosaic", "mosaic_gpu" or
a sequence to try in order) and `interpret=None` (None, True, False or "strict": how a kernel runs where its
platform is absent); see docs/design.md. Installed as the `pallas-kernels` distribution.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from kernels.conv2d import Conv2dConfig, conv2d
from kernels.gather import GatherConfig, gather
from kernels.matmul import MatmulConfig, matmul
from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm

__all__ = ["conv2d", "Conv2dConfig", "matmul", "MatmulConfig", "normalize", "layer_norm",
           "rms_norm", "NormalizeConfig", "gather", "GatherConfig"]
