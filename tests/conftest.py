import contextlib
import os


@contextlib.contextmanager
def _stderr_discarded():
    """The process's own stderr (file descriptor 2, where C++ logs) sent to /dev/null."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# JAX's strictest numpy settings, as JAX's own suite runs: no implicit rank promotion, no
# implicit dtype promotion. Set in the environment before jax starts, so the subprocesses of the
# sharding, program and example tests run under them too. Tests of mixed-dtype promotion set
# "standard" back locally (`tests.support.standard_promotion`).
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
# XLA's CPU thread pools sized for Mosaic GPU's interpreter (its simulated threads wait on one
# another: the measurement is beside the constant), before jax starts its CPU client; the
# subprocess suites inherit it.
# jaxlib 0.10.2 with the test extra's CUDA plugin (compile-only GPUs) logs "Could not find cuda
# drivers" three times to stderr as jax is imported on a machine without a GPU (C++ logging
# before absl starts, which no variable silences; jaxlib 0.12 does not log it): jax is imported
# first here, quietly, so the suite's output has no driver lines.
with _stderr_discarded():
    import jax  # noqa: E402
from kernels.registry import MOSAIC_GPU_INTERPRETER_THREADS  # noqa: E402

os.environ.setdefault("PJRT_NPROC", str(MOSAIC_GPU_INTERPRETER_THREADS))

import pytest  # noqa: E402

from kernels import _pallas  # noqa: E402
from kernels.compile import use_compile_only_devices  # noqa: E402
from tests.support import implementations_of  # noqa: E402

# The suite compiles for GPUs and TPUs it does not have (before any test starts jax).
use_compile_only_devices()


def _cpu_programs_compiled_quickly() -> None:
    """XLA:CPU compiles this process's programs as `jax_disable_most_optimizations` would
    (LLVM's optimization level 0, no expensive passes), in one LLVM module; GPU and TPU
    programs keep their compilers' defaults, so the registers, spills and memory the compile
    tests read are the real compilers'. A worker compiles hundreds of small programs and runs
    each a few times: measured with jax 0.12 on 2 cores, XLA:CPU's compiles took 57 s of a
    worker's 104 in test_normalize_residual.py and test_matmul.py, and 42 s at level 0 (those
    files: 13-20% less time). XLA:CPU keeps fast-math off at every level, so the values are
    IEEE arithmetic either way. jax's own flag is global, hence this wrapper of its private
    `get_compile_options`, which jax 0.10.2 to 0.12 pass the backend; the suite's CPU-only
    subprocesses set the flag itself (`tests.support.subprocess_env`)."""
    from jax._src import compiler

    options_of = compiler.get_compile_options

    def compile_options(*args, backend=None, **kwargs):
        options = options_of(*args, backend=backend, **kwargs)
        if backend is not None and backend.platform == "cpu":
            debug = options.executable_build_options.debug_options
            debug.xla_backend_optimization_level = 0
            debug.xla_llvm_disable_expensive_passes = True
            # One LLVM module, not 32 compiled in parallel: on 2 cores the split cost more
            # than it saved (those files: 97 s against 101-106).
            options.env_option_overrides = [*options.env_option_overrides,
                                            ("xla_cpu_parallel_codegen_split_count", "1")]
        return options

    compiler.get_compile_options = compile_options


_cpu_programs_compiled_quickly()


def _op_of(module) -> str | None:
    """The op a test module is about (tests/test_<op>[_<subject>].py), if any."""
    from kernels.ops import OPS

    name = module.__name__.rpartition(".")[2]
    return next((op for op in sorted(OPS, key=len, reverse=True)
                 if name == f"test_{op}" or name.startswith(f"test_{op}_")), None)


def pytest_generate_tests(metafunc):
    """The `implementation` argument, where a test does not parametrize it itself: each
    implementation of the module's op (`implementations_of`), or of every op."""
    if "implementation" in metafunc.fixturenames and not any(
            "implementation" in mark.args[0] for mark in metafunc.definition.iter_markers(
                "parametrize")):
        metafunc.parametrize("implementation", implementations_of(_op_of(metafunc.module)))


