"""What `implementation=None` runs, per op and platform: one table, each entry with its evidence.

An entry cites a bench record (`python -m bench --record` on a GPU or TPU writes one under
`bench/records/`) with the figures it relies on, or, where nothing has been measured on a
device, gives the design reason for the choice. An entry puts a kernel first only where its
record (or, unmeasured, its design) has it at or ahead of XLA, forward and in a training step
(over the shapes the record times, taken together),
so `implementation=None` never puts a model on a kernel measured or expected to be slower.
An entry reaches only what its evidence covers: a record's device kinds (an H100's record says
nothing of an A100 or a B200, whose calls run `xla` until a record of theirs says otherwise) and,
where the record splits by dtype (a kernel ahead in bfloat16, behind in float32), that dtype.
A program whose device kind tracing cannot tell (a `jax.export` for "cuda" with no device in
scope) gets no per-device entry.
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
37.5 µs.) An H200's record (`bench/records/nvidia_h200.json`) holds the device command's smoke
and rows too coarsely timed to be evidence (its note), so H200s run `xla`. No kernel has run on
a TPU: the TPU entries are design judgements.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kernels import registry

__all__ = ["Default", "TABLE", "PLATFORMS", "default"]


@dataclasses.dataclass(frozen=True)
class Default:
    """One entry: what `implementation=None` tries where the entry reaches.

    device_kinds: the device kinds its record covers, as prefixes of JAX's `device_kind`
      ("NVIDIA H100" covers "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe"); empty: every
      device of the platform (a design entry, which no device kind's timing decides).
    dtypes: the dtypes it covers (of the op's input: x, a, the table); empty: every dtype.
    """

    implementations: tuple[str, ...]
    evidence: str  # "bench/records/<device kind>.json: <the figures>" or "design: <why>"
    device_kinds: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()

    def reaches(self, dtype: Any, device_kind: str | None) -> bool:
        """Whether the entry covers a call of operand `dtype` (None: unknown, which a per-dtype
        entry does not cover) built for `device_kind` (None: unknown, likewise)."""
        if self.dtypes and (dtype is None or jnp.dtype(dtype).name not in self.dtypes):
            return False
        return not self.device_kinds or (
            device_kind is not None and device_kind.startswith(self.device_kinds))


# jax.default_backend() (or a device's or lowering platform) -> the table's platform.
PLATFORMS = registry.PLATFORMS

# Public op names -> the op family an entry covers.
_FAMILY = {"layer_norm": "normalize", "rms_norm": "normalize"}

_H100 = "bench/records/nvidia_h100_80gb_hbm3.json"
_H100_KINDS = ("NVIDIA H100",)
_XLA = ("xla",)

# (op family, platform) -> its entries, the first that reaches a call decides (`default`); a
# call no entry reaches (another device kind, another dtype) runs `xla`, as does every call on
# a platform not listed.
TABLE: dict[tuple[str, str], tuple[Default, ...]] = {
    ("matmul", "gpu"): (Default(_XLA, (
        f"{_H100}: the Triton kernel takes 1.17-1.26x cuBLAS's time forward and 1.27-1.42x "
        "backward in bfloat16, 4.35-5.00x and 1.80-2.04x in float32 (TF32 both), at 4096^3 and "
        "8192x4096x1024; the Mosaic GPU kernel (mosaic_gpu_runs) 1.02-1.12x forward and "
        "1.08-1.10x backward in bfloat16, 0.99-1.08x and 0.99-1.17x in float32, at the same "
        "shapes"), _H100_KINDS),),
    ("conv2d", "gpu"): (
        Default(("triton", "xla"), (
            f"{_H100}: in bfloat16 the Triton implicit GEMM takes 0.42-0.94x cuDNN's time "
            "forward at ResNet's 56x56x64 3x3, 28x28x128 3x3 stride 2 (to 256) and 112x112x32 "
            "depthwise, and 0.81-0.97x a training step at the stride-1 and depthwise layers; "
            "the stride-2 layer's training step takes 1.15-1.19x, so the three layers' steps "
            "together take 0.93-0.98x"), _H100_KINDS, ("bfloat16",)),
        Default(_XLA, (
            f"{_H100}: in float32 the Triton implicit GEMM takes 1.00-4.50x cuDNN's time "
            "forward and 1.08-2.33x a training step at the same layers"), _H100_KINDS),
    ),
    ("normalize", "gpu"): (Default(_XLA, (
        f"{_H100}: the Triton layer norm's forward takes 0.80-1.32x XLA's fusion and its "
        "backward 1.26-1.70x, at 8192x1024 and 4096x8192, float32 and bfloat16"), _H100_KINDS),),
    ("gather", "gpu"): (Default(("triton", "xla"), (
        f"{_H100}: the Triton gather forward takes 0.99-1.07x XLA's time (at parity) and the "
        "gradient (the wrapper's sort of the ids and the sorted scatter-add) 0.60-0.68x, "
        "table 32000x4096 bfloat16, 8192 ids; the Mosaic GPU kernels 1.03x and 0.76x, behind "
        "Triton's 0.89x and 0.68x in the same run (mosaic_gpu_runs)"), _H100_KINDS),),
    ("matmul", "tpu"): (Default(_XLA, (
        "design: XLA's TPU matmul is the MXU's reference path; the Mosaic kernel tiles the same "
        "way and is not expected to beat it")),),
    ("conv2d", "tpu"): (Default(_XLA, (
        "design: XLA lowers convolutions to the MXU natively; the Mosaic kernel's shifted "
        "windows add VMEM copies XLA does not need")),),
    ("normalize", "tpu"): (Default(("mosaic", "xla"), (
        "design: in bench/design.py's v5e figures layer_norm 8192x1024 and 4096x8192 "
        "bfloat16 move their operands once, forward and backward (with a residual too); the "
        "batch norm reads x twice, as XLA's statistics and normalize fusions do")),),
    ("gather", "tpu"): (Default(_XLA, (
        "design: 16-bit rows move as 32-bit word-rows (each with its neighbour): the forward "
        "reads 2x the rows' bytes, 1.5x the minimum traffic, and the scatter-add 2x the "
        "cotangent; 32-bit rows move the minimum, but are untimed on a TPU")),),
}


def default(op: str, backend: str, dtype: Any = None,
            device_kind: str | None = None) -> tuple[str, ...]:
    """The implementations `implementation=None` tries for `op` in a program lowered for
    `backend` (a lowering platform: "cpu", "cuda", "rocm", "tpu"), on operands of `dtype`, built
    for a device of `device_kind` (None where the program names none: no per-device entry
    reaches it)."""
    platform = PLATFORMS.get(backend)
    entries = TABLE.get((_FAMILY.get(op, op), platform), ()) if platform else ()
    entry = next((e for e in entries if e.reaches(dtype, device_kind)), None)
    return entry.implementations if entry else (registry.REFERENCE,)
