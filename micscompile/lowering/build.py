"""Lower a rewritten graph to a Program: each collective node an action, each run of compute
nodes between them one COMPUTE action, then the boundary actions (docs/design.md#data-flow)."""

from __future__ import annotations

import functools

import numpy as np
import torch.fx

from micscompile.core import collectives as C
from micscompile.core.collectives import GroupInfo
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import BLOCKING_KIND, GROUP_OF_BLOCKING, ISSUE_KIND, REGION_BWD, Action, Kind, Program
from micscompile.core.sharding import BucketLayout
from micscompile.cost_model.node_cost import META_TIME_S, NodeWork, activation_bytes, node_work
from micscompile.passes.weight_split import backward_phases
from micscompile.trace import META_BYTES, META_FLOPS, META_FQN, META_REGION


def _peak(values):
    """The most of ``values`` (ints, or numpy arrays over micro-batch sizes: elementwise)."""
    most = functools.reduce(np.maximum, values)
    return int(most) if np.ndim(most) == 0 else most


def build_program(
    graph: torch.fx.Graph, plan: ResolvedPlan, layouts: tuple[BucketLayout, ...],
    groups: dict[str, GroupInfo], rank: int,
) -> Program:
    """Lower a rewritten graph (insert_collectives output) to a Program."""
    actions: list[Action] = []
    issued: dict[torch.fx.Node, Kind] = {}
    run: list[torch.fx.Node] = []
    collective_nodes = {n for n in graph.nodes if n.target in ISSUE_KIND or n.target in BLOCKING_KIND
                        or n.target in (C.collective_wait, C.accumulate)}
    live = activation_bytes(graph, exclude=collective_nodes)
    weight = set(backward_phases(graph)[1]) if plan.plan.weight_split else set()

    def flush() -> None:
        if run:
            regions = [f"{n.meta.get(META_REGION, '')}:{n.meta.get(META_FQN, '') or '<root>'}" for n in run]
            region = regions[0] if regions[0] == regions[-1] else f"{regions[0]} .. {regions[-1]}"
            work = sum((node_work(n) for n in run), NodeWork())
            timed = [n.meta[META_TIME_S] for n in run if META_TIME_S in n.meta]
            actions.append(Action(
                Kind.COMPUTE, ops=work.ops, flops=sum(n.meta.get(META_FLOPS, 0) for n in run),
                matmul_flops=work.matmul_flops, mem_bytes=work.mem_bytes, activation_bytes=live[run[-1]],
                activation_peak_bytes=_peak(live[n] for n in run), region=region,
                measured_s=sum(timed) if timed else None, weight=run[0] in weight,
            ))
            run.clear()

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        kind = ISSUE_KIND.get(node.target)
        if node.target is C.accumulate:
            continue  # (priced with the micro-step's accumulation, cost_model.simulator)
        if node.target in BLOCKING_KIND:  # blocking, on the compute's path: one action, no wait of its own
            flush()
            nbytes = node.meta.get(META_BYTES, 0)
            if node.target is C.tensor_reduce_scatter:
                nbytes = nbytes * node.args[4]  # (its input: tp pieces like its output; not in place: an array's shared)
            kind = BLOCKING_KIND[node.target]
            actions.append(Action(kind, group=GROUP_OF_BLOCKING[kind], tensor_bytes=nbytes,
                                  region=node.meta.get(META_REGION, ""), weight=node in weight))
        elif node.target is C.collective_wait:
            flush()
            actions.append(Action(Kind.WAIT, node.args[1].args[1], waits_for=issued[node.args[1]],
                                  weight=node in weight))
        elif kind is not None:
            flush()
            bucket = node.args[1]
            group = {Kind.ALL_GATHER: "shard", Kind.ALL_GATHER_NEXT: "shard", Kind.REDUCE_SCATTER: "shard",
                     Kind.ALL_REDUCE: "world", Kind.SECOND_HOP: "replicate"}.get(kind)
            lay = layouts[bucket]
            nbytes = lay.grad_bytes if kind in (Kind.REDUCE_SCATTER, Kind.ALL_REDUCE, Kind.PACK) else \
                lay.grad_shard_bytes if kind is Kind.SECOND_HOP else lay.full_bytes
            actions.append(Action(kind, bucket, group=group, tensor_bytes=nbytes,
                                  carried=node.target is C.all_gather_carried, region=node.meta.get(META_REGION, ""),
                                  hierarchical=node.kwargs.get("hierarchical", False), weight=node in weight))
            issued[node] = kind
        else:
            if run and (run[-1].meta.get(META_REGION) != node.meta.get(META_REGION)
                        or (run[-1] in weight) != (node in weight)):
                flush()  # forward, B and W never share a compute action (a pipeline runs them apart)
            run.append(node)
    flush()
    return Program(rank, plan, layouts, groups, actions, boundary_actions(plan, layouts, actions))


def with_second_hops(plan: ResolvedPlan, layouts: tuple[BucketLayout, ...], micro_step: list[Action]) -> list[Action]:
    """``micro_step`` with the second hops ``insert_collectives`` places for ``plan``: one right after
    each bucket's reduction is done (its reduce-scatter's wait; at p = 1 its pack), where
    ``ResolvedPlan.second_hop_in_backward``; none otherwise. For a Program lowered for another
    partition size (``tune.repricing``)."""
    out = []
    for a in micro_step:
        if a.kind is Kind.SECOND_HOP:
            continue
        out.append(a)
        done = a.kind is Kind.PACK or (a.kind is Kind.WAIT and a.waits_for is Kind.REDUCE_SCATTER)
        if done and plan.second_hop_in_backward:
            out.append(Action(Kind.SECOND_HOP, a.bucket, group="replicate",
                              tensor_bytes=layouts[a.bucket].grad_shard_bytes, region=REGION_BWD, weight=a.weight))
    return out


def boundary_actions(plan: ResolvedPlan, layouts: tuple[BucketLayout, ...], micro_step: list[Action]) -> list[Action]:
    """What runs once per step after the micro-steps: the loss all-reduce (issued first), the waits
    for the second hops the last backward started (2-hop, d > 1), the optimizer step and, with
    ``optimizer_sharding="world"``, the update gathers."""
    hops = [a.bucket for a in micro_step if a.kind is Kind.SECOND_HOP]
    return [Action(Kind.LOSS_ALL_REDUCE, group="world", tensor_bytes=4),
            *(Action(Kind.WAIT, b, waits_for=Kind.SECOND_HOP) for b in hops), Action(Kind.OPTIMIZER),
            *update_gathers(plan, layouts, hops, micro_step)]


def update_gathers(plan: ResolvedPlan, layouts: tuple[BucketLayout, ...], buckets: list[int],
                   micro_step: list[Action]) -> list[Action]:
    """``optimizer_sharding="world"``: after the optimizer stepped each rank's 1/d of its shards, the
    updated shards of ``buckets`` (those the replicas reduced) all-gathered over the replicas, in the
    gathers' dtype (``collectives.update_gather_start``), in the order the next step first gathers them
    (each is waited for there)."""
    if plan.optimizer_shards == 1:
        return []
    first = {}
    for i, a in enumerate(micro_step):
        if a.kind in (Kind.ALL_GATHER, Kind.ALL_GATHER_NEXT):
            first.setdefault(a.bucket, i)
    return [Action(Kind.UPDATE_GATHER, b, group="replicate",
                   tensor_bytes=layouts[b].row_numel * layouts[b].gather_dtype.itemsize)
            for b in sorted(buckets, key=lambda b: (first.get(b, len(micro_step)), b))]