# The shared suites' numerics: values against float64 truth (or JAX where it is right, every
# gather mode and index, every table dtype) and gradients against JAX's, per op, its epilogue
# and its fused residual, and the schedules that are kernels' paths of their own (chunked
# groups, strided input gradients' phases, hot ids); and the bad-input tests, which raise
# before any kernel runs.
CORE_NUMERICS = frozenset({
    "test_matches_float64_ground_truth", "test_gradients_match_reference",
    "test_gradients_bfloat16", "test_nan_and_inf_propagate",
    "test_epilogue_matches_float64_truth", "test_epilogue_gradients_match_reference",
    "test_groups_longer_than_one_block", "test_residual_matches_float64_ground_truth",
    "test_residual_gradients_match_float64_truth", "test_matches_jax_where_jax_is_right",
    "test_every_mode_and_index_value", "test_table_dtypes", "test_gradients_match_jax",
    "test_strided_input_gradient_phases", "test_residual_over_chunks_and_splits",
    "test_hot_ids_over_many_steps_and_row_blocks",
    "test_bad_input", "test_bad_epilogue_arguments", "test_bias_needs_output_features"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """An implementation whose shared suites run a slow interpreter (Mosaic GPU's, no fast
    interpreter: about 1.5 s a call here; Mosaic's TPU simulator, which "strict" runs: about
    12 ms a call and 5 ms a DMA, `kernels.registry`) runs, in the README's command, its
    kernels' numerics in the shared suites (`CORE_NUMERICS`) and its own modules
    (tests/test_<op>_mosaic_gpu.py, ...) whole; its other tests in the shared suites
    (tests/test_<op>*.py and the contract: jit, vmap, retracing, options, lowering, the
    dispatch code every implementation shares, proven there on the fast interpreters) are in
    the exhaustive tier."""
    from kernels import registry

    for item in items:
        implementation = getattr(item, "callspec", None) and item.callspec.params.get(
            "implementation")
        module = item.module.__name__
        shared = _op_of(item.module) or module.endswith(".test_contract")
        entry = (registry.get(implementation) if isinstance(implementation, str)
                 and implementation in registry.names() else None)
        slow = entry is not None and (not entry.fast_interpreter or entry.strict_simulator)
        if (shared and slow and implementation not in module
                and item.originalname not in CORE_NUMERICS):
            item.add_marker(pytest.mark.exhaustive)


@pytest.fixture(params=["jit", "no_jit"])
def variant(request):
    """chex-style variants: the op called under `jax.jit` and called eagerly."""
    return jax.jit if request.param == "jit" else (lambda f: f)


@pytest.fixture
def strict_interpret(monkeypatch):
    """Kernels interpreted by default run in "strict" mode, as a kernel author runs a suite:
    Mosaic kernels in TPU interpret mode (out-of-bounds reads raise, uninitialized memory is
    NaN), Triton kernels on their device schedule. The per-op suites use it on small grids;
    tests at model sizes pass `interpret=True`, and model-level suites keep the default."""
    from kernels import _dispatch

    monkeypatch.setenv(_dispatch.INTERPRET_ENV_VAR, _dispatch.STRICT)


try:  # jax >= 0.12: Mosaic GPU's interpreter (private; jax documents the reset there)
    from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import (
        reset_gpu_interpret_mode_state)
except ImportError:
    reset_gpu_interpret_mode_state = None


@pytest.fixture(autouse=True)
def _fresh_tpu_interpret_state():
    yield
    # A kernel that raised inside TPU interpret mode leaves its simulated memory behind.
    _pallas.reset_tpu_interpret_state()
    # So does one that raised in Mosaic GPU's: its module-global shared memory, which the next
    # interpreted kernel would reuse ("the shared state must be reset before any further
    # kernels are interpreted", jax 0.12.0.1). Suspected in a hang of a conv2d gradient test
    # twice in full suites (2026-11-29), never when run alone.
    if reset_gpu_interpret_mode_state is not None:
        reset_gpu_interpret_mode_state()
