"""Runs every op's sharding rules on 8 fake CPU devices and prints one JSON line per case.

Run by `tests/test_sharding.py` in its own process (the device count must be set before jax
starts): `python tests/sharded_run.py IMPLEMENTATION Auto,Explicit [CASE,...]` (every case
without a list). Each case calls the op under `jit` with inputs sharded on a (2, 4) mesh
("data", "model") of the given axis types, and inside `shard_map`, and records: the largest
differences of values and gradients from the unsharded call, the output sharding against the
`xla` implementation's, and the collectives in the compiled forward and gradient programs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kernels  # noqa: E402
from kernels.compile import programs  # noqa: E402
from kernels import registry  # noqa: E402
from kernels.ops import OPS  # noqa: E402


def compiled(fn, *args):
    """`fn` compiled for `args`: called for its values and read for its collectives, so each
    program is compiled once."""
    return jax.jit(fn).lower(*args).compile()


def collectives(program) -> dict[str, int]:
    return programs.collectives(program.as_text())


def ops_of(impl: str) -> list:
    """The ops `impl` runs: all for the reference, else those whose folder holds its kernels."""
    return [op for op in OPS.values() if not registry.get(impl).is_kernel or op.has(impl)]


def cases(impl: str):
    """name -> (function of the arrays, [(shape or 'ids', spec)]): the sharded cases of each op
    of `impl` (`kernels/<op>/cases.py`, `sharded`)."""
    return {name: case for op in ops_of(impl) for name, case in op.cases.sharded(impl).items()}


def arrays(specs, mesh):
    out = []
    for i, (shape, spec) in enumerate(specs):
        if isinstance(shape, str):  # indices of every kind of index: negative, past either end
            value = (jnp.arange(64, dtype=jnp.int32) * 37) % 260 - 130
            value = value.reshape({"ids2d": (8, 8), "ids2x32": (2, 32)}.get(shape, (64,)))
        else:
            value = jax.random.normal(jax.random.key(i), shape, jnp.float32)
        out.append(jax.device_put(value, NamedSharding(mesh, spec)))
    return out


def loss_of(fn):
    return lambda *a: jnp.sum(jnp.nan_to_num(fn(*a)) ** 2)


def _differences(out, out_whole, grads, grads_whole) -> dict:
    """The largest differences of a sharded call's value and gradients from the unsharded
    call's, whether their NaNs match, and the value's scale."""
    return {
        "value_error": float(np.nanmax(np.abs(np.asarray(out) - np.asarray(out_whole)))),
        "nan_match": bool(np.array_equal(np.isnan(out), np.isnan(out_whole))),
        "grad_error": max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                          for g, w in zip(grads, grads_whole)),
        "scale": float(np.nanmax(np.abs(np.asarray(out_whole)))),
        "grad_scale": max(float(np.max(np.abs(np.asarray(w)), initial=0.0)) for w in grads_whole),
    }


def run_case(impl, name, fn, specs, axis_type, xla_fn):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
    args = arrays(specs, mesh)
    whole = [np.asarray(a) for a in args]
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    grad = jax.grad(loss_of(fn), argnums=floats)
    forward, backward = compiled(fn, *args), compiled(grad, *args)
    out, grads = forward(*args), backward(*args)
    out_whole, grads_whole = jax.jit(fn)(*whole), jax.jit(grad)(*whole)
    record = {
        "impl": impl, "case": name, "mesh": axis_type.name,
        **_differences(out, out_whole, grads, grads_whole),
        "forward": collectives(forward),
        "backward": collectives(backward),
        "out_spec": str(out.sharding.spec),
    }
    # On Explicit axes too: where JAX's op alone would ask for an out_sharding, it gets the
    # kernels'. xla's own cases are that program already.
    xla_out = out if impl == registry.REFERENCE else jax.jit(xla_fn)(*args)
    record["same_sharding_as_xla"] = bool(out.sharding.is_equivalent_to(xla_out.sharding,
                                                                        out.ndim))
    record["xla_spec"] = str(xla_out.sharding.spec)
    return record


def run_shard_map(impl):
    """The ops inside the caller's shard_map: each device's call sees only its block."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 48))
    ids = (jnp.arange(64, dtype=jnp.int32) * 7) % 64

    def body(x, w, ids):  # row-parallel dense layer, layer norm, embedding lookup
        y = jax.lax.psum(kernels.matmul(x, w, implementation=impl), "model")
        y = kernels.layer_norm(y, implementation=impl)
        rows = kernels.gather(w.T, ids % 48, implementation=impl)[:, :1]  # varies over "model"
        return y + jax.lax.psum(rows, "model")

    # JAX's interpreters make a kernel's scratch buffers and Triton's padding of ragged blocks
    # without the varying manual axes, which shard_map's check rejects (interpret mode only:
    # tests/test_sharding_lowering.py lowers the checked path for devices).
    check = False
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None),
                                                       P("data")),
                            out_specs=P("data", None), check_vma=check)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w, ids) ** 2)  # noqa: E731
    out, grads = jax.jit(sharded)(x, w, ids), jax.jit(jax.grad(loss(sharded), (0, 1)))(x, w)
    # The same program with the reference ops: each device indexes its own slice of w.T.
    expected = jax.jit(jax.shard_map(
        lambda x, w, ids: (kernels.layer_norm(jax.lax.psum(x @ w, "model"), implementation="xla")
                           + jax.lax.psum(kernels.gather(w.T, ids % 48, implementation="xla")
                                          [:, :1], "model")),
        mesh=mesh, in_specs=(P("data", "model"), P("model", None), P("data")),
        out_specs=P("data", None), check_vma=check))
    ref_out = expected(x, w, ids)
    ref_grads = jax.jit(jax.grad(loss(expected), (0, 1)))(x, w)
    return {"impl": impl, "case": "shard_map", "mesh": "Manual",
            "value_error": float(np.max(np.abs(out - ref_out))),
            "nan_match": True,
            "grad_error": max(float(np.max(np.abs(g - r))) for g, r in zip(grads, ref_grads)),
            "scale": float(np.max(np.abs(ref_out))),
            "grad_scale": max(float(np.max(np.abs(r))) for r in ref_grads),
            "out_spec": str(out.sharding.spec)}


