"""Every op over a mesh: each device runs the kernel on its own shard. One mechanism, all ops.

What an op provides
-------------------
An op wraps each function its `custom_vjp` calls (forward and backward kernels) with
`partitioned(fn, rule, factors)`. `fn(*operands, static)` is the kernel on whole arrays
(operands may be None). The op's rule (in its folder, `<op>/sharding.py`) maps a `Layout` (the
operands' shapes and, per dim, the mesh axes it is sharded over) to a `Plan`:

- `in_dims`: the sharding each operand must have. A rule keeps an operand's sharding wherever
  the maths allows and drops an axis only where the kernel needs that dim whole (XLA then
  all-gathers it: a conv's spatial dims, say), or where two operands disagree.
- `out_dims`: the outputs' shardings.
- `local`: what one device runs on its blocks: the kernel, then the collectives that turn
  per-shard partials into the result (`reduce`: psum, or psum_scatter when the output is
  wanted sharded; Chan's merge of moments; a vocab-parallel gather's sum over owners).
`factors` names the op's dims for Shardy's propagation, einsum style ("m k, k n -> m n"), so
that XLA carries shardings through the op to what consumes it.

How a plan is applied
---------------------
Which of three paths runs depends on what is known while tracing:

- Explicit mesh axes: the sharding is part of each operand's type, so the plan is built at
  trace time and run as `jax.shard_map(plan.local)` over operands resharded to `in_dims`.
- Auto mesh axes (shardings are decided by XLA's partitioner after tracing), on more than one
  device: `custom_partitioning`, whose partition callback builds the same plan from the
  shardings the partitioner proposes and returns `plan.local` as the per-device lowering.
- Inside the caller's `shard_map` (operands are already per-device blocks): the kernel runs as
  is. The public ops first mark all operands varying over the same manual axes
  (`match_varying`), so that the gradient of a replicated operand is summed over devices by
  JAX's own transpose rule, as for any jnp op.

`out_sharding=` (every op takes it, as JAX's own ops do) is a type on Explicit axes only: JAX
refuses Auto and Manual axes in it, and applies none elsewhere. There an op passes the mesh axes
it asks of each output dim to its rule through the static (`requested`, the same field the Auto
path fills from XLA's wish for the result), so a rule that sums partials over a sharded
contraction reduce-scatters into that sharding instead of all-reducing (`reduction`); whatever
a rule cannot give (a replicated operand asked sharded, say) is resharded after it
(`constrain`).

Which path runs is decided from the program's mesh as tracing sees it (the mesh in scope, or
the one jit records in its operands' types), never from the devices this process has: a CPU
host compiling for 8 GPUs has one. On one device, and under `vmap` (custom_partitioning has no
batching rule), the kernel runs unpartitioned, except on a mesh of Explicit axes, even of one
device: there the operands' types name mesh axes, which Pallas refuses, so it runs in
shard_map. XLA's TPU compiler cannot partition a
custom_partitioning call (jax-ml/jax#38196): the dispatch declines a compiled Mosaic kernel on
Auto axes (`check_partitionable`), so the default falls back to `xla` there, and Explicit axes
or shard_map run the kernels per shard. Under Auto axes a Mosaic kernel asked to run in TPU
interpret mode ("strict") runs in the HLO interpreter instead: XLA's partitioner cannot lower
the simulator's ordered host callbacks. Under Explicit axes and shard_map the simulator runs.

Modules: `rules` (what a rule sees and returns), `apply` (the three paths), `shardings` (arrays'
shardings while tracing: dims, asked out_sharding, reshapes); this package re-exports them.
"""

from kernels.partition.apply import (check_partitionable, match_varying, partitioned,
                                     strategy)
from kernels.partition.rules import (Axes, Dims, Factors, Layout, Plan, Reduction, Rule,
                                     reduction, spec)
from kernels.partition.shardings import (axis_sizes, constrain, dims_of, grouped, like, merged,
                                         mergeable, out_sharding, requested, reshape, sharding,
                                         split, ungrouped)

__all__ = ["Layout", "Plan", "partitioned", "match_varying", "Reduction", "reduction", "spec",
           "dims_of", "sharding", "reshape", "grouped", "ungrouped", "like", "strategy", "check_partitionable",
           "out_sharding", "requested", "merged", "mergeable", "split", "axis_sizes",
           "constrain", "Axes", "Dims", "Rule", "Factors"]
