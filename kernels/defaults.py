"""What `implementation=None` runs, per op and platform: one table, each entry with its evidence.

An entry cites a bench record (`python -m bench --record` on a GPU or TPU writes one under
`bench/records/`) with the figures it relies on, or, where nothing has been measured on a
device, gives the design reason for the choice. An entry puts a kernel first only where its
record (or, unmeasured, its design) has it at or ahead of XLA, forward and in a training step,
so `implementation=None` never puts a model on a kernel measured or expected to be slower.
`implementation=` and `$KERNELS_IMPLEMENTATION` still force any kernel. On a CPU (and any
platform not listed) every op runs `xla`.

Status (2026-11-26): the GPU entries are measured on one H100 (SXM, 80 GB, jax 0.11.2,
`bench/records/nvidia_h100_80gb_hbm3.json`: the recorded run and a second run on the same
machine right after it, its `second_run`; the Mosaic GPU kernels on another H100 with jax
0.12.0.1, its `mosaic_gpu_runs`). Ratios are kernel time over XLA's, a range over the runs and
the rows named. Both runs used the chained timer, whose floor was 1.5 and 2.8 µs a
call (each run's "timer"); rows whose roofline floor is under it are marked
`below_timer_floor` (the denoise blur, the 10000x100 standardization in the second run), and no
entry relies on them. (The record it replaced used a pipelined timer whose floor was about
37.5 µs.) No kernel has run on a TPU: the TPU entries are design judgements.
"""

from __future__ import annotations

import dataclasses

from kernels import registry

__all__ = ["Default", "TABLE", "PLATFORMS", "default"]


@dataclasses.dataclass(frozen=True)
class Default:
    implementations: tuple[str, ...]
    evidence: str  # "bench/records/<device kind>.json: <the figures>" or "design: <why>"


# jax.default_backend() (or a device's or lowering platform) -> the table's platform.
PLATFORMS = registry.PLATFORMS

# Public op names -> the op family an entry covers.
_FAMILY = {"layer_norm": "normalize", "rms_norm": "normalize"}

_H100 = "bench/records/nvidia_h100_80gb_hbm3.json"

TABLE: dict[tuple[str, str], Default] = {
    ("matmul", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton kernel takes 1.17-1.26x cuBLAS's time forward and 1.27-1.42x "
        "backward in bfloat16, 4.35-5.00x and 1.80-2.04x in float32 (TF32 both), at 4096^3 and "
        "8192x4096x1024; the Mosaic GPU kernel (mosaic_gpu_runs) 1.02-1.12x forward and "
        "1.08-1.10x backward in bfloat16, 0.99-1.08x and 0.99-1.17x in float32, at the same "
        "shapes")),
    ("conv2d", "gpu"): Default(("xla",), (
        f"{_H100}: in bfloat16 the Triton implicit GEMM is ahead of cuDNN (forward 0.42-0.94x, "
        "a training step 0.72-0.96x at ResNet's 56x56x64 3x3, 28x28x128 3x3 stride 2 and "
        "112x112x32 depthwise), but in float32 it takes 1.00-4.50x cuDNN's time forward and "
        "1.08-2.33x backward; the entry is per op, not per dtype, so float32 stays on cuDNN")),
    ("normalize", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton layer norm's forward takes 0.80-1.32x XLA's fusion and its "
        "backward 1.26-1.70x, at 8192x1024 and 4096x8192, float32 and bfloat16")),
    ("gather", "gpu"): Default(("triton", "xla"), (
        f"{_H100}: the Triton gather forward takes 0.99-1.07x XLA's time (at parity) and the "
        "gradient (the wrapper's sort of the ids and the sorted scatter-add) 0.60-0.68x, "
        "table 32000x4096 bfloat16, 8192 ids; the Mosaic GPU kernels 1.03x and 0.76x, behind "
        "Triton's 0.89x and 0.68x in the same run (mosaic_gpu_runs)")),
    ("matmul", "tpu"): Default(("xla",), (
        "design: XLA's TPU matmul is the MXU's reference path; the Mosaic kernel tiles the same "
        "way and is not expected to beat it")),
    ("conv2d", "tpu"): Default(("xla",), (
        "design: XLA lowers convolutions to the MXU natively; the Mosaic kernel's shifted "
        "windows add VMEM copies XLA does not need")),
    ("normalize", "tpu"): Default(("mosaic", "xla"), (
        "design: in bench/design.py's v5e figures layer_norm 8192x1024 and 4096x8192 "
        "bfloat16 move their operands once, forward and backward (with a residual too); the "
        "batch norm reads x twice, as XLA's statistics and normalize fusions do")),
    ("gather", "tpu"): Default(("xla",), (
        "design: 16-bit rows move as 32-bit word-rows (each with its neighbour): the forward "
        "reads 2x the rows' bytes, 1.5x the minimum traffic, and the scatter-add 2x the "
        "cotangent; 32-bit rows move the minimum, but are untimed on a TPU")),
}


def default(op: str, backend: str) -> tuple[str, ...]:
    """The implementations `implementation=None` tries for `op` in a program lowered for
    `backend` (a lowering platform: "cpu", "cuda", "rocm", "tpu")."""
    platform = PLATFORMS.get(backend)
    entry = TABLE.get((_FAMILY.get(op, op), platform)) if platform else None
    return entry.implementations if entry else (registry.REFERENCE,)
