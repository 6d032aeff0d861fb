"""What `implementation=None` runs, per op and platform: one table, each entry with its evidence.

An entry cites a bench record (`python -m bench --record` on a GPU or TPU writes one under
`bench/records/`) when one exists; where nothing has been measured on a device, it gives the
design reason for the choice. Without a record showing a kernel ahead, an op defaults to `xla`
where XLA calls a vendor library (cuBLAS, cuDNN) or a compiler path tuned for years (TPU matmul
and convolution), so `implementation=None` never puts a model on a kernel expected to be slower.
`implementation=` and `$KERNELS_IMPLEMENTATION` still force any kernel. On a CPU (and any
platform not listed) every op runs `xla`.

Status (2026-11): no kernel of this library has run on a GPU or TPU yet, so every entry below
is a design judgement, not a measurement.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Default", "TABLE", "PLATFORMS", "KERNEL_OF_PLATFORM", "default"]


@dataclasses.dataclass(frozen=True)
class Default:
    implementations: tuple[str, ...]
    evidence: str  # "bench/records/<device kind>.json" or "design: <why>"


# jax.default_backend() (or a device's platform) -> the table's platform, and its kernel.
PLATFORMS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
KERNEL_OF_PLATFORM = {"gpu": "triton", "tpu": "mosaic"}

# Public op names -> the op family an entry covers.
_FAMILY = {"layer_norm": "normalize", "rms_norm": "normalize"}

TABLE: dict[tuple[str, str], Default] = {
    ("matmul", "gpu"): Default(("xla",), (
        "design: cuBLAS/cuBLASLt pick a tuned kernel per shape (wgmma, TMA, split-K, stream-K); "
        "the Triton kernel, untimed on a device, is expected at or below cuBLAS")),
    ("conv2d", "gpu"): Default(("xla",), (
        "design: cuDNN's implicit-GEMM and Winograd kernels with tensor-core layouts; the Triton "
        "implicit GEMM has not been timed on a device")),
    ("normalize", "gpu"): Default(("triton", "xla"), (
        "design: memory-bound; the fused kernel reads x once and writes y once per pass, and "
        "its backward fuses dx with the scale/offset partial sums, where XLA emits separate "
        "reduction and elementwise fusions (2-3 reads of x)")),
    ("gather", "gpu"): Default(("triton", "xla"), (
        "design: memory-bound; the forward reads each gathered row once with the out-of-bounds "
        "mode computed in the kernel (XLA adds clamp/select passes for fill and wrap); the "
        "backward sums each table row's cotangents without atomics, deterministic")),
    ("matmul", "tpu"): Default(("xla",), (
        "design: XLA's TPU matmul is the MXU's reference path; the Mosaic kernel tiles the same "
        "way and is not expected to beat it")),
    ("conv2d", "tpu"): Default(("xla",), (
        "design: XLA lowers convolutions to the MXU natively; the Mosaic kernel's shifted "
        "windows add VMEM copies XLA does not need")),
    ("normalize", "tpu"): Default(("mosaic", "xla"), (
        "design: memory-bound; one fused pass over VMEM blocks sized to the target's VMEM, "
        "forward and backward")),
    ("gather", "tpu"): Default(("mosaic", "xla"), (
        "design: rows move HBM->HBM by DMA without a trip through vector registers; XLA's TPU "
        "gather of whole rows goes through a generic gather loop")),
}


def default(op: str, backend: str) -> tuple[str, ...]:
    """The implementations `implementation=None` tries for `op` in a program lowered for
    `backend` (a lowering platform: "cpu", "cuda", "rocm", "tpu")."""
    platform = PLATFORMS.get(backend)
    entry = TABLE.get((_FAMILY.get(op, op), platform)) if platform else None
    return entry.implementations if entry else ("xla",)
