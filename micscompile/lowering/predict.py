"""``mc.simulate``: predict a plan on any cluster from a trace, without a process group.

The same passes and Program lowering as ``mc.compile`` run on the trace; the event
simulator (cost_model.simulator) prices the Program on the cluster. Ranks are
symmetric under MiCS, so rank 0's Program stands for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from micscompile.core.errors import InputError
from micscompile.core.plan import Plan, PlanError
from micscompile.core.program import Prefetch
from micscompile.cost_model.simulator import RUNTIME_COST_FIELDS, Prediction, RuntimeCosts
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.lowered import lower
from micscompile.lowering.peers import peer
from micscompile.memory.lifetimes import arena_offsets
from micscompile.memory.planner import Buffer
from micscompile.memory.stats import MemoryStats
from micscompile.passes.context import make_context
from micscompile.trace import TrainGraph


def concrete(trace: TrainGraph) -> TrainGraph:
    """A symbolic-batch trace at its example batch (its shape arithmetic folded); others as they are."""
    return trace.at_batch(trace.batch_size) if trace.batch_symbols else trace


def model_buffer_bytes(trace: TrainGraph) -> int:
    """Bytes of the model's buffers (every rank holds them whole)."""
    nodes = list(trace.gm.graph.nodes)[trace.num_params: trace.num_params + len(trace.buffer_names)]
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)


def simulate(
    trace: TrainGraph,
    plan: Plan,
    cluster: Cluster,
    *,
    flops_per_step: float | None = None,
    scaling: bool = True,
    prefetch: Sequence[Prefetch | int] | None = None,
    system: str = "micscompile",
    peer_config: Mapping[str, float] | None = None,
    **costs,
) -> Prediction:
    """Predict one optimizer step of ``plan`` on ``cluster`` (world size = cluster.world_size).

    ``system``: "micscompile", or a peer priced on the same trace (``lowering.peers``):
    "deepspeed-zero3" (``plan`` gives its micro-batches, dtypes and checkpointing; it shards over
    every rank; "deepspeed-zero3-v0.5": the version the thesis measured), "deepspeed-mics" (the
    thesis's implementation of ``plan``) or "fsdp2"
    (``plan.partition_size`` < world size: HSDP). ``peer_config``: a DeepSpeed peer's config values
    in place of its defaults (``lowering.peers.DS_CONFIG_KEYS``, e.g. ``{"reduce_bucket_size": 2e8}``).

    ``trace`` is one micro-batch (``mc.trace``). ``flops_per_step`` overrides the graph's
    FLOPs per rank per step (e.g. the transformer formula, ``transformer_flops``).
    ``costs`` go to ``cost_model.simulator.simulate_program``; those named by ``RuntimeCosts`` fields (e.g.
    ``host_per_step_s``, ``copy_out_ops=None``) replace the system's own runtime costs. The Program is scheduled
    as ``mc.compile`` schedules it (``lowering.lowered.lower``; ``prefetch`` as there).
    """
    given = {name: costs.pop(name) for name in list(costs) if name in RUNTIME_COST_FIELDS}
    if given:  # (the schedule's search prices them too)
        costs["runtime"] = RuntimeCosts(**given)
    other = peer(system, plan, cluster.world_size, peer_config)
    if prefetch is not None and other.prefetch is not None:
        raise InputError(f"prefetch chooses micscompile's gathers; {system} looks ahead by its own rule")
    plan, prefetch = other.plan, prefetch or other.prefetch
    rp = plan.resolve(cluster.world_size, cluster.gpus_per_node)
    trace = concrete(trace)
    if other.max_reuse_distance is not None:  # DeepSpeed: its reuse distance keeps forward gathers live
        kept = other.kept_live(make_context(trace, rp).layouts)
        lowered = _lower_keeping_live(trace, rp, cluster, prefetch, kept, costs)
    else:
        lowered = lower(trace, rp, cluster, planned_groups(rp), prefetch=prefetch, costs=costs, need_graph=False)
    if other.system != "micscompile":  # (a peer; only Megatron-LM's pipelines, whose rules need no layouts)
        layouts = lowered.program.layouts if rp.stages == 1 else ()
        costs = {**costs, "runtime": dataclasses.replace(other.runtime_costs(layouts), **given)}  # (the caller's win)
    return lowered.predict(cluster, buffer_bytes=model_buffer_bytes(trace), flops_per_step=flops_per_step,
                           scaling=scaling, **costs)


