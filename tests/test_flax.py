"""kernels.flax: each layer against Flax's own with the same parameters (forward and gradients,
every implementation), checkpoints both ways, jit/vmap/grad/remat, nnx.split/merge, errors.

Flax's layers are the reference here: they are JAX's own arithmetic on the same parameters, so
a layer that wired the op wrongly (a transposed kernel, a dropped bias, another epsilon, the
wrong promotion) fails against them.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax import serialization

from kernels import reference
from kernels.flax import linen as knn
from kernels.flax import nnx as knnx
from tests.support import assert_close, dot_platform, random, standard_promotion, x64

IDS = jnp.array([[0, 3, 9, 12], [-1, 2, 2, 5]])  # 12 is out of range: a NaN row ("fill")

# name: (nnx constructor args, linen constructor args, input, reduction length). Together:
# bias and no bias, a strided 2-D conv, a grouped 1-D causal conv (Flax pads it itself), a
# layer norm over two axes with per-last-axis features, bfloat16 inputs with float32 params.
LAYERS = {
    "Linear": ((16, 8), (8,), {}, random((2, 3, 16), jnp.float32, 1), 16),
    "Linear-no-bias": ((16, 8), (8,), {"use_bias": False}, random((5, 16), jnp.float32, 2), 16),
    "Conv-3x3-stride2": ((4, 6, (3, 3)), (6, (3, 3)), {"strides": 2},
                         random((2, 7, 9, 4), jnp.float32, 3), 36),
    "Conv-1d-causal-grouped": ((4, 6, 3), (6, 3), {"padding": "CAUSAL",
                                                   "feature_group_count": 2},
                               random((2, 9, 4), jnp.float32, 4), 6),
    "LayerNorm": ((16,), (), {}, random((2, 3, 16), jnp.float32, 5), 16),
    "LayerNorm-two-axes-bfloat16": ((16,), (), {"reduction_axes": (-2, -1), "epsilon": 1e-3},
                                    random((2, 3, 16), jnp.bfloat16, 6), 48),
    "RMSNorm": ((16,), (), {}, random((2, 3, 16), jnp.float32, 7), 16),
    "Embed": ((10, 8), (10, 8), {}, IDS, 1),
}
# Flax's own layers run under JAX's standard promotion: their statistics promote with
# jnp.promote_types(dtype, float32), which the suite's strict mode refuses for every dtype but
# float32. Ours run under strict, except where the inputs mix dtypes (bfloat16 data, float32
# parameters): the layers keep Flax's promotion, which strict refuses there as it does for Flax.
MIXED = {"LayerNorm-two-axes-bfloat16"}


def _promotion(name):
    return standard_promotion() if name in MIXED else contextlib.nullcontext()


NNX = {"Linear": (nnx.Linear, knnx.Linear), "Conv": (nnx.Conv, knnx.Conv),
       "LayerNorm": (nnx.LayerNorm, knnx.LayerNorm), "RMSNorm": (nnx.RMSNorm, knnx.RMSNorm),
       "Embed": (nnx.Embed, knnx.Embed)}
LINEN = {"Linear": (nn.Dense, knn.Dense), "Conv": (nn.Conv, knn.Conv),
         "LayerNorm": (nn.LayerNorm, knn.LayerNorm), "RMSNorm": (nn.RMSNorm, knn.RMSNorm),
         "Embed": (nn.Embed, knn.Embed)}


def _nnx_pair(name, **ours):
    args, _, options, _, _ = LAYERS[name]
    flax_cls, our_cls = NNX[name.split("-")[0]]
    return (flax_cls(*args, **options, rngs=nnx.Rngs(0)),
            our_cls(*args, **options, rngs=nnx.Rngs(1), **ours))


def _linen_pair(name, **ours):
    _, args, options, _, _ = LAYERS[name]
    flax_cls, our_cls = LINEN[name.split("-")[0]]
    return flax_cls(*args, **options), our_cls(*args, **options, **ours)


@pytest.mark.parametrize("name", ["Linear", "Conv-3x3-stride2", "Conv-1d-causal-grouped"])
def test_bias_is_added_in_the_kernel(name):
    """Linear/Dense and Conv hand their bias to the op's epilogue: the layer's forward is one
    kernel launch taking the bias as an operand, and nothing follows it but reshapes."""
    from kernels import _targets
    from kernels._pallas import on_target
    from kernels.compile.launches import launches

    x = LAYERS[name][3]
    flax_linen, linen_layer = _linen_pair(name, implementation="triton", interpret=False)
    _, nnx_layer = _nnx_pair(name, implementation="triton", interpret=False)
    params = flax_linen.init(jax.random.key(0), x)
    bias = params["params"]["bias"]
    target = _targets.TARGETS["sm_90"]
    for layer, args in ((lambda x: nnx_layer(x), (x,)),
                        (lambda p, x: linen_layer.apply(p, x), (params, x))):
        (launch,) = launches(layer, *args, target=target)
        assert any(v.aval.shape == bias.shape for v in launch.invars), launch.invars
        with on_target(target):
            jaxpr = jax.make_jaxpr(layer)(*args)
        assert not any(e.primitive.name == "add" for e in jaxpr.jaxpr.eqns), jaxpr


def _assert_same(ours, theirs, dtype, length, dot=False, platform=None):
    """Same shape and NaNs; values within `dtype`'s tolerance (`theirs` may be float64)."""
    assert ours.shape == theirs.shape
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    assert_close(np.nan_to_num(ours), np.nan_to_num(theirs), dtype, reduction_length=length,
                 dot=dot, platform=platform)


