"""The hardware targets the kernels are built for, their resource budgets, and which one a call
will run on.

Block sizes are chosen from the target a call runs on (`current`): the program's device (the
abstract device in scope while lowering or compiling for a target this machine does not have,
`jax.sharding.use_abstract_mesh`; the device an op recorded or its operands' mesh names; the
default device in scope), else the device present, or, off any accelerator, the default target
of the platform, so a kernel in the "strict" interpreter runs exactly the schedule it would run
there.
A kernel in the fast interpreter (`interpret=None`/`True` on a CPU) is sized for `INTERPRETER`
instead: Pallas' HLO interpreter runs the programs one after another, each as XLA ops on whole
tiles, so there fewer, larger programs cost less (see `interpreted`).
The figures are the vendors' and were checked against the real compilers (`kernels.compile`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax

MIB = 2**20
# What one SM holds at once, alike on compute capabilities 8.0, 9.0 and 10.0 (CUDA's occupancy
# tables): 65,536 32-bit registers, allocated a warp at a time in units of 256; 2,048 threads;
# 32 CTAs; and 1 KB of shared memory reserved per CTA, beside the per-block opt-in limit
# (`Target.shared_memory`), the SM's total being that limit and one reservation (H100:
# 233,472 bytes, 228 KB).
SM_REGISTERS = 65_536
REGISTER_UNIT = 256
SM_THREADS = 2_048
SM_CTAS = 32
CTA_SHARED_RESERVE = 1_024
# The share of a GPU's memory bandwidth a kernel streaming its bytes is expected to reach (the
# design model of `Target.streaming_seconds`): the fastest row of the H100's device record
# (bench/records/nvidia_h100_80gb_hbm3.json), Triton's layer norm of 8192x1024 float32, moved
# 2,529 GB/s, 0.754 of the H100's 3.35 TB/s.
STREAMING_SHARE = 0.75
# The share of a GPU's memory bandwidth a pure copy reaches (rows moved GMEM -> shared memory ->
# GMEM by TMA, no arithmetic) where its bytes in flight cover the memory's latency: public
# device-to-device copy measurements of an H100 SXM reach 3.0-3.1 TB/s, 0.90-0.93 of its
# 3.35 TB/s. Not measured by this project: no copy kernel of its own has run on a device yet.
COPY_SHARE = 0.90
# HBM's latency under load, which the bytes a kernel keeps in flight must cover (Little's law):
# about 1 us on an H100 (public microbenchmarks: 0.5-0.7 us unloaded). An estimate.
MEMORY_LATENCY = 1e-6
# What each of XLA's small launches (a fusion over a few thousand ids) costs in a program on an
# H100: the H100 record's chained-timer floor, a jitted call of one small kernel, 1.5-2.8 us
# (bench/records/nvidia_h100_80gb_hbm3.json); the larger figure.
SMALL_LAUNCH_SECONDS = 2.8e-6


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target.

    GPU: `shared_memory` is the per-block opt-in limit of shared memory in bytes (Triton only
    fails at kernel load when a kernel needs more, so the library checks it itself).
    TPU: `vmem` is the physical VMEM of a core; `scoped_vmem` what a kernel may use unless it
    passes `vmem_limit_bytes` (the compiler's default scoped limit).
    """

    name: str
    platform: str  # "gpu" or "tpu"
    device_kind: str
    compute_capability: int | None = None
    shared_memory: int | None = None
    vmem: int | None = None
    scoped_vmem: int | None = None
    topology: tuple[tuple[str, str], ...] = ()  # keyword arguments of get_topology_desc
    num_cores: int | None = None
    num_sms: int | None = None  # GPU streaming multiprocessors: programs run one wave at a time
    # GPU only, for XLA's compile-only devices (`gpu_target_config`): the vendor's figures.
    fpus_per_sm: int | None = None
    memory_bandwidth: int | None = None  # bytes/s
    l2_cache: int | None = None
    clock_ghz: float | None = None
    device_memory: int | None = None
    interpreter: bool = False  # Pallas' HLO interpreter on a CPU, not a device

    @property
    def lowering_platform(self) -> str:
        """The platform a program for this target is lowered for."""
        return "cuda" if self.platform == "gpu" else "tpu"

    def ctas_per_sm(self, threads: int, registers: int, shared_bytes: int) -> int:
        """CTAs of `threads` threads, `registers` registers a thread and `shared_bytes` of
        shared memory that one SM holds at once (a GPU's occupancy, by `SM_REGISTERS`,
        `SM_THREADS`, `SM_CTAS` and the shared memory): 0 where one does not fit."""
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = SM_REGISTERS // (warps * per_warp) if per_warp else SM_CTAS
        by_shared = ((self.shared_memory + CTA_SHARED_RESERVE)
                     // (shared_bytes + CTA_SHARED_RESERVE))
        return min(by_registers, by_shared, SM_THREADS // threads, SM_CTAS)

    def streaming_seconds(self, nbytes: int) -> float:
        """The expected time of a kernel that moves `nbytes` to and from GPU memory and keeps
        enough bytes in flight to stream them: at `STREAMING_SHARE` of the bandwidth."""
        return nbytes / (STREAMING_SHARE * self.memory_bandwidth)

    def copy_seconds(self, programs: int, ctas_per_sm: int, program_bytes: int,
                     program_in_flight: int) -> float:
        """The design model of a copy kernel's time (`COPY_SHARE`, `MEMORY_LATENCY`): `programs`
        CTAs of equal work, `ctas_per_sm` resident on an SM at once, each moving
        `program_bytes` with `program_in_flight` bytes in flight. The busiest SM's CTAs move
        their bytes at its share of `COPY_SHARE` of the bandwidth, or slower where its bytes
        in flight cannot cover the latency, after one latency to fill the pipeline."""
        slots = self.num_sms * ctas_per_sm
        waves = -(-programs // slots)
        last = programs - (waves - 1) * slots
        busiest = (waves - 1) * ctas_per_sm + min(ctas_per_sm, -(-last // self.num_sms))
        in_flight = min(ctas_per_sm, -(-programs // self.num_sms)) * program_in_flight
        rate = min(COPY_SHARE * self.memory_bandwidth / self.num_sms,
                   in_flight / MEMORY_LATENCY)
        return MEMORY_LATENCY + busiest * program_bytes / rate

    @property
    def min_programs(self) -> int:
        """Programs a GPU kernel should launch to keep its SMs busy: two waves or more keep
        at least two thirds of them working on average, however ragged the last wave."""
        return 2 * self.num_sms

    @property
    def vmem_budget(self) -> int:
        """The most VMEM one kernel step may plan for: physical VMEM less an eighth left to
        the compiler's own temporaries (values a kernel computes live in VMEM too). A step
        over it is declined; one over `scoped_vmem` raises the limit (`_pallas.vmem_limit`)."""
        return self.vmem - self.vmem // 8

    @property
    def default_blocks_vmem(self) -> int:
        """What a Mosaic kernel's default blocks plan a step: half the compiler's default
        scoped limit, so defaults compile without raising it (the other half is left to the
        compiler's temporaries). A caller's config may plan up to `vmem_budget`."""
        return self.scoped_vmem // 2


TARGETS = {
    "sm_90": Target("sm_90", "gpu", "NVIDIA H100 80GB HBM3", compute_capability=90,
                    shared_memory=232_448, num_sms=132, fpus_per_sm=128,
                    memory_bandwidth=3_352_320_000_000, l2_cache=50 * MIB, clock_ghz=1.98,
                    device_memory=80 * 1024 * MIB),
    "sm_80": Target("sm_80", "gpu", "NVIDIA A100-SXM4-80GB", compute_capability=80,
                    shared_memory=166_912, num_sms=108, fpus_per_sm=64,
                    memory_bandwidth=2_039_040_000_000, l2_cache=40 * MIB, clock_ghz=1.41,
                    device_memory=80 * 1024 * MIB),
    # B200: Mosaic GPU's sm_100a (Triton's kernels are built for Ampere and Hopper). The
    # vendor's figures; L2 and clock as NVIDIA's B200 materials state them (approximate).
    "sm_100": Target("sm_100", "gpu", "NVIDIA B200", compute_capability=100,
                     shared_memory=232_448, num_sms=148, fpus_per_sm=128,
                     memory_bandwidth=8_000_000_000_000, l2_cache=126 * MIB, clock_ghz=1.965,
                     device_memory=180 * 1024 * MIB),
    "v5e": Target("v5e", "tpu", "TPU v5 lite", vmem=128 * MIB, scoped_vmem=16 * MIB,
                  topology=(("topology_name", "v5e:1x1"),), num_cores=1),
    "v6e": Target("v6e", "tpu", "TPU v6 lite", vmem=128 * MIB, scoped_vmem=32 * MIB,
                  topology=(("topology_name", "v6e:1x1"),), num_cores=1),
    "v4": Target("v4", "tpu", "TPU v4", vmem=16 * MIB, scoped_vmem=16 * MIB,
                 topology=(("topology_name", "v4:1x1x1"), ("chip_config_name", "megacore")),
                 num_cores=2),
}
DEFAULT = {"gpu": TARGETS["sm_90"], "tpu": TARGETS["v5e"]}
# What the fast interpreter sizes blocks for: one "SM" (so no kernel splits work to fill a GPU)
# and VMEM as large as the CPU's memory allows a tile (so Mosaic steps cover whole arrays).
INTERPRETER = {
    "gpu": Target("interpreter", "gpu", "HLO interpreter", num_sms=1, shared_memory=2**40,
                  interpreter=True),
    "tpu": Target("interpreter", "tpu", "HLO interpreter", vmem=1024 * MIB,
                  scoped_vmem=1024 * MIB, num_cores=1, interpreter=True),
}
_PLATFORMS = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}


def _by_device_kind(platform: str, device: Any) -> Target:
    """The target whose kind `device` is; else the platform's default, but with the device's
    own TensorCores where it says how many it has (a v5p's 2: kernels that cut their blocks
    into one range per core, `_blocks.core_ranges`, would otherwise leave one idle), and a
    GPU's own compute capability (which implementations run on it: `kernels.registry`)."""
    for target in TARGETS.values():
        if (target.platform == platform
                and device.device_kind.startswith(target.device_kind[:11])):
            return target
    default = DEFAULT[platform]
    cores = getattr(device, "num_cores", None)
    if platform == "tpu" and isinstance(cores, int) and cores > 0 and cores != default.num_cores:
        return dataclasses.replace(default, num_cores=cores)
    capability = _compute_capability(device) if platform == "gpu" else None
    if capability and capability != default.compute_capability:
        return dataclasses.replace(default, compute_capability=capability)
    return default


def _compute_capability(device: Any) -> int | None:
    """A GPU device's compute capability as major * 10 + minor ("9.0" -> 90), if it says."""
    try:
        major, minor = str(getattr(device, "compute_capability", "")).split(".")[:2]
        return int(major) * 10 + int(minor)
    except ValueError:
        return None


# The abstract device of the mesh an op's operands live on, while the op traces (`for_operands`).
_OPERAND_DEVICE: contextvars.ContextVar[Any] = contextvars.ContextVar("operand_device",
                                                                     default=None)
# Whether the call being traced runs in the fast interpreter (`interpreted`).
_INTERPRETED: contextvars.ContextVar[bool] = contextvars.ContextVar("interpreted", default=False)


def mesh_of(x: Any) -> Any:
    """The mesh `x`'s type says it lives on (jit records it in every value it traces), if any."""
    return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def _operand_device(operands: Sequence[Any]) -> Any:
    for x in operands:
        device = getattr(mesh_of(x), "abstract_device", None)
        if device is not None:
            return device
    return None


def _program_devices(operand_device: Any) -> Iterator[Any]:
    """The devices that say what a program is built for, most telling first: the abstract
    device in scope (lowering for a target this machine lacks), the operands' mesh device, the
    default device in scope (`jax.default_device`, as a compile-only GPU's program is built)."""
    default = jax.config.jax_default_device
    default = None if isinstance(default, str) else default  # a platform name says no kind
    yield from (d for d in (jax.sharding.get_abstract_mesh().abstract_device, operand_device,
                            default) if d is not None)


def program_platform(operands: Sequence[Any]) -> str:
    """The platform a program is being built for, as far as tracing can tell (`_program_devices`
    of `operands`), else this process's default backend (a hint: the dispatch decides per
    lowering platform where it can)."""
    device = next(_program_devices(_operand_device(operands)), None)
    return jax.default_backend() if device is None else device.platform


@contextlib.contextmanager
def for_operands(operands: Sequence[Any]) -> Iterator[None]:
    """Within this scope `current` also sees the device kind of the mesh `operands` are
    sharded over (a program compiled for a TPU v4 slice from a CPU host sizes its blocks for
    v4): set by the dispatch from the op's own arguments, for the call it makes, and by
    `kernels.partition` for each kernel it traces (a backward's too). Operands whose type names
    no device (a shard's, say) keep the device of the enclosing scope."""
    with for_device(_operand_device(operands)):
        yield


def program_device() -> Any:
    """The device a call made now is traced for (`_program_devices`' first), or None. An op
    records it in its static options, so that its backward, traced later, is built for the same
    device (`for_device`): jax 0.12 traces a custom_vjp's backward under a nested jit's
    transpose with an abstract mesh that names no device, and a program compiled on a CPU host
    for B200s would otherwise build its backward for the default target (Hopper's kernels)."""
    return next(_program_devices(_OPERAND_DEVICE.get()), None)


def mesh_device(mesh: Any) -> Any:
    """The abstract device of `mesh` (concrete or abstract), if it names one."""
    return getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)


@contextlib.contextmanager
def for_device(device: Any) -> Iterator[None]:
    """Within this scope `current` also sees `device` (an abstract device, or None: the
    enclosing scope's stays), below the abstract mesh in scope: set by `kernels.partition` from
    an op's recorded `program_device`, and from the mesh XLA's partitioner calls back with
    (Auto axes, whose shards' types name no device)."""
    token = _OPERAND_DEVICE.set(device or _OPERAND_DEVICE.get())
    try:
        yield
    finally:
        _OPERAND_DEVICE.reset(token)


def interpreter_sized(interpret: bool | str, config: Any) -> bool:
    """Whether a kernel call resolved to `interpret` runs on blocks sized for `INTERPRETER`:
    in the fast interpreter, unless the caller gave a `config` (a device's blocks, run as
    given and checked against the device)."""
    return interpret is True and config is None


@contextlib.contextmanager
def interpreted(fast: bool) -> Iterator[None]:
    """Within this scope (`fast`: `interpreter_sized`) `current` is the `INTERPRETER`: set
    by the dispatch while it checks a kernel and by `kernels.partition` while it traces one,
    like `for_operands`."""
    token = _INTERPRETED.set(fast)
    try:
        yield
    finally:
        _INTERPRETED.reset(token)


def device_or_interpreter(platform: str, device: Any, interpreter: Any) -> Any:
    """A schedule choice of a kernel for `platform`: `interpreter` where a call made now runs in
    the fast interpreter (`current` is the `INTERPRETER`), else `device` (on a device and in
    the "strict" interpreter, which run the device's schedule)."""
    return interpreter if current(platform).interpreter else device


def current(platform: str) -> Target:
    """The target of `platform` ("gpu" or "tpu") that a call made now would run on: the fast
    interpreter (`interpreted`), else the program's device (`_program_devices`), else a device
    of this process, else the platform's default target."""
    if _INTERPRETED.get():
        return INTERPRETER[platform]
    device = _device(platform)
    return DEFAULT[platform] if device is None else _by_device_kind(platform, device)


def _device(platform: str) -> Any:
    """The device of `platform` a call made now is built for: the program's
    (`_program_devices`), else one of this process's, else None."""
    for device in (*_program_devices(_OPERAND_DEVICE.get()), *jax.devices()):
        if device.platform in _PLATFORMS[platform]:
            return device
    return None


def device_kind(platform: str) -> str | None:
    """The device kind (`jax.Device.device_kind`) of `platform` ("gpu" or "tpu") a call made now
    is built for, where the program or this process names one (`_device`), else None: what the
    defaults table's per-device entries are matched against (`kernels.defaults`)."""
    device = _device(platform)
    return None if device is None else device.device_kind


def abstract_device(target: Target) -> jax.sharding.AbstractDevice:
    return jax.sharding.AbstractDevice(device_kind=target.device_kind,
                                       num_cores=target.num_cores, platform=target.platform)


def gpu_target_config(target: Target) -> str:
    """`target` as XLA's `GpuTargetConfigProto` text: what its compile-only GPU topologies
    (`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`) need to
    compile for a GPU this machine does not have. Only fields both supported jax versions know."""
    major, minor = divmod(target.compute_capability, 10)
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 49152, "shared_memory_per_core": target.shared_memory + 1024,
        "threads_per_core_limit": 2048, "core_count": target.num_sms,
        "fpus_per_core": target.fpus_per_sm, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": target.memory_bandwidth, "l2_cache_size": target.l2_cache,
        "clock_rate_ghz": target.clock_ghz, "device_memory_size": target.device_memory,
        "shared_memory_per_block_optin": target.shared_memory,
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
    }
    fields = "\n".join(f"  {key}: {value}" for key, value in info.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} "
            f"minor: {minor} }}\n}}\nplatform_name: \"CUDA\"\n"
            f"device_description_str: \"{target.device_kind}\"\n")
