"""What every op's Mosaic GPU kernels (`implementation="mosaic_gpu"`, jax >= 0.12) must do
beyond their numerics, which each op's shared test base checks in Mosaic GPU's interpreter: the
real compilers, run without a GPU (each kernel alone for sm_90a and sm_100a: Mosaic GPU's
layout inference, ptxas's registers and spills, the dynamic shared memory; whole programs on 1
and 4 H100s, Auto and Explicit axes, and a training step on 4 B200s; a cuda export), and the
interpreter's decline on a mesh of several CPU devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._targets import TARGETS
from kernels.compile import CASES
from tests.support import kernels_of, needs, subprocess_env

HERE = Path(__file__).parent
pytestmark = needs("mosaic_gpu")
# The ops with Mosaic GPU kernels.
OPS = [op for op in CASES if "mosaic_gpu" in kernels_of(op)]
# Compiled for sm_90a and sm_100a besides the design cases: an odd small case per op.
SM_100_CASES = {"normalize": "layer_norm 7x129", "gather": "table 129x257",
                "matmul": "8x1000x1000", "conv2d": "8x56x56x96 * 7x7x1x96"}
# What an op's kernels decline by design, per target: gather, rows whose padding copy would move
# too much (`_MAX_PADDING`, as 257 float32 columns of a 1000-row table for 64 ids).
DECLINES = {"gather": (1, "not a multiple of 16 bytes")}
# The ops whose products run on the matmul's persistent, warp-specialized kernel.
MMA_OPS = ("matmul", "conv2d")
# Per op: its programs compiled on 1 and 4 GPUs, and a call exported for cuda (forward and
# gradient).
PROGRAMS = {"normalize": ["layer_norm", "rms_norm"], "gather": ["gather", "gather_vocab"],
            "matmul": ["matmul", "matmul_k"], "conv2d": ["conv2d"]}
EXPORTS = {
    "matmul": ("jax.ShapeDtypeStruct((128, 256), jnp.bfloat16), "
               "jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)",
               "lambda a, b: kernels.matmul(a, b, implementation='mosaic_gpu')"),
    "normalize": ("jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)",
                  "lambda x: kernels.layer_norm(x, implementation='mosaic_gpu')"),
    "gather": ("jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), "
               "jax.ShapeDtypeStruct((16,), jnp.int32)",
               "lambda x, i: kernels.gather(x, i, implementation='mosaic_gpu')"),
    "conv2d": ("jax.ShapeDtypeStruct((4, 16, 16, 64), jnp.bfloat16), "
               "jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)",
               "lambda x, w: kernels.conv2d(x, w, implementation='mosaic_gpu')"),
}


def test_its_interpreter_declines_a_mesh_of_several_devices():
    """Mosaic GPU's interpreter runs through host callbacks, one simulated GPU per process: on
    a mesh of several CPU devices (Auto or Explicit axes, or inside shard_map) it declines with
    the reason, and a sequence falls through to xla; one device runs it."""
    script = (
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import AxisType, NamedSharding, PartitionSpec as P\n"
        "import kernels\n"
        "x = jnp.arange(8 * 256.0).reshape(8, 256)\n"
        "for kind in (AxisType.Auto, AxisType.Explicit):\n"
        "    mesh = jax.make_mesh((4,), ('data',), axis_types=(kind,))\n"
        "    with jax.set_mesh(mesh):\n"
        "        xs = jax.device_put(x, NamedSharding(mesh, P('data')))\n"
        "        try:\n"
        "            jax.jit(lambda x: kernels.layer_norm(x, implementation='mosaic_gpu'))(xs)\n"
        "        except NotImplementedError as e:\n"
        "            print('declined:', e)\n"
        "        y = jax.jit(lambda x: kernels.layer_norm(\n"
        "            x, implementation=('mosaic_gpu', 'xla')))(xs)\n"
        "        print('fell through:', bool(jnp.allclose(y, kernels.layer_norm(x))))\n"
        "y = kernels.layer_norm(x, implementation='mosaic_gpu')\n"
        "print('one device:', bool(jnp.allclose(y, kernels.layer_norm(x), atol=1e-5)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(cpu_only=True), cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum("mosaic_gpu's interpreter cannot run on a mesh of 4 devices" in line
               for line in lines if line.startswith("declined:")) == 2, proc.stdout
    assert lines.count("fell through: True") == 2 and "one device: True" in lines, proc.stdout


def _compiled(script: str) -> list[dict]:
    """Runs `script` in a process of its own (compile-only GPUs are per process, and Mosaic
    GPU compiles for one GPU generation per process: `kernels.compile.mosaic_gpu.OWN_PROCESS`)
    and returns the JSON lines it prints."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=subprocess_env(cpu_only=False), cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# Besides those, matmul, conv2d and normalize compile these for sm_90a in the exhaustive tier