def _loss(apply):
    """A scalar of a layer's output that weighs every element differently (NaN rows of
    out-of-range ids count zero)."""
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(jnp.where(jnp.isnan(y), 0.0, jnp.sin(y)))
    return loss


def _value_and_gradients(apply, params, x):
    """The layer's output and gradients, one jitted program (op-by-op dispatch compiles each
    op apart: several times slower here)."""
    argnums = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0

    @jax.jit
    def run(params, x):
        return apply(params, x), jax.tree.leaves(jax.grad(_loss(apply), argnums=argnums)(
            params, x))
    return run(params, x)


def _check_against_flax(ours, theirs, params, x, name, implementation):
    """Our layer's output has Flax's dtype; its output and gradients equal Flax's layer
    evaluated in float64 (the ground truth: in bfloat16, Flax's own gradient sums two rounded
    terms that cancel). Linear and Conv layers are dots (`tests.support.tolerance`), as
    `implementation` computes them (`dot_platform`)."""
    length, dot = LAYERS[name][4], name.split("-")[0] in ("Linear", "Conv")
    with _promotion(name):
        out, grads = _value_and_gradients(ours, params, x)
    with standard_promotion():
        assert out.dtype == theirs(params, x).dtype
        with x64():
            widen = lambda a: a.astype(jnp.float64) if jnp.issubdtype(  # noqa: E731
                a.dtype, jnp.floating) else a
            want_out, want_grads = _value_and_gradients(theirs, jax.tree.map(widen, params),
                                                        widen(x))
    platform = dot_platform(implementation)
    _assert_same(out, want_out, out.dtype, length, dot, platform)
    for got, want in zip(grads, want_grads):
        _assert_same(got, want, got.dtype, 4 * length, dot, platform)


def _nnx_apply(graphdef):
    return lambda state, x: nnx.merge(graphdef, state)(x)


# The NNX and Linen layers call the ops through the same wrappers (kernels/flax/__init__.py), so
# the kernels run through NNX's and XLA through Linen's: every implementation, every layer (a
# kernel through Linen's too, in the exhaustive tier).
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("name", LAYERS)
def test_nnx_layer_matches_flax(name, implementation):
    """Flax's parameters in our layer: Flax's outputs and gradients."""
    theirs, ours = _nnx_pair(name, implementation=implementation)
    their_graphdef, params = nnx.split(theirs)
    _check_against_flax(_nnx_apply(nnx.graphdef(ours)), _nnx_apply(their_graphdef), params,
                        LAYERS[name][3], name, implementation)


