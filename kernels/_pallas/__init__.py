"""The one package that imports Pallas backend modules: every kernel call is made here
(`launch.py`: `triton_call`, `mosaic_call`; `tiles.py`: Triton's tile loads and stores), every
kernel under `vmap` that Pallas cannot batch itself (`vmap.py`), and every lowering for a
platform this machine lacks (`lowering.py`: `on_target`, `lower`, `lowered_text`). Kernels
import what they need from here, not from its modules.

Everything that differs between the supported jax versions (0.10.2 on Python 3.11, the newest on
Python 3.12+) is hidden here, so a version difference is fixed in one place: compiler-parameter
classes, Triton's masked load/store, TPU interpret parameters, and the abstract device that lets
jax 0.11+ lower a kernel for a platform this machine does not have. What a Mosaic kernel's
pipeline moves is worked out in `kernels._traffic`.
"""

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._pallas.launch import (mosaic_call, mosaic_precision, triton_call, varying_axes,
                                    vmem_limit)
from kernels._pallas.lowering import (MOSAIC_CALL_MARKER, TRITON_CALL_MARKER, lower, lowered_text,
                                      on_target)
from kernels._pallas.tiles import triton_load, triton_store
from kernels._pallas.vmap import mapped_under_vmap, reset_tpu_interpret_state

__all__ = ["pl", "pltpu", "triton_load", "triton_store", "triton_call", "mosaic_call",
           "mosaic_precision", "mapped_under_vmap", "vmem_limit", "varying_axes",
           "reset_tpu_interpret_state", "TRITON_CALL_MARKER", "MOSAIC_CALL_MARKER", "on_target",
           "lower", "lowered_text"]