# (their other cases are the same kernels at other sizes): matmul's padded odd product and a batched one
# with its transposed gradients; conv2d's 7x7 depthwise (its weight gradient holds the most
# registers); normalize's streamed long rows (16-bit and float32), its columns
# layouts and a cast output.
SM_90_CASES = {"matmul": ("7x5", "8x1000x1000"),
               "conv2d": ("8x56x56x96 * 7x7x1x96",),
               "normalize": ("layer_norm 4096x16384 bfloat16", "layer_norm 4096x12000 float32",
                             "normalize 10000x100", "normalize 8x64x4096",
                             "rms_norm 8192x1024 float32 axis=-1, out_dtype",
                             "layer_norm + residual 7x129")}


# Ops whose Mosaic GPU kernels are one code for Hopper and Blackwell (no tcgen05) and whose odd
# case compiles (gather's is declined): on sm_100a the README's command compiles that case, the
# exhaustive tier their design cases.
SAME_ON_BLACKWELL = ("normalize",)


def _planned_shared_memory(case, target: str) -> dict | None:
    """The shared memory normalize's Mosaic GPU plans state (`Plan.shared_bytes`) for a layer
    or RMS norm case over the last axis, by kernel name; None for other cases."""
    op, *_ = case.description.split()
    if op not in ("layer_norm", "rms_norm") or not case.description.endswith("axis=-1"):
        return None
    import jax.numpy as jnp

    from kernels import _targets
    from kernels._pallas.lowering import on_target
    from kernels.normalize.common import Problem
    from kernels.normalize.mosaic_gpu.config import plan_of

    x, residual = case.args[0], "+ residual" in case.description
    layer = op == "layer_norm"
    p = Problem(1, x.shape[0], x.shape[1], True, jnp.dtype(x.dtype), layer, 1e-5, True, layer,
                residual)
    with on_target(_targets.TARGETS[target]):
        return {"normalize_forward_mosaic_gpu": plan_of(p, None).shared_bytes,
                "normalize_backward_mosaic_gpu": plan_of(p, None, backward=True,
                                                         has_gsum=residual).shared_bytes}


