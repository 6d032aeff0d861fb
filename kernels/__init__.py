"""Custom JAX kernels written in Pallas, each with the exact meaning of its `reference` op.

Every op takes keyword-only `implementation=None` ("xla", "triton", "mosaic", "mosaic_gpu" or
a sequence to try in order) and `interpret=None` (None, True, False or "strict": how a kernel runs where its
platform is absent); see docs/design.md. Installed as the `pallas-kernels` distribution.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

import importlib.util
import sys
from pathlib import Path


def _reference_in_place() -> None:
    """Imports the repository's `reference/` as `kernels.reference` (where setup.py installs
    it) in a working tree run as it is, with nothing installed: a lent GPU runs the checkout."""
    if importlib.util.find_spec("kernels.reference") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "reference"
    spec = importlib.util.spec_from_file_location(
        "kernels.reference", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = sys.modules["kernels.reference"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_reference_in_place()

from kernels.conv2d import Conv2dConfig, conv2d
from kernels.gather import GatherConfig, gather
from kernels.matmul import MatmulConfig, matmul
from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm

__all__ = ["conv2d", "Conv2dConfig", "matmul", "MatmulConfig", "normalize", "layer_norm",
           "rms_norm", "NormalizeConfig", "gather", "GatherConfig"]
