"""How a batched product runs over a mesh (see `kernels.partition`).

Batch, M and N dims keep their shardings and run locally (data parallel, and the
column-parallel `x @ W` with W sharded over N). A sharded contracting dim K (row-parallel
weights) runs a local product on each device's K slice and sums the partials: an all-reduce,
or a reduce-scatter when XLA wants the output sharded by that axis. The same rule serves the
backward's products (dA = dC @ Bᵀ, dB = Aᵀ @ dC), which are products of this kind too.

The epilogue's bias is laid out like N, its residual and saved pre-activation like the output.
Over a sharded K the kernel writes float32 partials and the epilogue runs after their sum, in
XLA on each device's block: an activation of a partial sum is not a partial of the activation.
"""

from __future__ import annotations

from typing import Any

from kernels._epilogue import Epilogue, apply_after_sum
from kernels.partition import Layout, Plan, reduction
from kernels.reference.epilogue import accumulator_dtype


def _roles(static: Any, rank: int) -> tuple[int, int, int, int]:
    """(M dim of a, K dim of a, K dim of b, N dim of b) under the static's transpose flags."""
    m_a, k_a = (rank - 1, rank - 2) if static.transpose_a else (rank - 2, rank - 1)
    k_b, n_b = (rank - 1, rank - 2) if static.transpose_b else (rank - 2, rank - 1)
    return m_a, k_a, k_b, n_b


def factors(static: Any, shapes: tuple) -> str:
    a_shape, b_shape, bias_shape, residual_shape = shapes
    rank = len(a_shape)
    m_a, k_a, k_b, n_b = _roles(static, rank)
    a, b = [""] * rank, [""] * rank
    out = []
    for d in range(rank - 2):
        a[d] = f"b{d}" if a_shape[d] > 1 or b_shape[d] == 1 else f"a{d}"
        b[d] = f"b{d}" if b_shape[d] > 1 or a_shape[d] == 1 else f"c{d}"
        out.append(f"b{d}")
    a[m_a], a[k_a], b[k_b], b[n_b] = "m", "k", "k", "n"
    out = " ".join(out + ["m", "n"])
    operands = [" ".join(a), " ".join(b)] + ["n"] * (bias_shape is not None) + [
        out] * (residual_shape is not None)
    return f"{', '.join(operands)} -> {', '.join([out] * static.epilogue.num_outputs)}"


def rule(product: Any, static: Any, layout: Layout) -> Plan:
    (a_shape, b_shape, *_), (a_dims, b_dims, *_) = layout.shapes, layout.dims
    rank = len(a_shape)
    m_a, k_a, k_b, n_b = _roles(static, rank)
    used: set[str] = set()
    batch = []
    for d in range(rank - 2):
        owner = a_dims[d] if a_shape[d] > 1 else ()
        other = b_dims[d] if b_shape[d] > 1 else ()
        batch.append(layout.fit(max(a_shape[d], b_shape[d]), owner or other, used))
    m = layout.fit(a_shape[m_a], a_dims[m_a], used)
    n = layout.fit(b_shape[n_b], b_dims[n_b], used)
    k = layout.fit(a_shape[k_a], a_dims[k_a] or b_dims[k_b], used)

    a_in, b_in = [()] * rank, [()] * rank
    for d in range(rank - 2):
        a_in[d] = batch[d] if a_shape[d] > 1 else ()
        b_in[d] = batch[d] if b_shape[d] > 1 else ()
    a_in[m_a], a_in[k_a], b_in[k_b], b_in[n_b] = m, k, k, n
    out_dims = [*batch, m, n]
    out_shape = [max(a_shape[d], b_shape[d]) for d in range(rank - 2)]
    sum_k = reduction(k, [*out_shape, a_shape[m_a], b_shape[n_b]], out_dims, layout)
    epilogue = static.epilogue

    def local(a, b, bias, residual):
        if not k or epilogue.is_identity:
            return sum_k(product(a, b, bias, residual, static))
        partials = static._replace(epilogue=Epilogue(), out_dtype=accumulator_dtype(
            a.dtype, b.dtype, static.out_dtype))
        summed = sum_k(product(a, b, None, None, partials))
        return apply_after_sum(summed, bias, residual, epilogue, static.out_dtype)

    in_dims = (tuple(a_in), tuple(b_in), (out_dims[-1],), tuple(out_dims))
    in_dims = tuple(d if shape is not None else None for d, shape in zip(in_dims, layout.shapes))
    if epilogue.saved is None:
        return Plan(in_dims, tuple(out_dims), local)
    return Plan(in_dims, (tuple(out_dims),) * 2, local, multiple=True)
