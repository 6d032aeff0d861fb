"""The meaning of `kernels.gather`: `x.at[..., indices, ...].get(mode=...)` and `jnp.take(wrap)`.

JAX's own index arithmetic runs in the index dtype and can be wrong: int8 indices into an axis
longer than 127 raise OverflowError (`x[i]`) or come out NaN (`jnp.take`), and int64 or uint32
indices beyond the int32 range are truncated to int32 (jax 0.10 and 0.12 with x64: index 2**40
into 10 rows reads row 0). This module first narrows the indices to int32 *without changing
any index's outcome under `mode`* (`bounded_indices`), then lets JAX do the gather, so the
result is NumPy's answer and the gradient is JAX's gradient for that mode.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

MODES = (None, "promise_in_bounds", "clip", "drop", "fill", "wrap")
# Modes in which an out-of-range index reads the edge row; in the others it reads fill_value
# ("drop", "fill") or wraps ("wrap").
CLAMPING_MODES = (None, "promise_in_bounds", "clip")
_INT32_MAX = int(np.iinfo(np.int32).max)


def check_arguments(x: jax.Array, indices: jax.Array, axis: int, mode: str | None,
                    op: str = "gather") -> int:
    """Raises ValueError/TypeError for bad arguments; returns `axis` in [0, x.ndim)."""
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{op}: indices must have an integer dtype, got {indices.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have rank >= 1, got shape {x.shape}")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{op}: axis must be an int, got {axis!r}") from None
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: axis {axis} is out of bounds for x of shape {x.shape}")
    axis %= x.ndim
    if x.shape[axis] == 0 and indices.size:
        raise ValueError(f"{op}: cannot gather {indices.size} indices from axis {axis} of size "
                         f"0 (x has shape {x.shape})")
    if x.shape[axis] > _INT32_MAX:
        raise ValueError(f"{op}: axis {axis} of x has {x.shape[axis]} entries; at most "
                         f"{_INT32_MAX} are supported")
    return axis


def bounded_indices(indices, n: int, mode: str | None):
    """int32 indices with the same outcome as `indices` under `mode`, for an axis of size n.

    "wrap": `indices mod n`, computed in the indices' own dtype when it is wider than int32 (the
    result is in [0, n)). Other modes: indices saturated to [-n - 1, n], which keeps every
    in-range index (negative ones included) and keeps every out-of-range one out of range on the
    same side, so clamping and filling give the same answer. Narrow dtypes are widened to int32
    first, so no step overflows. A NumPy array is narrowed with NumPy (on the host).
    """
    xp = np if isinstance(indices, np.ndarray) else jnp
    dtype = np.dtype(indices.dtype)
    fits_int32 = dtype.itemsize < 4 or dtype == np.int32
    if fits_int32:
        return indices.astype(np.int32)
    if mode == "wrap":
        return xp.remainder(indices, xp.asarray(max(n, 1), dtype)).astype(np.int32)
    if np.issubdtype(dtype, np.unsignedinteger):
        return xp.minimum(indices, xp.asarray(n, dtype)).astype(np.int32)
    return xp.clip(indices, xp.asarray(-n - 1, dtype), xp.asarray(n, dtype)).astype(np.int32)


def host_indices(indices):
    """`indices` as an array, left on the host when it came from there: with 64-bit types
    disabled, `jnp.asarray` would truncate 64-bit integers to 32 bits (2**32 + 3 becomes 3,
    with only a warning), so host indices reach `bounded_indices` as NumPy arrays instead."""
    return indices if isinstance(indices, jax.Array) else np.asarray(indices)


def default_fill_value(dtype: jnp.dtype):
    """JAX's fill for "drop"/"fill" when none is given: NaN, the signed minimum, the unsigned
    maximum, True."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.nan
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return int(jnp.iinfo(dtype).min)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return int(jnp.iinfo(dtype).max)
    return True


def gather(
    x: jax.Array,
    indices: jax.Array,
    *,
    axis: int = 0,
    mode: str | None = None,
    fill_value=None,
    out_sharding=None,
) -> jax.Array:
    """`x.at[(slice(None),) * axis + (indices,)].get(mode=mode, fill_value=fill_value)`, or
    `jnp.take(x, indices, axis=axis, mode="wrap")` for mode="wrap", with NumPy's answer for
    every index value and index dtype. `out_sharding`: the result's sharding, as
    `.at[].get` takes it (on an Explicit mesh JAX asks for it when the table and the indices
    are sharded over different axes)."""
    x, indices = jnp.asarray(x), host_indices(indices)
    axis = check_arguments(x, indices, axis, mode)
    n = x.shape[axis]
    safe = jnp.asarray(bounded_indices(indices, n, mode))
    if safe.size == 0:
        return jnp.zeros(x.shape[:axis] + indices.shape + x.shape[axis + 1:], x.dtype)
    if mode == "wrap":
        if out_sharding is None:
            return jnp.take(x, safe, axis=axis, mode="wrap")
        # jnp.take takes no out_sharding: wrap the indices here, then gather them in range.
        safe, mode = jnp.remainder(safe, n), "promise_in_bounds"
    return x.at[(slice(None),) * axis + (safe,)].get(mode=mode, fill_value=fill_value,
                                                    out_sharding=out_sharding)
