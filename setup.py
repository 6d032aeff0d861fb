"""The packages the wheel installs: `kernels` and its subpackages, and the repository's
`reference/` as `kernels.reference`, so the distribution claims no generic top-level import
name. Everything else about the distribution is in pyproject.toml (pyproject's tables cannot
map one folder under another package's name while finding the rest)."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kernels", "kernels.*"]), "kernels.reference"],
      package_dir={"kernels.reference": "reference"})
