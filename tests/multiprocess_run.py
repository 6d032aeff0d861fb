"""One of two processes of `test_sharding.test_two_processes`: `python multiprocess_run.py
PROCESS_ID PORT IMPLEMENTATION DOT_RTOL` (the tolerance rule's relative allowance for the
implementation's float32 dots: TF32's for a GPU kernel, which rounds its operands as on its
device). Each process has 4 CPU devices; together they form a (2, 4)
mesh over which a data- and tensor-parallel step (embedding lookup on a vocab-sharded table,
row-parallel matmul, layer norm) runs forward and backward; values and gradients are compared
with the same step on unsharded NumPy copies, in every process."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kernels  # noqa: E402


def main(process_id: int, port: int, impl: str, dot_rtol: float) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)  # the same values in both processes
    host = {"table": rng.standard_normal((64, 32), np.float32),
            "w": rng.standard_normal((32, 24), np.float32),
            "ids": rng.integers(-70, 70, (16,)).astype(np.int32)}
    specs = {"table": P("model", None), "w": P("model", None), "ids": P("data")}
    arrays = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]),
                                              lambda index, v=v: v[index])
              for k, v in host.items()}

    def step(table, w, ids, impl):
        x = kernels.gather(table, ids, mode="fill", fill_value=0.0, implementation=impl)
        h = kernels.matmul(x, w, implementation=impl)
        return jnp.sum(kernels.layer_norm(h, implementation=impl) ** 2 * jnp.arange(24.0)[None, :])

    grad = jax.value_and_grad(step, argnums=(0, 1))
    loss, (d_table, d_w) = jax.jit(grad, static_argnums=3)(arrays["table"], arrays["w"],
                                                             arrays["ids"], impl)
    loss_ref, (d_table_ref, d_w_ref) = jax.jit(grad, static_argnums=3, backend="cpu")(
        host["table"], host["w"], host["ids"], "xla")
    d_table, d_w = (multihost_utils.process_allgather(a, tiled=True) for a in (d_table, d_w))
    rtol = max(1e-4, dot_rtol)  # float32's figure, or the dots' rounding where it is more
    ok = np.allclose(loss, loss_ref, rtol=rtol) and all(
        np.allclose(got, want, atol=max(1e-3, rtol * np.max(np.abs(want))))
        for got, want in ((d_table, d_table_ref), (d_w, d_w_ref)))
    print(f"RESULT {'ok' if ok else 'mismatch'} loss={float(loss):.6f} ref={float(loss_ref):.6f}",
          flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
