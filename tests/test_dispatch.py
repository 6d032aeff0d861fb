"""How an implementation is chosen (DESIGN.md, "Choosing an implementation")."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _dispatch, defaults
from kernels.matmul import matmul
from tests.support import x64


def test_default_on_this_cpu_is_xla(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert jax.default_backend() == "cpu"
    assert _dispatch.implementations(None) == ("xla",)


def test_kernels_are_interpreted_off_their_platform():
    assert _dispatch.resolve_interpret("triton", None, "cpu") is True
    assert _dispatch.resolve_interpret("mosaic", None, "cuda") is True
    assert _dispatch.resolve_interpret("triton", None, "cuda") is False
    assert _dispatch.resolve_interpret("mosaic", None, "tpu") is False
    assert _dispatch.resolve_interpret("triton", False, "cpu") is False
    assert _dispatch.resolve_interpret("xla", None, "cpu") is False



def _loop_computations(hlo: str) -> dict[str, str]:
    """The computations of compiled HLO text that run inside a while loop (its bodies and
    everything they call), by name."""
    import re

    bodies = {}
    for block in re.split(r"\n(?=\S)", hlo):
        match = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if match:
            bodies[match.group(1)] = block
    called = {name: set(re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", text))
              for name, text in bodies.items()}
    inside = {name for text in bodies.values()
              for name in re.findall(r"body=%?([\w.\-]+)", text)}
    frontier = set(inside)
    while frontier:
        frontier = {c for name in frontier for c in called.get(name, ())} - inside
        inside |= frontier
    return {name: bodies[name] for name in inside if name in bodies}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpreted_triton_kernel_updates_16_bit_outputs_in_place(dtype):
    """Interpreted, each Triton program updates its tile of the output in place: no loop body
    converts the whole output (jax 0.10's CPU backend did so for 16-bit floats at every
    program, making a 4096x1024 bfloat16 layer norm 40x slower than on jax 0.12)."""
    from kernels import layer_norm

    x = jnp.ones((512, 256), dtype)
    hlo = jax.jit(lambda x: layer_norm(x, implementation="triton")).lower(x).compile().as_text()
    loops = _loop_computations(hlo)
    assert loops, "the interpreted kernel runs as a loop over its programs"
    whole_output = "[1,512,256]"
    for name, text in loops.items():
        converts = [line for line in text.splitlines()
                    if " convert(" in line and whole_output in line.split("=")[1].split(" ")[1]]
        assert not converts, (name, converts[:2])

def test_environment_variable_replaces_the_default(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "mosaic, xla")
    assert _dispatch.implementations(None) == ("mosaic", "xla")
    # The environment's single choice is explicit: a declining kernel says why.
    monkeypatch.setenv(_dispatch.ENV_VAR, "mosaic")
    with x64(), pytest.raises(NotImplementedError, match="mosaic: float64 is not supported"):
        matmul(jnp.ones((2, 2), jnp.float64), jnp.ones((2, 2), jnp.float64))
    # An explicit argument still wins over the environment.
    out = matmul(jnp.ones((2, 3)), jnp.ones((3, 2)), implementation="xla")
    np.testing.assert_array_equal(out, np.full((2, 2), 3.0))


def test_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton,gpu")
    with pytest.raises(ValueError, match=_dispatch.ENV_VAR):
        matmul(jnp.ones((2, 2)), jnp.ones((2, 2)))


def test_sequence_tries_in_order_and_reports_every_reason():
    calls = []

    def declines(reason):
        def check():
            calls.append(reason)
            raise NotImplementedError(reason)
        return check

    checks = {"triton": declines("no triton"), "mosaic": declines("no mosaic")}
    assert _dispatch.choose("op", ("triton", "mosaic", "xla"), None, checks) == ("xla", False)
    assert calls == ["no triton", "no mosaic"]
    with pytest.raises(NotImplementedError, match="op: triton: no triton; mosaic: no mosaic"):
        _dispatch.choose("op", ("triton", "mosaic"), None, checks)


@pytest.mark.parametrize("backend,expected", [
    ("cuda", {"matmul": ("xla",), "conv2d": ("xla",), "normalize": ("triton", "xla"),
              "layer_norm": ("triton", "xla"), "rms_norm": ("triton", "xla"),
              "gather": ("triton", "xla")}),
    ("tpu", {"matmul": ("xla",), "conv2d": ("xla",), "normalize": ("mosaic", "xla"),
             "layer_norm": ("mosaic", "xla"), "rms_norm": ("mosaic", "xla"),
             "gather": ("mosaic", "xla")}),
    ("cpu", dict.fromkeys(("matmul", "conv2d", "normalize", "gather"), ("xla",))),
])
def test_defaults_come_from_the_table(monkeypatch, backend, expected):
    """Without a bench record showing the kernel ahead, GPUs keep cuBLAS/cuDNN for matmul and
    conv2d; memory-bound ops default to the kernel, then xla."""
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    for op, names in expected.items():
        assert _dispatch.implementations(None, op, backend) == names, op
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")  # the environment still forces a kernel
    assert _dispatch.implementations(None, "matmul", backend) == ("triton",)


def test_every_default_cites_its_evidence():
    records = Path(__file__).parent.parent / "bench" / "records"
    for (op, platform), entry in defaults.TABLE.items():
        assert entry.implementations[-1] == "xla", (op, platform)  # a default never fails
        if entry.evidence.startswith("bench/records/"):
            assert (records.parent.parent / entry.evidence).is_file(), entry.evidence
        else:
            assert entry.evidence.startswith("design: ") and len(entry.evidence) > 40, entry


def test_default_call_on_a_gpu_backend_runs_xla_for_matmul(monkeypatch):
    """The public op asks the table with its own name (a kernel declining is not needed)."""
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    checks = {"triton": lambda: None}
    assert _dispatch.choose("matmul", None, None, checks, "cuda") == ("xla", False)
    assert _dispatch.choose("layer_norm", None, None, checks, "cuda") == ("triton", False)
    assert _dispatch.choose("layer_norm", None, None, checks, "cpu") == ("xla", False)


@pytest.mark.parametrize("platform,marker", [("cuda", "__gpu$xla.gpu.triton"),
                                             ("tpu", "tpu_custom_call")])
def test_defaults_are_decided_for_the_lowering_platform(monkeypatch, platform, marker):
    """A program traced on this CPU and lowered for a GPU or TPU gets that platform's compiled
    kernel (implementation=None, interpret=None): not XLA, not an interpreted kernel. Lowered
    for the CPU, the same traced program runs XLA."""
    from kernels import _pallas, _targets, layer_norm

    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    x = jnp.ones((64, 256), jnp.bfloat16)
    target = _targets.DEFAULT["gpu" if platform == "cuda" else "tpu"]
    text = _pallas.lower(lambda x: jax.grad(lambda x: layer_norm(x).astype(jnp.float32).sum())(x),
                         x, target=target).as_text()
    assert text.count(marker) == 2, text.count(marker)  # forward and backward kernels
    assert "stablehlo.while" not in text  # no interpreted kernel
    on_cpu = jax.jit(layer_norm).lower(x).as_text()
    assert "__gpu$xla.gpu.triton" not in on_cpu and "tpu_custom_call" not in on_cpu
    assert "stablehlo.while" not in on_cpu


def test_explicit_kernel_is_compiled_for_its_platform_and_interpreted_elsewhere():
    """interpret=None: the Triton kernel is a kernel call when lowered for cuda and the
    interpreter's loop when lowered for this CPU, from one traced function."""
    from kernels import _pallas, _targets, layer_norm

    x = jnp.ones((64, 256), jnp.float32)
    fn = lambda x: layer_norm(x, implementation="triton")  # noqa: E731
    cuda = _pallas.lower(fn, x, target=_targets.DEFAULT["gpu"]).as_text()
    assert "__gpu$xla.gpu.triton" in cuda and "stablehlo.while" not in cuda
    cpu = jax.jit(fn).lower(x).as_text()
    assert "__gpu$xla.gpu.triton" not in cpu and "stablehlo.while" in cpu
