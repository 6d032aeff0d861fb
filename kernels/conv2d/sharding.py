"""How a convolution and its weight gradient run over a mesh (see `kernels.partition`).

Batch (N) and output channels (O, the column-parallel case) keep their shardings and run
locally. Input channels (C) sharded with `feature_group_count == 1` reduce like matmul's K:
each device convolves its channel slice and the partial outputs are summed. With groups, a
channel sharding that splits whole groups (the depthwise case: any split) runs locally with
fewer groups per device. Spatially sharded images are gathered to whole images first (a window
crosses shard borders; a halo exchange is not implemented). The weight gradient sums its
per-device partials over the batch shards. The epilogue's bias is laid out like O; over
sharded input channels the kernel writes float32 partials and the epilogue runs after their sum,
in XLA on each device's block.
"""

from __future__ import annotations

from typing import Any

from kernels._epilogue import Epilogue, apply_after_sum
from kernels.partition import Layout, Plan, reduction
from kernels.reference.epilogue import accumulator_dtype


def _local_static(static: Any, layout: Layout, channels: tuple[str, ...]) -> Any:
    groups = static.geometry.groups // layout.size(channels)
    return static._replace(geometry=static.geometry._replace(groups=groups))


def _channels(layout: Layout, groups: int, *candidates: tuple[str, ...],
              used: set[str]) -> tuple[str, ...]:
    """Axes that split the channels into whole groups (only when there are groups)."""
    if groups == 1:
        return ()
    return layout.fit(groups, next((c for c in candidates if c), ()), used)


def factors(static: Any, shapes: tuple) -> str:
    bias = ", o" if shapes[2] is not None else ""
    outputs = ", ".join(["n y x o"] * static.epilogue.num_outputs)
    if static.geometry.groups == 1:
        return f"n h w c, p q c o{bias} -> {outputs}"
    return f"n h w c, p q i o{bias} -> {outputs}"


def rule(conv: Any, static: Any, layout: Layout) -> Plan:
    (x_shape, w_shape, bias_shape), (x_dims, w_dims, _) = layout.shapes, layout.dims
    groups = static.geometry.groups
    used: set[str] = set()
    n = layout.fit(x_shape[0], x_dims[0], used)
    grouped = _channels(layout, groups, x_dims[3], w_dims[3], used=used)
    o = grouped or layout.fit(w_shape[3], w_dims[3], used)
    c = () if groups > 1 else layout.fit(x_shape[3], x_dims[3] or w_dims[2], used)
    out_dims = [n, (), (), o]
    out_shape = (x_shape[0], None, None, w_shape[3])
    sum_c = reduction(c, out_shape, out_dims, layout)
    local_static = _local_static(static, layout, grouped)
    epilogue = static.epilogue

    def local(x, w, bias):
        if not c or epilogue.is_identity:
            return sum_c(conv(x, w, bias, local_static))
        partials = local_static._replace(epilogue=Epilogue(), out_dtype=accumulator_dtype(
            x.dtype, w.dtype, static.out_dtype))
        summed = sum_c(conv(x, w, None, partials))
        return apply_after_sum(summed, bias, None, epilogue, static.out_dtype)

    in_dims = ((n, (), (), grouped or c), ((), (), c, o),
               None if bias_shape is None else (out_dims[3],))
    if epilogue.saved is None:
        return Plan(in_dims, tuple(out_dims), local)
    return Plan(in_dims, (tuple(out_dims),) * 2, local, multiple=True)


def weight_gradient_factors(statics: Any, shapes: tuple) -> str:
    if statics[0].geometry.groups == 1:
        return "n h w c, n y x o -> p q c o"
    return "n h w c, n y x o -> p q i o"


def weight_gradient_rule(weight_gradient: Any, statics: Any, layout: Layout) -> Plan:
    static, kernel_hw = statics
    (x_shape, dy_shape), (x_dims, dy_dims) = layout.shapes, layout.dims
    groups = static.geometry.groups
    used: set[str] = set()
    n = layout.fit(x_shape[0], x_dims[0] or dy_dims[0], used)
    grouped = _channels(layout, groups, x_dims[3], dy_dims[3], used=used)
    o = grouped or layout.fit(dy_shape[3], dy_dims[3], used)
    c = () if groups > 1 else layout.fit(x_shape[3], x_dims[3], used)
    out_dims = [(), (), c, o]
    out_shape = (*kernel_hw, x_shape[3] // groups, dy_shape[3])
    sum_n = reduction(n, out_shape, out_dims, layout)
    local_statics = (_local_static(static, layout, grouped), kernel_hw)

    def local(x, dy):
        return sum_n(weight_gradient(x, dy, local_statics))

    return Plan(((n, (), (), grouped or c), (n, (), (), o)), tuple(out_dims), local)
