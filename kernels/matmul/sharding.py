"""How a batched product runs over a mesh (see `kernels.partition`).

Batch, M and N dims keep their shardings and run locally (data parallel, and the
column-parallel `x @ W` with W sharded over N). A sharded contracting dim K (row-parallel
weights) runs a local product on each device's K slice and sums the partials: an all-reduce,
or a reduce-scatter when XLA wants the output sharded by that axis. The same rule serves the
backward's products (dA = dC @ Bᵀ, dB = Aᵀ @ dC), which are products of this kind too.
"""

from __future__ import annotations

from typing import Any

from kernels.partition import Layout, Plan, reduction


def _roles(static: Any, rank: int) -> tuple[int, int, int, int]:
    """(M dim of a, K dim of a, K dim of b, N dim of b) under the static's transpose flags."""
    m_a, k_a = (rank - 1, rank - 2) if static.transpose_a else (rank - 2, rank - 1)
    k_b, n_b = (rank - 1, rank - 2) if static.transpose_b else (rank - 2, rank - 1)
    return m_a, k_a, k_b, n_b


def factors(static: Any, shapes: tuple) -> str:
    a_shape, b_shape = shapes
    rank = len(a_shape)
    m_a, k_a, k_b, n_b = _roles(static, rank)
    a, b = [""] * rank, [""] * rank
    out = []
    for d in range(rank - 2):
        a[d] = f"b{d}" if a_shape[d] > 1 or b_shape[d] == 1 else f"a{d}"
        b[d] = f"b{d}" if b_shape[d] > 1 or a_shape[d] == 1 else f"c{d}"
        out.append(f"b{d}")
    a[m_a], a[k_a], b[k_b], b[n_b] = "m", "k", "k", "n"
    return f"{' '.join(a)}, {' '.join(b)} -> {' '.join(out + ['m', 'n'])}"


def rule(product: Any, static: Any, layout: Layout) -> Plan:
    (a_shape, b_shape), (a_dims, b_dims) = layout.shapes, layout.dims
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

    def local(a, b):
        return sum_k(product(a, b, static))

    return Plan((tuple(a_in), tuple(b_in)), tuple(out_dims), local)
