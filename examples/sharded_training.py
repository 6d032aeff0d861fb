"""Train a small model data- and tensor-parallel on a mesh of fake CPU devices, every layer a
kernel from this library, and check its losses against the same model trained unsharded.

    python examples/sharded_training.py [--implementation xla|triton|mosaic] [--steps 5]
                                        [--devices 8]

The model classifies random token sequences: an embedding lookup (`kernels.gather`, the table
vocab-parallel: sharded over "model" along its rows), a 1-D convolution over the sequence
(`kernels.conv2d` on (batch, 1, length, features) images, output channels sharded over
"model"), a row-parallel dense layer (`kernels.matmul`, its input features sharded over
"model", the partial products summed), a layer norm (`kernels.layer_norm`) and a dense
read-out. The batch is sharded over "data". Each step's loss is printed beside the unsharded
run's; the script exits non-zero if they differ. On a CPU the kernels run in Pallas' fast
interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the fake device count must be set before jax starts
    _devices = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if _devices is None and "--devices" in sys.argv:
        _devices = sys.argv[sys.argv.index("--devices") + 1]
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={_devices or 8}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402

VOCAB, LENGTH, FEATURES, HIDDEN, CLASSES, BATCH = 128, 16, 32, 64, 4, 32

# How each parameter is sharded on the ("data", "model") mesh.
SPECS = {"embedding": P("model", None), "conv": P(None, None, None, "model"),
         "dense": P("model", None), "scale": P(), "offset": P(), "readout": P()}


def init(key: jax.Array) -> dict[str, jax.Array]:
    k = jax.random.split(key, 4)
    return {"embedding": jax.random.normal(k[0], (VOCAB, FEATURES)) * 0.5,
            "conv": jax.random.normal(k[1], (1, 3, FEATURES, FEATURES)) / np.sqrt(3 * FEATURES),
            "dense": jax.random.normal(k[2], (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
            "scale": jnp.ones((HIDDEN,)), "offset": jnp.zeros((HIDDEN,)),
            "readout": jax.random.normal(k[3], (HIDDEN, CLASSES)) / np.sqrt(HIDDEN)}


def loss_fn(params, tokens, labels, implementation):
    ops = dict(implementation=implementation)
    x = kernels.gather(params["embedding"], tokens, **ops)            # (B, L, F)
    x = kernels.conv2d(x[:, None], params["conv"], **ops)[:, 0]        # (B, L, F)
    x = jax.nn.relu(x).mean(axis=1)                                     # (B, F)
    h = kernels.matmul(x, params["dense"], **ops)                       # (B, H)
    h = kernels.layer_norm(h, params["scale"], params["offset"], **ops)
    logits = kernels.matmul(jax.nn.relu(h), params["readout"], **ops)  # (B, C)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def train(params, tokens, labels, implementation, steps, learning_rate=0.05):
    @jax.jit
    def step(params):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, implementation)
        return loss, jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)

    losses = []
    for _ in range(steps):
        loss, params = step(params)
        losses.append(float(loss))
    return losses, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", default="triton", choices=["xla", "triton", "mosaic"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    data = jax.device_count() // 4
    mesh = jax.make_mesh((data, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    key_tokens, key_labels, key_params = jax.random.split(jax.random.key(0), 3)
    tokens = jax.random.randint(key_tokens, (BATCH, LENGTH), 0, VOCAB)
    labels = jax.random.randint(key_labels, (BATCH,), 0, CLASSES)
    params = init(key_params)

    reference, _ = train(params, tokens, labels, args.implementation, args.steps)
    sharded_params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
                      for k, v in params.items()}
    batch = NamedSharding(mesh, P("data"))
    losses, trained = train(sharded_params, jax.device_put(tokens, batch),
                            jax.device_put(labels, batch), args.implementation, args.steps)
    print(f"mesh {dict(mesh.shape)}, implementation {args.implementation}")
    for i, (a, b) in enumerate(zip(losses, reference)):
        print(f"step {i}: sharded loss {a:.6f}   unsharded loss {b:.6f}")
    print("trained embedding sharding:", trained["embedding"].sharding.spec)
    same = np.allclose(losses, reference, rtol=1e-4, atol=1e-5)
    print("losses match" if same else "LOSSES DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
