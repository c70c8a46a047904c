"""``mc.simulate``: predict a plan on any cluster from a trace, without a process group.

The same passes and Program lowering as ``mc.compile`` run on the trace; the event
simulator (cost_model.simulator) prices the Program on the cluster. Ranks are
symmetric under MiCS, so rank 0's Program stands for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from micscompile.core.collectives import GroupInfo
from micscompile.core.plan import Plan, ResolvedPlan
from micscompile.core.program import Kind, Prefetch, Program
from micscompile.cost_model.simulator import Prediction, simulate_program
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import schedule
from micscompile.lowering.pipeline import lower_pipeline
from micscompile.memory.lifetimes import arena_plan, buffers_as_run
from micscompile.memory.planner import Buffer
from micscompile.memory.stats import MemoryStats
from micscompile.trace import TrainGraph


def planned_groups(rp: ResolvedPlan, rank: int = 0) -> dict[str, GroupInfo]:
    """The groups ``rank`` belongs to under ``rp``, with node spans from gpus_per_node."""
    k = rp.gpus_per_node

    def info(name: str, ranks: tuple[int, ...], index: int) -> GroupInfo:
        return GroupInfo(name, None, ranks, index, len({r // k for r in ranks}) > 1)

    groups = {
        "shard": info("shard", rp.partition_ranks(rank), rank % rp.partition_size),
        "replicate": info("replicate", rp.replication_ranks(rank), rank // (rp.stages * rp.partition_size)),
        "world": info("world", tuple(range(rp.world_size)), rank),
    }
    if rp.stages > 1:  # the ranks that carry this rank's micro-batches through the pipeline
        groups["pipe"] = info("pipe", rp.pipe_ranks(rank), rp.stage_of(rank))
    if rp.spans_nodes:  # the two stages of hierarchical collectives
        groups["inter"] = info("inter", rp.inter_ranks(rank), (rank % rp.partition_size) // k)
        groups["intra"] = info("intra", rp.intra_ranks(rank), rank % k)
    return groups


def concrete(trace: TrainGraph) -> TrainGraph:
    """A symbolic-batch trace at its example batch (its shape arithmetic folded); others as they are."""
    return trace.at_batch(trace.batch_size) if trace.batch_symbols else trace


def model_buffer_bytes(trace: TrainGraph) -> int:
    """Bytes of the model's buffers (every rank holds them whole)."""
    nodes = list(trace.gm.graph.nodes)[trace.num_params: trace.num_params + len(trace.buffer_names)]
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)


def lower(
    trace: TrainGraph, rp: ResolvedPlan, rank: int = 0, cluster: Cluster | None = None,
    prefetch: Sequence[Prefetch | int] | None = None, **costs,
) -> Program:
    """The Program ``mc.compile`` would run on ``rank`` (scheduled on ``cluster``), built without a
    process group."""
    return schedule(trace, rp, cluster, planned_groups(rp, rank), rank, prefetch=prefetch,
                    costs=costs, need_graph=False).program


