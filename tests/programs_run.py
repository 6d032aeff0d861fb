"""Compiles whole programs for one target and prints one JSON line per program (a report of
`kernels.compile.programs`). Run by `tests/test_programs.py` in its own process (libtpu and the CUDA
plugin's compile-only devices are set up per process):

    python tests/programs_run.py ops TARGET [MESHES [PROGRAMS]]  # one device / Auto / Explicit
    python tests/programs_run.py models TARGET    # the examples' training steps
    python tests/programs_run.py language_model TARGET None,triton  # a Flax language model

`models` compiles one training step (loss, gradients, update) of `examples/train_digits.py`'s
CNN (data-parallel: the batch sharded over every device, Auto axes) and of
`examples/sharded_training.py`'s model (data- and tensor-parallel on a ("data", "model") mesh,
Auto axes as the example runs it), with the default implementation and with the target's
kernel; and the latter with the kernel on Explicit axes (there the default's `xla` conv is
JAX's own, which asks for an `out_sharding` of a convolution by out-channel-sharded weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kernels.compile import programs  # noqa: E402
from kernels.compile import implementation_for, use_compile_only_devices  # noqa: E402

use_compile_only_devices()


def _digits_step(implementation, mesh):
    from flax import nnx

    from examples import train_digits
    from kernels.flax import nnx as kernels_nnx

    model = train_digits.DigitsCNN(kernels_nnx, nnx.Rngs(0), implementation=implementation)
    graphdef, params = nnx.split(model, nnx.Param)

    def step(params, images, labels):
        def loss(params):
            return train_digits._loss(nnx.merge(graphdef, params), images, labels)

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(mesh.axis_names))
    specs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated),
                         params)
    return step, (specs, jax.ShapeDtypeStruct((64, 8, 8, 1), jnp.float32, sharding=batch),
                  jax.ShapeDtypeStruct((64,), jnp.int32, sharding=batch))


def _sharded_training_step(implementation, mesh):
    from examples import sharded_training as example

    params = jax.eval_shape(lambda: example.init(jax.random.key(0)))

    def step(params, tokens, labels):
        loss, grads = jax.value_and_grad(example.loss_fn)(params, tokens, labels, implementation)
        return loss, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                     sharding=NamedSharding(mesh, example.SPECS[k]))
             for k, v in params.items()}
    batch = NamedSharding(mesh, P("data"))
    return step, (specs, jax.ShapeDtypeStruct((example.BATCH, example.LENGTH), jnp.int32,
                                              sharding=batch),
                  jax.ShapeDtypeStruct((example.BATCH,), jnp.int32, sharding=batch))


# The language model's sizes: vocabulary, sequence, features, hidden units, batch.
_LM = dict(vocab=128, length=16, features=32, hidden=64, batch=8)


def _language_model_step(implementation, mesh):
    """One training step of a small language model of `kernels.flax.nnx` layers, tensor-parallel
    as such models are sharded: a conv stem over the sequence with its output channels sharded,
    a column-parallel Linear (kernel sharded over "model", bias replicated), a row-parallel one,
    LayerNorm, RMSNorm and a tied read-out through the embedding (`Embed.attend`); the batch
    over "data". The bias and norm parameters are replicated while the products they meet are
    sharded, so each gradient must be typed like its parameter on Explicit axes."""
    from flax import nnx

    from kernels.flax import nnx as layers

    vocab, length, features, hidden, batch = (_LM[k] for k in
                                              ("vocab", "length", "features", "hidden", "batch"))
    ops = dict(implementation=implementation)

    class LanguageModel(nnx.Module):
        def __init__(self):
            ops["rngs"] = nnx.Rngs(0)
            self.embed = layers.Embed(vocab, features, **ops)
            self.stem = layers.Conv(features, features, (1, 3), **ops)
            self.norm = layers.LayerNorm(features, **ops)
            self.up = layers.Linear(features, hidden, **ops)
            self.hidden_norm = layers.RMSNorm(hidden, **ops)
            self.down = layers.Linear(hidden, features, **ops)

        def __call__(self, tokens):
            x = self.embed(tokens)
            x = x + self.stem(x[:, None])[:, 0]
            x = x + self.down(self.hidden_norm(jax.nn.gelu(self.up(self.norm(x)))))
            return self.embed.attend(x)

    # Abstract: nothing runs on the compile-only devices in scope.
    graphdef, params = nnx.split(nnx.eval_shape(LanguageModel), nnx.Param)
    # Kernels sharded over "model" (column- and row-parallel), everything else replicated.
    sharded = {("stem", "kernel"): P(None, None, None, "model"), ("up", "kernel"): P(None, "model"),
               ("down", "kernel"): P("model", None)}

    def step(params, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
            target = jax.nn.one_hot(tokens[:, 1:], vocab, dtype=jnp.float32)
            return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * target, axis=-1))

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    specs = nnx.map_state(lambda path, p: jax.ShapeDtypeStruct(
        p.shape, p.dtype, sharding=NamedSharding(mesh, sharded.get(tuple(map(str, path)), P()))),
        params)
    return step, (specs, jax.ShapeDtypeStruct((batch, length + 1), jnp.int32,
                                              sharding=NamedSharding(mesh, P("data"))))


def language_model(target: str, implementations: list[str | None]) -> list[programs.ProgramReport]:
    """`_language_model_step` compiled for 4 devices of `target` on a (2, 2) mesh, Auto and
    Explicit axes, with each of `implementations` (None: the default)."""
    reports = []
    for implementation in implementations:
        for kind in ("auto", "explicit"):
            mesh = programs.mesh_for(target, 4, kind, shape=(2, 2))
            with jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext():
                step, args = _language_model_step(implementation, mesh)
                reports.append(programs.compile_program(
                    "language_model", step, args, mesh, target=target, mesh_kind=kind,
                    implementation=str(implementation)))
    return reports


def models(target: str) -> list[programs.ProgramReport]:
    count = 8 if target.startswith("sm_") else 4
    reports = []
    for implementation in (None, implementation_for(target)):
        for name, make, kinds in (("train_digits", _digits_step, ("auto",)),
                                  ("sharded_training", _sharded_training_step,
                                   ("auto", "explicit"))):
            for kind in kinds if implementation else ("auto",):
                mesh = programs.mesh_for(target, count, kind, shape=(count // 4, 4))
                with jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext():
                    step, args = make(implementation, mesh)
                reports.append(programs.compile_program(
                    name, step, args, mesh, target=target, mesh_kind=kind,
                    implementation=str(implementation)))
    return reports


def main(mode: str, target: str, meshes: str = ",".join(programs.MESHES),
         names: str = "") -> None:
    if mode == "ops":
        reports = programs.compile_ops(target, 4, meshes.split(","),
                                       implementations=(None, "kernel"),
                                       programs=names.split(",") if names else None)
    elif mode == "language_model":  # MESHES: here the implementations, comma-separated
        reports = language_model(target, [None if name == "None" else name
                                          for name in meshes.split(",")])
    else:
        reports = models(target)
    for report in reports:
        print(json.dumps(dataclasses.asdict(report)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