def _cases(op: str, target: str, every: bool = False) -> list:
    """The README's command compiles, for sm_90a and sm_100a, each op's design cases and an odd
    small one (`SM_100_CASES`; on sm_100a the odd one alone for `SAME_ON_BLACKWELL`); `every`:
    the rest, in the exhaustive tier (sm_90a's: matmul, conv2d and normalize `SM_90_CASES`,
    gather every case; sm_100a's: the design cases of `SAME_ON_BLACKWELL`)."""
    def first(c) -> bool:
        return c.description.startswith(SM_100_CASES[op]) or c.design and not (
            target == "sm_100" and op in SAME_ON_BLACKWELL)

    if not every:
        return [c for c in CASES[op] if first(c)]
    if target == "sm_100":
        return [c for c in CASES[op] if c.design and not first(c)]
    odd = SM_90_CASES.get(op)
    return [c for c in CASES[op] if not first(c)
            and (odd is None or c.description.startswith(odd))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("op,target,every", [
    *((op, target, False) for op in OPS for target in ("sm_90", "sm_100")),
    *(pytest.param(op, target, True, id=f"{op}-{target}-every", marks=pytest.mark.exhaustive)
      for op in OPS for target in ("sm_90", "sm_100") if _cases(op, target, every=True))])
def test_every_kernel_compiles_without_spills(op, target, every):
    """`python -m kernels.compile` for the op's cases (`_cases`): Mosaic GPU's layout inference
    accepts the kernels (the interpreter does not check layouts), ptxas fits them in registers
    with no spills, their PTX moves rows with TMA copies, and their shared memory (Mosaic GPU's
    dynamic allocation) is within a default plan's budget (half an SM's:
    `_pallas.mosaic_gpu.smem_budget`). A case the op declines by design is named and left."""
    cases = _compiled(
        "import json, dataclasses\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import CASES, compile_kernels\n"
        "from tests.test_mosaic_gpu import _cases, _planned_shared_memory\n"
        f"for case in _cases({op!r}, {target!r}, {every!r}):\n"
        "    try:\n"
        "        reports = compile_kernels(case.function('mosaic_gpu'), *case.args, "
        f"target='{target}', implementation='mosaic_gpu')\n"
        "    except NotImplementedError as e:\n"
        "        print(json.dumps({'case': case.description, 'declined': str(e)}))\n"
        "        continue\n"
        "    print(json.dumps({'case': case.description, 'declined': None,\n"
        f"                      'planned': _planned_shared_memory(case, {target!r}),\n"
        "                      'reports': [dataclasses.asdict(r) for r in reports]}))\n")
    assert len(cases) == len(_cases(op, target, every)) >= 1
    declined = [c for c in cases if c["declined"]]
    most, reason = DECLINES.get(op, (0, None))
    assert all(reason in c["declined"] for c in declined), declined
    assert len(declined) <= most
    rows = [r for c in cases if not c["declined"] for r in c["reports"]]
    # A forward and a backward kernel per case (gather's backward: and its pieces' kernel), each
    # distinct kernel compiled once (a small square product's three launches are one kernel).
    assert len(rows) >= (1 if every else 2) * (len(cases) - len(declined))
    assert every or len({r["name"] for r in rows}) >= 2
    from kernels._pallas.mosaic_gpu import PALLAS_SMEM

    for c in cases:  # the plans' figures (CTAs an SM, bytes in flight) rest on these
        for r in c.get("reports", []) if c.get("planned") else []:
            assert 0 <= r["shared_bytes"] - c["planned"][r["name"]] <= PALLAS_SMEM, (c, r)
    for r in rows:
        assert r["name"].endswith("_mosaic_gpu") and r["compiled"], r
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, r
        # Rows move by TMA both ways (its copies in the PTX), not by plain loads and stores.
        assert r["tma"]["load"] > 0 and r["tma"]["store"] > 0, r
        # Over 1 KiB: the dynamic shared memory was read (ptxas alone reports 1 byte); at most
        # half an SM's, with the 2 KiB Pallas takes beside the plan for cross-warp reductions
        # (persistent CTAs take a whole SM each: matmul's, `test_matmul.test_mosaic_gpu_plan`,
        # and normalize's, one CTA per SM walking blocks, a wave at most).
        persistent = op in MMA_OPS and "depthwise" not in r["name"]
        whole_sm = persistent or r["name"].startswith("normalize_")
        half = r["shared_limit"] // 2 + 4096
        assert 1024 < r["shared_bytes"] <= (r["shared_limit"] if whole_sm else half), r
        if persistent or r["shared_bytes"] > half:
            assert r["grid"][0] <= TARGETS[target].num_sms, r
        if persistent and target == "sm_100":  # tcgen05 into tensor memory, no setmaxnreg
            assert r["mma"] and all(i.startswith("tcgen05.mma") for i in r["mma"]), r
            assert not r["max_registers"], r
        elif persistent:  # warp-specialized, on the tensor cores
            from kernels.gemm.mosaic_gpu.config import registers

            assert r["mma"] and all(i.startswith("wgmma.mma_async") for i in r["mma"]), r
            # setmaxnreg per role: the producer's budget (more where it copies NHWC boxes:
            # conv2d's kernels), and the rest of an SM's 512 a thread slot for the consumers.
            assert r["max_registers"] == list(registers(r["name"].startswith("conv2d"))), r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("op", [  # normalize's in the README's command, the rest exhaustive
    op if op == "normalize" else pytest.param(op, marks=pytest.mark.exhaustive) for op in OPS])
def test_whole_programs_and_an_export_carry_the_kernels(op):
    """The op's programs (forward and gradient) compiled for H100s on one device and on
    4-device meshes with Auto and Explicit axes: the forward's and the backward's custom calls
    in each, no operand all-gathered; and a cuda export of the forward and its gradient needs
    no disabled safety check (Mosaic GPU's custom call is on JAX's stable list)."""
    shapes, call = EXPORTS[op]
    reports = _compiled(
        "import dataclasses, json\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import programs\n"
        "for r in programs.compile_ops('sm_90', 4, implementations=('mosaic_gpu',), "
        f"programs={PROGRAMS[op]!r}):\n"
        "    print(json.dumps(dataclasses.asdict(r)))\n"
        "import jax, jax.numpy as jnp, kernels\n"
        "from kernels._pallas import on_target\n"
        "from kernels._targets import TARGETS\n"
        f"args = ({shapes},)\n"
        f"call = {call}\n"
        "loss = lambda x, *rest: jnp.sum(call(x, *rest).astype(jnp.float32))\n"
        "fn = jax.jit(lambda *args: (call(*args), jax.grad(loss)(*args)))\n"
        "with on_target(TARGETS['sm_90']):\n"
        "    text = jax.export.export(fn, platforms=('cuda',))(*args).mlir_module()\n"
        "print(json.dumps({'export_calls': text.count('mosaic_gpu_v2')}))\n")
    programs, (export,) = reports[:-1], reports[-1:]
    assert len(programs) == 3 * len(PROGRAMS[op])
    for r in programs:
        assert r["compiled"] and r["kernel_calls"] >= 2, r
        assert dict(r["collectives"])["all-gather"] == 0, r
    # The forward (normalize's: again in the gradient) and the backward.
    assert export["export_calls"] >= 2


@pytest.mark.exhaustive
@pytest.mark.timeout(600)
def test_a_model_training_step_carries_every_ops_kernels():
    """One training step (loss, gradients, update) of examples/train_digits.py's CNN, its Flax
    layers given `implementation="mosaic_gpu"`: every op's Mosaic GPU kernels are in it, forward
    and backward (the two 3x3 convolutions, whose float32 weight gradients run on the matmul's
    kernel; the row embedding's gather and its scatter-add; layer and RMS norm; the dense
    layers), and it compiles for 1 and 4 H100s (the batch sharded, Auto axes)."""
    reports = _compiled(
        "import dataclasses, json\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import launches, programs\n"
        "from kernels._targets import TARGETS\n"
        "from tests.programs_run import _digits_step\n"
        "for count in (1, 4):\n"
        "    mesh = programs.mesh_for('sm_90', count, 'auto', shape=(1, count))\n"
        "    step, args = _digits_step('mosaic_gpu', mesh)\n"
        "    if count == 1:\n"
        "        calls = launches(step, *args, target=TARGETS['sm_90'])\n"
        "        print(json.dumps({'names': sorted({e.params['name'] for e in calls})}))\n"
        "    print(json.dumps(dataclasses.asdict(programs.compile_program(\n"
        "        'train_digits', step, args, mesh, target='sm_90', mesh_kind='auto',\n"
        "        implementation='mosaic_gpu'))))\n")
    (names,), programs = reports[:1], reports[1:]
    assert {"conv2d_mosaic_gpu", "gather_mosaic_gpu", "scatter_add_mosaic_gpu",
            "normalize_forward_mosaic_gpu", "normalize_backward_mosaic_gpu",
            "matmul_mosaic_gpu"} <= set(names["names"]), names
    assert [r["devices"] for r in programs] == [1, 4]
    for r in programs:
        assert r["compiled"], r["error"]
        assert r["kernel_calls"] >= 15, r  # every kernel above, some several times


@pytest.mark.exhaustive  # a whole program beyond one per mesh kind (tests/test_programs.py)
@pytest.mark.timeout(600)
def test_a_model_training_step_compiles_for_b200s():
    """The same training step compiled on a CPU host for 4 B200s (Auto axes): every kernel is
    Blackwell's, which ptxas proves (Hopper's wgmma does not assemble for sm_100a). Two traces
    that name no device are made for the program's GPU all the same: XLA's partitioner's
    callbacks (the mesh it passes: `_targets.mesh_device`) and the backward of a custom_vjp
    under a nested jit's transpose, where jax 0.12 drops the abstract mesh's device (the device
    the op recorded: `_targets.program_device`). And a layer's program built under
    `jax.default_device(<a compile-only B200>)`, as the bench's design rows build it."""
    report, layer = _compiled(
        "import dataclasses, json\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import CASES, programs\n"
        "from tests.programs_run import _digits_step\n"
        "mesh = programs.mesh_for('sm_100', 4, 'auto', shape=(1, 4))\n"
        "step, args = _digits_step('mosaic_gpu', mesh)\n"
        "print(json.dumps(dataclasses.asdict(programs.compile_program(\n"
        "    'train_digits', step, args, mesh, target='sm_100', mesh_kind='auto',\n"
        "    implementation='mosaic_gpu'))))\n"
        "case = next(c for c in CASES['matmul'] if c.design and 'gelu' in c.description)\n"
        "launches, _ = programs.layer_program(case, 'sm_100', 'mosaic_gpu')\n"
        "print(json.dumps({'launches': launches}))\n")
    assert report["compiled"], report["error"][-2000:]
    assert report["devices"] == 4 and report["kernel_calls"] >= 15, report
    assert layer["launches"] >= 3, layer  # the forward's kernel and the two gradients'


# Launches whose TMA stores are runs of GMEM (a window of one row, or of whole rows), which
# Mosaic GPU stores by a linear copy clamped only at the array's end (`stored_shape`): per
# case, the call, its operands, which launch, and that launch's output shape, which holds
# whole windows. Before `stored_shape` the first three stored past their rows; on an H100 the
# first two lost rows that their interpreter wrote (2026-11-26).
def _linear_store_cases() -> dict:
    import jax
    import jax.numpy as jnp

    import kernels

    bf16 = jnp.bfloat16
    hot_ids = jnp.asarray([1] * 140 + [2])
    return {
        # One id per batch slice, rows of 3 float32: (1, 32) windows (TMA_SMEM_ALIGNMENT).
        "gather one id": (
            lambda x: kernels.gather(x, jnp.asarray([2]), axis=1, implementation="mosaic_gpu"),
            [jnp.ones((3, 5, 3))], 0, (3, 1, 32)),
        # A hot id's pieces, each a partial row of whole pieces (after the forward), stored a
        # span inside its row.
        "scatter-add pieces": (
            jax.grad(lambda t: kernels.gather(t, hot_ids, implementation="mosaic_gpu").sum()),
            [jnp.ones((4, 8))], 1, (1, 2, 1, 256)),
        # Blocks of one row of 300 columns: (1, PIECE) windows.
        "layer norm blocks of a row": (
            lambda x: kernels.layer_norm(x, implementation="mosaic_gpu",
                                         config=kernels.NormalizeConfig(block_groups=1)),
            [jnp.ones((3, 300))], 0, (3, 512)),
        # The matmul's epilogue windows are swizzled, so TMA's tensor copy stores them: its
        # split-K partials of N = 64 (one window wide) need no padding.
        "matmul split-K, N = 64": (
            lambda a, b: kernels.matmul(a, b, implementation="mosaic_gpu"),
            [jnp.ones((16, 8192), bf16), jnp.ones((8192, 64), bf16)], 0, (32, 16, 64)),
    }


def test_a_scatter_add_row_stores_its_pieces_and_its_tail():
    """Each piece's store of a gradient row is one linear copy (`cp.async.bulk`), which nothing
    clips at the row's end: compiled for sm_90a, a row of 4 float32 stores 16 bytes, a row of
    264 bfloat16 (257 padded to 16 bytes) a piece of 512 bytes and its 16-byte tail, each a
    constant (whole pieces past the row, clamped only at the array's end, zeroed the next rows
    on an H200)."""
    rows = _compiled(
        "import json, os, re, tempfile\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "import jax, jax.numpy as jnp, kernels\n"
        "from kernels.compile.launches import launches, bind\n"
        "from kernels.compile.mosaic_gpu import _dumped_to\n"
        "from kernels.compile.programs import devices\n"
        "from kernels._targets import TARGETS\n"
        "device = devices('sm_90', 1)[0]\n"
        "sharding = jax.sharding.SingleDeviceSharding(device)\n"
        "ids = jnp.asarray([3, 3, -1, 2, 0, 5, 1], jnp.int32)\n"
        "for shape, dtype, axis in [((3, 10, 4), jnp.float32, 1), ((129, 257), jnp.bfloat16, 0)]:\n"
        "    fn = jax.grad(lambda t: kernels.gather(t, ids, axis=axis, implementation="
        "'mosaic_gpu').astype(jnp.float32).sum())\n"
        "    eqn = [e for e in launches(fn, jnp.ones(shape, dtype), target=TARGETS['sm_90'])\n"
        "           if e.params['name'] == 'scatter_add_mosaic_gpu'][0]\n"
        "    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)\n"
        "            for v in eqn.invars]\n"
        "    with tempfile.TemporaryDirectory() as folder:\n"
        "        with _dumped_to(folder), jax.default_device(device):\n"
        "            jax.jit(bind(eqn)).trace(*args).lower().compile()\n"
        "        ptx = ''.join(open(os.path.join(folder, f)).read() for f in os.listdir(folder)\n"
        "                      if f.endswith('.ptx'))\n"
        "    sizes = []\n"
        "    for reg in re.findall(r'cp\\.async\\.bulk\\.global\\.shared::cta\\.bulk_group '\n"
        "                          r'\\[[^\\]]+\\], \\[[^\\]]+\\], (%r\\d+);', ptx):\n"
        "        found = re.search(rf'mov\\.b32\\s+{reg}, (\\d+);', ptx)\n"
        "        sizes.append(int(found[1]) if found else None)\n"
        "    print(json.dumps({'shape': shape, 'sizes': sizes}))\n")
    assert [sorted(set(r["sizes"])) for r in rows] == [[16], [16, 512]], rows


@pytest.mark.parametrize("case", ["gather one id", "scatter-add pieces",
                                  "layer norm blocks of a row", "matmul split-K, N = 64"])
def test_a_store_that_is_a_run_of_gmem_stays_in_its_rows(case):
    from kernels.compile import launches

    fn, args, launch, shape = _linear_store_cases()[case]
    calls = launches(fn, *args, target=TARGETS["sm_90"])
    assert calls[launch].outvars[0].aval.shape == shape