def _lower_keeping_live(trace: TrainGraph, rp, cluster: Cluster, prefetch: Sequence[Prefetch], kept: int, costs: dict):
    """Lowered with ``prefetch`` keeping ``kept`` buckets live, at most those backward gathers again (a
    small model's first blocks may be used in forward only)."""
    def lowered(keep: int):
        pfs = tuple(dataclasses.replace(pf, keep_live=keep) for pf in prefetch)
        return lower(trace, rp, cluster, planned_groups(rp), prefetch=pfs, costs=costs, need_graph=False)

    try:
        return lowered(kept)
    except PlanError:  # more than backward gathers again: keep those
        return lowered(len(lowered(0).program.regathered_buckets))


def step_buffers_of(
    trace: TrainGraph, plan: Plan, world_size: int, *, rank: int = 0, gpus_per_node: int | None = None,
    cluster: Cluster | None = None, prefetch: Sequence[Prefetch | int] | None = None, arena: bool = True,
) -> list[Buffer]:
    """The buffers one step of ``plan`` allocates on ``rank`` (``lifetimes``), lowered as
    ``mc.compile`` lowers it (``arena`` as there), without a process group."""
    rp = plan.resolve(world_size, gpus_per_node)
    trace = concrete(trace)
    return lower(trace, rp, cluster, planned_groups(rp, rank), rank, prefetch=prefetch).rewrite_for_runtime(arena)


def step_memory(trace: TrainGraph, plan: Plan, world_size: int, **kwargs) -> MemoryStats:
    """``step.memory_stats()`` before compiling: the arena ``mc.compile`` would plan for the
    collectives' buffers, the ops' own peak, every step buffer planned in one arena and PyTorch's
    caching allocator on the same trace (``kwargs`` as ``step_buffers_of``)."""
    buffers = step_buffers_of(trace, plan, world_size, **kwargs)
    return MemoryStats.of(buffers, arena_offsets(buffers)[1])


def activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, itemsize: int = 2,
                               checkpoint: bool = False, fused_attention: bool = True, tensor_parallel: int = 1,
                               sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer keeps for its backward on one rank. Checkpointed: its input,
    b*s*h*itemsize (docs/design.md: b*s*h*2 in 16-bit), 1/tp of it with sequence parallelism. Otherwise
    Korthikanti et al.'s per-layer formulas less what dropout adds (three masks and the dropped-out
    attention probabilities), scaled to ``itemsize``: sbh(32 + 2as/h) 16-bit bytes with the attention
    probabilities materialized (math attention); a fused attention kernel (what ``mc.trace`` records, as
    flash attention runs) keeps no probabilities, only its fp32 log-sum-exp per head and query, 4*b*a*s; and
    the two layer norms' fp32 mean and rstd, 16*b*s. With ``tensor_parallel`` t, the 24 sbh inside the
    split matmuls (q, k, v, the attention output, the MLP's two 4h activations) and the per-head terms
    divide by t, the 8 sbh outside them (the norms' inputs, the first matmuls' inputs) and the norms'
    statistics do not: sbh(8 + 24/t) (Korthikanti's 10 + 24/t less the dropout mask outside); with
    ``sequence_parallel`` they divide by t too: 32 sbh / t."""
    t, sbh = tensor_parallel, batch * seq * hidden
    outside = t if sequence_parallel else 1  # what the activations between the split matmuls divide by
    if checkpoint:
        return sbh * itemsize / outside
    per_head = 4 * batch * heads * seq if fused_attention else sbh * 2 * heads * seq / hidden * itemsize / 2
    return sbh * (8 / outside + 24 / t) * itemsize / 2 + per_head / t + 16 * batch * seq / outside


def model_flops_per_token(params: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per trained token, as MFU counts them (PaLM; llm-foundry): 6 N for the forward and backward of
    the N parameters, 12 l h s for attention's two sequence-long matmuls (non-causal), recomputation not counted."""
    return 6 * params + 12 * layers * hidden * seq


def transformer_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration of a transformer (docs/design.md, thesis eq. 3.4):
    96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with activation recomputation; 72 instead of 96 without."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
