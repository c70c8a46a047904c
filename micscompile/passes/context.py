"""What every pass may read: the resolved plan, the trace's bookkeeping, the layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from micscompile.core.plan import PlanError, ResolvedPlan
from micscompile.core.program import Prefetch
from micscompile.core.sharding import BucketLayout, build_layouts
from micscompile.passes.buckets import assign_buckets, param_derived
from micscompile.trace import TrainGraph

CPU = torch.device("cpu")


@dataclass(frozen=True)
class PassContext:
    """Read-only inputs shared by the passes of one compilation."""

    plan: ResolvedPlan
    graph: TrainGraph
    """The trace (its ``gm`` is the pre-pass graph; passes get their own copy)."""
    layouts: tuple[BucketLayout, ...]
    block_bucket: dict[str, int]
    """Block FQN -> bucket index."""
    device: torch.device = CPU
    """Where this rank computes: factory ops traced on meta are moved here."""
    prefetch: Prefetch = Prefetch()
    """Where the gathers go (the schedule pass chooses it under the memory budget)."""
    hierarchical: frozenset[int] = frozenset()
    """Buckets gathered and reduce-scattered hierarchically (inter-node, then intra-node)."""


def first_uses(tg: TrainGraph) -> dict[str, int]:
    """Parameter -> index of the first node that reads it (through parameter-only views)."""
    placeholders = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    derived = param_derived(tg.gm.graph, dict(zip(placeholders[: tg.num_params], tg.param_names)))
    first: dict[str, int] = {}
    for i, node in enumerate(tg.gm.graph.nodes):
        if node not in derived:
            for inp in node.all_input_nodes:
                for name in derived.get(inp, ()):
                    first.setdefault(name, i)
    return first


def check_precision(tg: TrainGraph, plan: ResolvedPlan) -> None:
    """The trace must compute in the Plan's param_dtype (``trace(param_dtype=...)``)."""
    want = None if plan.plan.param_dtype == torch.float32 else plan.plan.param_dtype
    if tg.compute_dtype != want:
        raise PlanError(f"Plan.param_dtype={plan.plan.param_dtype} but the trace computes in "
                        f"{tg.compute_dtype or 'the model dtypes'}: trace with mc.trace(..., param_dtype="
                        f"{plan.plan.param_dtype})")


def make_context(
    tg: TrainGraph, plan: ResolvedPlan, device: torch.device = CPU, prefetch: Prefetch = Prefetch(),
) -> PassContext:
    """Buckets and layouts for ``plan``: needs no process group."""
    check_precision(tg, plan)
    param_bytes = {n: tg.param_bytes(n) for n in tg.param_names}
    buckets, block_bucket = assign_buckets(tg.param_names, param_bytes, tg.blocks, first_uses(tg), plan.bucket_bytes)
    dtypes = plan.plan.param_dtype, plan.plan.reduce_dtype
    layouts = tuple(build_layouts(buckets, tg.param_shapes, plan.partition_size, torch.float32, *dtypes,
                                  row_multiple=plan.optimizer_shards))
    return PassContext(plan=plan, graph=tg, layouts=layouts, block_bucket=block_bucket, device=device,
                       prefetch=prefetch)