def run_reduce_scatter(impl):
    """Row-parallel matmul whose output is wanted sharded: a reduce-scatter, not all-reduce."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    a = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)),
                       NamedSharding(mesh, P(None, "model")))
    b = jax.device_put(jax.random.normal(jax.random.key(1), (32, 48)),
                       NamedSharding(mesh, P("model", None)))
    fn = lambda a, b: jax.lax.with_sharding_constraint(  # noqa: E731
        kernels.matmul(a, b, implementation=impl), NamedSharding(mesh, P("model", None)))
    program = compiled(fn, a, b)
    out, want = program(a, b), np.asarray(a) @ np.asarray(b)
    return {"impl": impl, "case": "matmul/K-reduce-scatter", "mesh": "Auto",
            "value_error": float(np.max(np.abs(out - want))),
            "nan_match": True, "grad_error": 0.0, "scale": float(np.max(np.abs(want))),
            "forward": collectives(program), "out_spec": str(out.sharding.spec)}


# out_sharding on Explicit axes: name -> (op of (arrays, out_sharding), operands, asked, want),
# every op's (`kernels/<op>/cases.py`, `OUT_SHARDING`). `asked` is the out_sharding given (None:
# the default, where JAX's own op alone would raise); `want` the output's spec.
OUT_SHARDING_CASES = {name: case for op in OPS.values()
                      for name, case in op.cases.OUT_SHARDING.items()}


def run_out_sharding(impl, name):
    """One `OUT_SHARDING_CASES` case on a (2, 4) Explicit mesh: values and gradients against
    the unsharded call's, the output's sharding, and the compiled forward's collectives."""
    make, specs, asked, want = OUT_SHARDING_CASES[name]
    fn = make(impl)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        args = arrays(specs, mesh)
        whole = [np.asarray(a) for a in args]
        op = lambda *a: fn(*a, asked)  # noqa: E731
        floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
        grad = jax.grad(loss_of(op), argnums=floats)
        forward, backward = compiled(op, *args), compiled(grad, *args)
        out, grads = forward(*args), backward(*args)
    unsharded = lambda *a: fn(*a, None)  # noqa: E731
    out_whole = jax.jit(unsharded)(*whole)
    grads_whole = jax.jit(jax.grad(loss_of(unsharded), argnums=floats))(*whole)
    return {
        "impl": str(impl), "case": f"out_sharding/{name}",
        "mesh": "Explicit" if impl else "Explicit, default",
        **_differences(out, out_whole, grads, grads_whole),
        "forward": collectives(forward),
        "out_spec": str(out.sharding.spec),
        "same_spec": bool(out.sharding.is_equivalent_to(NamedSharding(mesh, want), out.ndim)),
        "grad_specs_match": all(g.sharding.is_equivalent_to(args[i].sharding, g.ndim)
                                for g, i in zip(grads, floats)),
    }


# jax 0.10.2's XLA:CPU inlines the per-shard computations of an Auto-sharded interpreted kernel
# with a pass (CallInliner's stack-frame metadata, under WhileLoopSimplifier) that took over
# 400 s of one core on the gradient of the fused residual layer norm over sharded rows, where the
# traced Python stack was deep (inside this script's main()). Without full tracebacks in the
# IR's locations it compiles in seconds; jax 0.12 needs no such setting. Debug metadata only:
# the kernels, their partitioning and the values checked are the same. docs/usage.md tells
# users of jax 0.10.2 the same setting.
if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11):
    jax.config.update("jax_include_full_tracebacks_in_locations", False)


def main(impl: str, mesh_kinds: list[str], selected: set[str] | None) -> None:
    """Runs `impl`'s cases on each of `mesh_kinds`: those named in `selected` (the test
    suite's selection: `out_sharding/<name>`, `shard_map`, ...), or all."""
    def wanted(name):
        return selected is None or name in selected

    xla_cases = cases(registry.REFERENCE)  # the reference of each of impl's cases
    for axis_type in (getattr(AxisType, kind) for kind in mesh_kinds):
        for name, (fn, specs) in cases(impl).items():
            if wanted(name):
                record = run_case(impl, name, fn, specs, axis_type, xla_cases[name][0])
                print(json.dumps(record), flush=True)
    for name in (name for op in ops_of(impl) for name in op.cases.OUT_SHARDING):
        # xla's process runs the default too (xla on a CPU)
        for implementation in (impl, None) if impl == registry.REFERENCE else (impl,):
            if wanted(f"out_sharding/{name}"):
                print(json.dumps(run_out_sharding(implementation, name)), flush=True)
    if registry.get(impl).is_kernel and len(ops_of(impl)) == len(OPS):  # several ops at once
        for name, run in (("shard_map", run_shard_map),
                          ("matmul/K-reduce-scatter", run_reduce_scatter)):
            if wanted(name):
                print(json.dumps(run(impl)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","),
         set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