@pytest.mark.parametrize("implementation", ["xla", pytest.param("triton",
                                                                marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("name", LAYERS)
def test_linen_layer_matches_flax(name, implementation):
    theirs, ours = _linen_pair(name, implementation=implementation)
    x = LAYERS[name][3]
    with standard_promotion():  # Flax's layer (see MIXED)
        params = theirs.init(jax.random.key(0), x)
    _check_against_flax(ours.apply, theirs.apply, params, x, name, implementation)


@pytest.mark.parametrize("name", ["LayerNorm", "Embed", "Linear"])
def test_layers_take_the_ops_interpret_values(name):
    """interpret= is passed to the op: "strict" runs the Mosaic kernel in the simulator and
    still matches Flax; a value the ops do not take is a TypeError naming the argument."""
    theirs, ours = _nnx_pair(name, implementation="mosaic", interpret="strict")
    x = LAYERS[name][3]
    got = _nnx_apply(nnx.graphdef(ours))(nnx.state(theirs), x)
    with standard_promotion():
        want = theirs(x)
    _assert_same(got, want, want.dtype, LAYERS[name][4])
    _, wrong = _linen_pair(name, implementation="mosaic", interpret="yes")
    with pytest.raises(TypeError, match="interpret must be None, True, False or 'strict'"):
        wrong.init(jax.random.key(0), x)


@pytest.mark.parametrize("name", LAYERS)
def test_nnx_checkpoint_round_trip(name):
    """Flax's parameters (names, shapes, dtypes) load into ours, and ours into Flax's."""
    # Flax's layers: under its standard promotion (see MIXED).
    with standard_promotion():
        theirs, ours = _nnx_pair(name)
        x = LAYERS[name][3]
        their_dict = nnx.to_pure_dict(nnx.state(theirs, nnx.Param))
        our_dict = nnx.to_pure_dict(nnx.state(ours, nnx.Param))
        assert jax.tree.map(lambda a: (a.shape, a.dtype), their_dict) == jax.tree.map(
            lambda a: (a.shape, a.dtype), our_dict)
        before = theirs(x)
        state = nnx.state(ours, nnx.Param)
        nnx.replace_by_pure_dict(state, their_dict)
        nnx.update(ours, state)
        back = nnx.state(theirs, nnx.Param)
        nnx.replace_by_pure_dict(back, nnx.to_pure_dict(nnx.state(ours, nnx.Param)))
        nnx.update(theirs, back)
        np.testing.assert_array_equal(np.asarray(theirs(x)), np.asarray(before))
        _assert_same(ours(x), before, before.dtype, LAYERS[name][4])


@pytest.mark.parametrize("name", LAYERS)
def test_linen_checkpoint_round_trip(name):
    """Flax's serialized parameters restore into ours' parameter tree and back."""
    # Flax's layers: under its standard promotion (see MIXED).
    with standard_promotion():
        theirs, ours = _linen_pair(name)
        x = LAYERS[name][3]
        their_params = theirs.init(jax.random.key(0), x)
        our_params = ours.init(jax.random.key(1), x)
        restored = serialization.from_bytes(our_params, serialization.to_bytes(their_params))
        back = serialization.from_bytes(their_params, serialization.to_bytes(restored))
        np.testing.assert_array_equal(np.asarray(theirs.apply(back, x)),
                                      np.asarray(theirs.apply(their_params, x)))
        want = theirs.apply(their_params, x)
        _assert_same(ours.apply(restored, x), want, want.dtype, LAYERS[name][4])


def test_nnx_model_under_jit_vmap_grad_and_remat():
    """A model of our layers through nnx.jit, jax.vmap, jax.grad and jax.checkpoint (on the
    split state) gives what the same model of Flax's layers gives. The layers' wrappers are
    what this proves (reshapes, promotion, the ops' arguments); each op is proven under these
    transforms on every kernel in its own suite, so the default implementation is enough."""
    class Model(nnx.Module):
        def __init__(self, layers, rngs, **ours):
            self.embed = layers.Embed(12, 8, rngs=rngs, **ours)
            self.conv = layers.Conv(8, 8, (3, 3), rngs=rngs, **ours)
            self.norm = layers.LayerNorm(8, rngs=rngs, **ours)
            self.out = layers.Linear(8, 3, rngs=rngs, **ours)

        def __call__(self, ids):
            h = self.embed(ids)[..., None, :, :]  # (batch, 1, 5, 8): a 1x5 image
            return self.out(self.norm(nnx.relu(self.conv(h)))).mean(axis=(-3, -2))

    ids = jnp.array([[1, 2, 3, 4, 5], [0, 11, 7, 7, 2], [3, 3, 3, 3, 3]])
    theirs = Model(nnx, nnx.Rngs(0))
    ours = Model(knnx, nnx.Rngs(0))
    graphdef, state = nnx.split(ours)
    their_graphdef, their_state = nnx.split(theirs)

    def run(graph):
        return lambda state, ids: nnx.merge(graph, state)(ids)

    want = jax.jit(run(their_graphdef))(their_state, ids)
    _assert_same(nnx.jit(lambda m, ids: m(ids))(ours, ids), want, jnp.float32, 72)
    per_example = jax.vmap(run(graphdef), in_axes=(None, 0))(state, ids[:, None])
    _assert_same(per_example[:, 0], want, jnp.float32, 72)
    loss = lambda graph: lambda s, ids: jnp.sum(jnp.sin(run(graph)(s, ids)))  # noqa: E731
    grads = jax.jit(jax.grad(jax.checkpoint(loss(graphdef))))(state, ids)
    their_grads = jax.jit(jax.grad(loss(their_graphdef)))(their_state, ids)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(their_grads)):
        _assert_same(got, expected, jnp.float32, 72)


def test_linen_remat_and_vmap():
    """nn.remat and nn.vmap lift our Linen layers as they lift Flax's."""
    x = random((4, 3, 16), jnp.float32, 9)
    theirs, ours = nn.remat(nn.Dense)(8), nn.remat(knn.Dense)(8, implementation="triton")
    params = theirs.init(jax.random.key(0), x)
    grad = lambda model: jax.grad(  # noqa: E731
        lambda p: jnp.sum(jnp.sin(model.apply(p, x))))(params)
    for got, want in zip(jax.tree.leaves(grad(ours)), jax.tree.leaves(grad(theirs))):
        _assert_same(got, want, jnp.float32, 64, dot=True, platform="gpu")
    vmapped = nn.vmap(knn.LayerNorm, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=0)(implementation="triton")
    flax_vmapped = nn.vmap(nn.LayerNorm, variable_axes={"params": 0},
                           split_rngs={"params": True}, in_axes=0)()
    params = flax_vmapped.init(jax.random.key(0), x)
    _assert_same(vmapped.apply(params, x), flax_vmapped.apply(params, x), jnp.float32, 16)


@pytest.mark.parametrize("mode", ["clip", "drop", "wrap"])
def test_embed_modes(mode):
    """`mode` decides out-of-range ids as `kernels.gather` (and its reference) does."""
    layer = knnx.Embed(10, 8, mode=mode, rngs=nnx.Rngs(0), implementation="triton")
    want = reference.gather(layer.embedding[...], IDS, axis=0, mode=mode)
    _assert_same(layer(IDS), want, jnp.float32, 1)


@pytest.mark.parametrize("build,call,error,match", [
    (lambda: knnx.Conv(2, 4, (3, 3), input_dilation=2, rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((1, 5, 5, 2))), NotImplementedError, "input_dilation"),
    (lambda: knnx.Conv(2, 4, (3, 3, 3), rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((1, 5, 5, 5, 2))), NotImplementedError, "kernel_size"),
    (lambda: knnx.Linear(2, 4, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0)),
     None, TypeError, "dot_general"),
    (lambda: knn.Dense(4, dot_general=jax.lax.dot_general),
     None, TypeError, "dot_general"),
    (lambda: knnx.LayerNorm(4, axis_name="batch", rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((2, 4))), NotImplementedError, "axis_name"),
    (lambda: knnx.RMSNorm(4, feature_axes=-2, reduction_axes=-1, rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((4, 3))), NotImplementedError, "feature_axes"),
    (lambda: knnx.LayerNorm(4, rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((2, 4)), mask=jnp.ones((2, 4), bool)), NotImplementedError, "mask"),
    (lambda: knnx.Embed(4, 2, rngs=nnx.Rngs(0)),
     lambda m: m(jnp.ones((3,))), ValueError, "integer"),
], ids=["input_dilation", "3-d", "nnx-dot_general", "linen-dot_general", "axis_name",
        "feature_axes", "mask", "float-ids"])
def test_what_the_layers_do_not_take(build, call, error, match):
    with pytest.raises(error, match=match):
        call(build()) if call else build()


def test_train_digits_example_tracks_flax(tmp_path):
    """examples/train_digits.py, a few steps: our model's losses follow the Flax model's from
    the same parameters, and the loss-curve PNG is written. (The default implementation: the
    layers' kernels are proven against Flax's layers above.)"""
    from examples import train_digits

    data = train_digits.load_digits()
    theirs, ours = train_digits.twin_models(None)
    options = dict(epochs=1, batch_size=32, learning_rate=3e-3, max_steps=4)
    ours_history = train_digits.train(ours, data, **options)
    their_history = train_digits.train(theirs, data, **options)
    assert len(ours_history["loss"]) == 4
    np.testing.assert_allclose(ours_history["loss"], their_history["loss"], rtol=1e-3)
    assert their_history["loss"][-1] < their_history["loss"][0]  # it does train
    assert abs(ours_history["test_accuracy"][0] - their_history["test_accuracy"][0]) <= 0.01
    path = tmp_path / "curves.png"
    train_digits.save_curves(str(path), {"ours": ours_history, "flax": their_history})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_norm_layers_fuse_the_residual_add(api, name):
    """`layer(x, residual=r)` is `(layer(x + r), x + r)` (the pre-norm transformer's step) from
    one fused kernel: Flax's layer on the exact sum in float64 for the output and the gradients
    of x, r and the parameters; the sum is XLA's own `x + r`."""
    x, r = random((2, 3, 16), jnp.float32, 20), random((2, 3, 16), jnp.float32, 21)
    if api == "nnx":
        theirs, ours = _nnx_pair(name, implementation="triton")
        their_graphdef, params = nnx.split(theirs)
        our_graphdef = nnx.graphdef(ours)
        apply = lambda p, x, r: nnx.merge(our_graphdef, p)(x, residual=r)  # noqa: E731
        flax_apply = _nnx_apply(their_graphdef)
    else:
        theirs, ours = _linen_pair(name, implementation="triton")
        params = theirs.init(jax.random.key(0), x)
        apply = lambda p, x, r: ours.apply(p, x, residual=r)  # noqa: E731
        flax_apply = theirs.apply

    def loss(y, total):
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(total))

    (y, total), grads = jax.jit(lambda p, x, r: (apply(p, x, r), jax.grad(
        lambda p, x, r: loss(*apply(p, x, r)), argnums=(0, 1, 2))(p, x, r)))(params, x, r)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(x + r))
    with standard_promotion(), x64():  # Flax's layer (see MIXED)
        wide = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x, r))

        def flax_loss(p, x, r):
            return loss(flax_apply(p, x + r), x + r)

        want_y = flax_apply(wide[0], wide[1] + wide[2])
        want_grads = jax.grad(flax_loss, argnums=(0, 1, 2))(*wide)
    _assert_same(y, want_y, y.dtype, 16)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        _assert_same(got, want, got.dtype, 4 * 16)
