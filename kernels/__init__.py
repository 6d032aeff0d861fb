"""Custom JAX kernels written in Pallas, each with the exact meaning of its `reference` op.

Every op takes keyword-only `implementation=None` ("xla", "triton", "mosaic" or a sequence to
try in order) and `interpret=None` (run a Pallas kernel interpreted exactly when its platform is
absent), see DESIGN.md.
"""

from kernels.conv2d import Conv2dConfig, conv2d
from kernels.gather import GatherConfig, gather
from kernels.matmul import MatmulConfig, matmul
from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm

__all__ = ["conv2d", "Conv2dConfig", "matmul", "MatmulConfig", "normalize", "layer_norm",
           "rms_norm", "NormalizeConfig", "gather", "GatherConfig"]
