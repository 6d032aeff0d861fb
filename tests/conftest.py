import pytest

from kernels import _pallas
from tests.support import IMPLEMENTATIONS


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
    return request.param


@pytest.fixture(params=["jit", "no_jit"])
def variant(request):
    """chex-style variants: the op called under `jax.jit` and called eagerly."""
    import jax

    return jax.jit if request.param == "jit" else (lambda f: f)


@pytest.fixture(autouse=True)
def _fresh_tpu_interpret_state():
    yield
    # A kernel that raised inside TPU interpret mode leaves its simulated memory behind.
    _pallas.reset_tpu_interpret_state()