def _one_group(program: Program, cluster: Cluster) -> tuple[Program, Cluster]:
    """The same Program on a cluster of exactly one partition group (the scaling baseline)."""
    rp = program.plan
    p, k = rp.partition_size, rp.gpus_per_node
    small = cluster.with_nodes(-(-p // k)) if p >= k else dataclasses.replace(cluster, nodes=1, gpus_per_node=p)
    rp1 = ResolvedPlan(rp.plan, p, min(k, p), p, 1)
    boundary = [a for a in program.boundary if a.kind is not Kind.ALL_REDUCE]
    return dataclasses.replace(program, plan=rp1, groups=planned_groups(rp1), boundary=boundary), small


def simulate(
    trace: TrainGraph,
    plan: Plan,
    cluster: Cluster,
    *,
    flops_per_step: float | None = None,
    scaling: bool = True,
    prefetch: Sequence[Prefetch | int] | None = None,
    **costs,
) -> Prediction:
    """Predict one optimizer step of ``plan`` on ``cluster`` (world size = cluster.world_size).

    ``trace`` is one micro-batch (``mc.trace``). ``flops_per_step`` overrides the graph's
    FLOPs per rank per step (e.g. the transformer formula, ``transformer_flops``).
    ``costs`` go to ``cost_model.simulator.simulate_program``. The Program is scheduled as
    ``mc.compile`` schedules it (``passes.schedule``; ``prefetch`` as there).
    """
    rp = plan.resolve(cluster.world_size, cluster.gpus_per_node)
    trace = concrete(trace)
    if rp.stages > 1:  # MiCS-Pipe: every chunk lowered, the schedule simulated with its bubbles
        pp = lower_pipeline(trace, rp, cluster, planned_groups(rp), prefetch=prefetch, costs=costs)
        pred = pp.predict(cluster, **costs)
        if flops_per_step is not None:
            pred.flops_per_step = flops_per_step
        return pred
    program = lower(trace, rp, cluster=cluster, prefetch=prefetch, **costs)
    buffer_bytes = model_buffer_bytes(trace)
    pred = simulate_program(program, cluster, buffer_bytes=buffer_bytes, flops_per_step=flops_per_step, **costs)
    if scaling and rp.replicas > 1:
        base_program, base_cluster = _one_group(program, cluster)
        base = simulate_program(base_program, base_cluster, buffer_bytes=buffer_bytes, record=False, **costs)
        pred.scaling_efficiency = base.step_time_s / pred.step_time_s
    elif scaling:
        pred.scaling_efficiency = 1.0
    return pred


def step_buffers_of(
    trace: TrainGraph, plan: Plan, world_size: int, *, rank: int = 0, gpus_per_node: int | None = None,
    cluster: Cluster | None = None, prefetch: Sequence[Prefetch | int] | None = None, arena: bool = True,
) -> list[Buffer]:
    """The buffers one step of ``plan`` allocates on ``rank`` (``lifetimes``), lowered as
    ``mc.compile`` lowers it (``arena`` as there), without a process group."""
    rp = plan.resolve(world_size, gpus_per_node)
    trace = concrete(trace)
    groups = planned_groups(rp, rank)
    if rp.stages > 1:
        return buffers_as_run(lower_pipeline(trace, rp, cluster, groups, rank, prefetch=prefetch), arena)
    return buffers_as_run(schedule(trace, rp, cluster, groups, rank, prefetch=prefetch), arena)


def step_memory(trace: TrainGraph, plan: Plan, world_size: int, **kwargs) -> MemoryStats:
    """``step.memory_stats()`` before compiling: the arena ``mc.compile`` would plan for the
    collectives' buffers, the ops' own peak, every step buffer planned in one arena and PyTorch's
    caching allocator on the same trace (``kwargs`` as ``step_buffers_of``)."""
    buffers = step_buffers_of(trace, plan, world_size, **kwargs)
    return MemoryStats.of(buffers, arena_plan(buffers)[1])


def activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, itemsize: int = 2,
                               checkpoint: bool = False, fused_attention: bool = True) -> float:
    """Bytes one transformer layer keeps for its backward. Checkpointed: its input, b*s*h*itemsize
    (docs/design.md: b*s*h*2 in 16-bit). Otherwise Korthikanti et al.'s sbh(34 + 5as/h) 16-bit bytes less
    what dropout adds (three masks and the dropped-out attention probabilities): sbh(32 + 2as/h)
    with the attention probabilities materialized (math attention), scaled to ``itemsize``. A fused
    attention kernel (what ``mc.trace`` records, as flash attention runs) keeps no probabilities,
    only its fp32 log-sum-exp per head and query: sbh * 32 * itemsize / 2 + 4 * b * a * s."""
    sbh = batch * seq * hidden
    if checkpoint:
        return sbh * itemsize
    if fused_attention:
        return sbh * 32 * itemsize / 2 + 4 * batch * heads * seq
    return sbh * (32 + 2 * heads * seq / hidden) * itemsize / 2


def transformer_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration of a transformer (docs/design.md, thesis eq. 3.4):
    96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with activation recomputation; 72 instead of 96 without."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
