"""What `implementation=None` runs, per op and platform: one table, each entry with its evidence.

An entry cites a bench record (`python -m bench --record` on a GPU or TPU writes one under
`bench/records/`) with the figures it relies on, or, where nothing has been measured on a
device, gives the design reason for the choice. An entry puts a kernel first only where its
record (or, unmeasured, its design) has it at or ahead of XLA, forward and in a training step,
so `implementation=None` never puts a model on a kernel measured or expected to be slower.
`implementation=` and `$KERNELS_IMPLEMENTATION` still force any kernel. On a CPU (and any
platform not listed) every op runs `xla`.

Status (2026-11): the GPU entries are measured on one H100 (SXM, 80 GB, jax 0.11.2,
`bench/records/nvidia_h100_80gb_hbm3.json`, two runs; ratios are kernel time over XLA's, a
range over the rows that took over 0.1 ms, where two runs agreed within a few percent). That
record's timer (before the chained timer) bottomed out near 37.5 µs a call (its "timer"): its
rows whose roofline floor is under that are marked `below_timer_floor` and compare launch
overhead, not kernels, so no entry relies on them. No kernel has run on a TPU: the TPU entries
are design judgements.
"""

from __future__ import annotations

import dataclasses

from kernels import registry

__all__ = ["Default", "TABLE", "PLATFORMS", "default"]


@dataclasses.dataclass(frozen=True)
class Default:
    implementations: tuple[str, ...]
    evidence: str  # "bench/records/<device kind>.json: <the figures>" or "design: <why>"


# jax.default_backend() (or a device's platform) -> the table's platform.
PLATFORMS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}

# Public op names -> the op family an entry covers.
_FAMILY = {"layer_norm": "normalize", "rms_norm": "normalize"}

_H100 = "bench/records/nvidia_h100_80gb_hbm3.json"

TABLE: dict[tuple[str, str], Default] = {
    ("matmul", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton kernel takes 1.08-1.34x cuBLAS's time in bfloat16 and 3.2-4.9x in "
        "float32 (TF32 both) at 4096^3 and 8192x4096x1024, forward and backward")),
    ("conv2d", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton implicit GEMM's training step (forward and backward) takes "
        "1.76-2.27x cuDNN's time in float32; every forward row is under the record's timer "
        "floor, and the bfloat16 backward rows (0.96-1.58x) are under 0.13 ms and moved by up "
        "to 2x between runs")),
    ("normalize", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton layer norm's forward takes 1.10-1.22x XLA's fusion at 4096x8192 "
        "(float32 and bfloat16); a training step 0.73x in bfloat16 but 1.05-1.07x in float32; "
        "the 8192x1024 and 10000x100 forward rows are under the record's timer floor")),
    ("gather", "gpu"): Default(("xla",), (
        f"{_H100}: the Triton gather forward takes 0.82-0.86x XLA's time, but a training step "
        "(gather and its sorted scatter-add) 1.36-1.68x, table 32000x4096 bfloat16, 8192 ids")),
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
