"""A pipeline plan (MiCS-Pipe) lowered: the split, the schedule, one Program per chunk.

``lower_pipeline`` cuts the trace into S * v chunks (lowering.pipeline_split), then
lowers every chunk like a model of its own (lowering.flat over the chunk's t-rank
partition group: gathers, releases, reduce-scatters) and picks the pipeline
schedule (pipeline_schedule). Every rank lowers every chunk, so all ranks can check
that they agree on the whole pipeline before the first collective, and the
simulator can price the pipeline from any rank.

``LoweredPipeline.predict`` prices it with ``cost_model.pipeline.simulate_pipeline``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from micscompile.core import collectives as C
from micscompile.core.collectives import CommStats, fmt_bytes
from micscompile.core.errors import InputError
from micscompile.core.pipeline_schedule import Op, PipeSchedule, make_schedule
from micscompile.core.plan import PlanError, ResolvedPlan
from micscompile.core.program import Prefetch, Program, digest
from micscompile.cost_model.pipeline import memory_neutral, simulate_pipeline
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import LoweredFlat, lower_flat
from micscompile.lowering.pipeline_split import PipelineSplit, split
from micscompile.memory.lifetimes import pipeline_buffers, run_runtime_passes
from micscompile.memory.planner import Buffer
from micscompile.passes.context import CPU
from micscompile.trace import TrainGraph

DEFAULT_DISTANCES = (1, 2, 3)
"""Prefetch candidates inside a chunk (keep-live and across-micro-step gathers do not apply:
a chunk's forward and backward, and its micro-batches, are interleaved with others')."""


@dataclass
class LoweredPipeline:
    """What every rank of a pipeline plan runs: the split, the schedule and each chunk's Program."""

    plan: ResolvedPlan
    split: PipelineSplit
    schedule: PipeSchedule
    chunks: list[LoweredFlat]
    """Per chunk: its LoweredFlat (the Program; the rewritten graph for this rank's chunks)."""
    rank: int
    cluster: Cluster | None = None

    def program(self, chunk: int) -> Program:
        return self.chunks[chunk].program

    def my_chunks(self, rank: int | None = None) -> list[int]:
        return self.schedule.chunks_of(self.plan.stage_of(self.rank if rank is None else rank))

    def collective_order(self) -> list[str]:
        """Every chunk's collectives (chunk by chunk), then the schedule: what all ranks must agree on."""
        order = [f"chunk{c}:{x}" for c in range(len(self.chunks)) for x in self.program(c).collective_order()]
        return order + [str(self.schedule)]

    def fingerprint(self) -> str:
        """What every rank must agree on: each chunk's searched Program (``LoweredFlat.searched``: a rank
        lowers only its own chunks' graphs), the schedule and the cuts."""
        text = "|".join(chunk.searched or chunk.program.fingerprint() for chunk in self.chunks)
        return digest(text + str(self.schedule) + str(self.split.starts))

    def collective_fingerprint(self) -> str:
        return digest("|".join(self.collective_order()))

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.program(c).peak_gathered_bytes for c in self.my_chunks())

    def wire_bytes(self) -> dict[tuple[str, str], int]:
        """Predicted wire bytes of this rank's chunks' collectives and its sends for one step."""
        return {key: row.bytes for key, row in self.comm_stats().rows.items()}

    def programs(self) -> dict[int, Program]:
        return {c: self.program(c) for c in self.my_chunks()}

    def comm_stats(self, stats: CommStats | None = None) -> CommStats:
        """This rank's chunks' collectives over one step, together, and its point-to-point sends
        (each micro-batch's activations to the next chunk, gradients to the previous one), as
        ``step.comm_stats()`` counts them once run."""
        stats = CommStats() if stats is None else stats
        for program in self.programs().values():
            program.comm_stats(stats)
        stage = self.plan.stage_of(self.rank)
        k = self.plan.gpus_per_node
        for a in self.schedule.ranks[stage]:
            if a.chunk is None:  # (AR: the boundary)
                continue
            st = self.split.stages[a.chunk]
            groups = self.program(a.chunk).groups
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):  # a scattered receive all-gathered over the tensor group
                for t in st.recv_act if a.op is Op.RECV_ACT else st.recv_grad:
                    if t.pieces > 1:
                        stats.record(C.ALL_GATHER, groups["tensor"], t.nbytes)
            if a.op not in (Op.SEND_ACT, Op.SEND_GRAD):
                continue
            pipe = groups["pipe"]
            forward = a.op is Op.SEND_ACT
            peer = pipe.ranks[self.schedule.rank_of(a.chunk + (1 if forward else -1))]
            for t in st.send_act if forward else st.send_grad:
                stats.record_send(pipe, t.sent_nbytes, inter_node=peer // k != self.rank // k)
        return stats

    def predict(self, cluster: Cluster | None = None, *, buffer_bytes: int = 0, flops_per_step: float | None = None,
                scaling: bool = False, priced: dict | None = None, **costs) -> Prediction:
        """``simulate_pipeline`` on ``cluster`` (default: the one it was lowered for), with the chunk prices
        ``priced`` already made there (``memory_neutral``'s). Not yet priced for pipelines: the model's buffers
        (``buffer_bytes``) and the scaling baseline (``scaling``)."""
        cluster = cluster or self.cluster
        if cluster is None:
            raise InputError("no cluster to price the pipeline on: pass one (e.g. Cluster.preset('local'))")
        sent = [sum(tr.sent_nbytes for tr in st.send_act) for st in self.split.stages]
        gathered = [sum(tr.nbytes for tr in st.send_act if tr.pieces > 1) for st in self.split.stages]
        programs = [self.program(c) for c in range(len(self.chunks))]
        pred = simulate_pipeline(self.plan, self.schedule, programs, sent, cluster, gathered_bytes=gathered,
                                 priced=priced, **costs)
        if flops_per_step is not None:
            pred.flops_per_step = flops_per_step
        return pred

    def rewrite_for_runtime(self, arena: bool) -> list[Buffer]:
        """Run the runtime's passes on this rank's chunks, then return the step's buffers in schedule order
        (``lifetimes.pipeline_buffers``)."""
        run_runtime_passes([(self.chunks[c].graph, self.chunks[c].ctx) for c in self.my_chunks()], self.plan.plan, arena)
        return pipeline_buffers(self)

    def __str__(self) -> str:
        rp, sp = self.plan, self.split
        ends = (*sp.starts[1:], len(sp.units))
        lines = [f"micscompile pipeline  rank {self.rank}/{rp.world_size}  {rp}",
                 f"{len(self.chunks)} chunks (chunk c runs on pipeline rank c % {rp.stages}):"]
        for c, st in enumerate(sp.stages):
            blocks = ", ".join(b or "<root>" for b in sp.units[sp.starts[c]:ends[c]])
            sent = sum(t.sent_nbytes for t in st.send_act)
            how = (f", 1/{rp.tensor} of them per tensor rank, all-gathered by the next tensor group"
                   if any(t.pieces > 1 for t in st.send_act) else "")
            lines.append(f"  chunk {c}: {blocks}  ({sp.chunk_time_s()[c] * 1e3:.3f} ms predicted, "
                         f"sends {fmt_bytes(sent)} of activations per micro-batch{how})")
        if sp.tied:
            lines.append("tied parameters (gradients all-reduced between chunks at the boundary): "
                         + ", ".join(f"{n} {list(cs)}" for n, cs in sp.tied.items()))
        if rp.second_hop_in_backward:
            how = "reduce-scattered" if rp.optimizer_shards > 1 else "all-reduced"
            lines.append(f"second hops (SH): each chunk's last backward starts its buckets' gradient shards {how} "
                         f"over the {rp.replicas} replicas, each as soon as it is reduced; the boundary waits for them")
        lines += [str(self.schedule), self.schedule.grid()]
        for c in self.my_chunks():
            lines += [f"--- chunk {c} ---", str(self.program(c))]
        return "\n".join(lines)


def lower_pipeline(
    trace: TrainGraph, rp: ResolvedPlan, cluster: Cluster | None, groups: dict, rank: int = 0, *,
    device: torch.device = CPU, prefetch: Sequence[Prefetch | int] | None = None, costs: dict | None = None,
    disable=(), log=None, starts: tuple[int, ...] | None = None,
) -> LoweredPipeline:
    """Split, schedule every chunk and pick the pipeline schedule (no process group needed)."""
    plan = rp.plan
    for pf in prefetch or ():
        if isinstance(pf, Prefetch) and (pf.keep_live or pf.across_micro_steps):
            raise PlanError(f"{pf}: with pipeline stages, gathers are neither kept live from forward into backward "
                            "nor issued across micro-steps (other micro-batches run in between)")
    sched = make_schedule(plan.pipeline_schedule, rp.stages, rp.micro_batches, plan.chunks)
    sp = split(trace, rp, cluster.gpu if cluster is not None else None, starts=starts)
    mine = set(sched.chunks_of(rp.stage_of(rank)))
    chunks = [
        lower_flat(st.graph, rp, cluster, groups, rank, device=device, prefetch=prefetch or DEFAULT_DISTANCES,
                 costs=costs, need_graph=c in mine, disable=disable, log=log if c in mine else None)
        for c, st in enumerate(sp.stages)
    ]
    _check_tied_layouts(sp, chunks)
    sched = memory_neutral(rp, sched, [ch.program for ch in chunks], cluster, **(costs or {}))  # (ZB-H1's deferral)
    return LoweredPipeline(rp, sp, sched, chunks, rank, cluster)


def _check_tied_layouts(sp: PipelineSplit, chunks: list[LoweredFlat]) -> None:
    """A tied parameter's partial gradients are summed piece by piece at the boundary: every chunk
    holding it must shard it alike (refused here, before any collective)."""
    for name, holders in sp.tied.items():
        spans = set()
        for c in holders:
            layout, slot = next((ly, s) for ly in chunks[c].program.layouts for s in ly.slots if s.name == name)
            rows = layout.optimizer_layout(chunks[c].plan.optimizer_shards)  # (the optimizer's pieces, too)
            spans.add(tuple(lay.local_range(slot, r) for lay in (layout, rows) for r in range(lay.partition_size)))
        if len(spans) > 1:
            raise PlanError(f"tied parameter {name} is sharded differently in chunks {list(holders)}: each chunk "
                            "should hold it in a bucket of its own (pipeline_split); a micscompile bug, please report it")
