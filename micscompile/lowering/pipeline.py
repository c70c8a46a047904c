"""A pipeline plan (MiCS-Pipe) lowered: the split, the schedule, one Program per chunk.

``lower_pipeline`` cuts the trace into S * v chunks (lowering.pipeline_split), then
lowers every chunk like a model of its own (lowering.flat over the chunk's t-rank
partition group: gathers, releases, reduce-scatters) and picks the pipeline
schedule (pipeline_schedule). Every rank lowers every chunk, so all ranks can check
that they agree on the whole pipeline before the first collective, and the
simulator can price the pipeline from any rank.

``LoweredPipeline.predict`` prices it: each chunk's forward and backward are its
Program's two halves simulated on the cluster (gathers and reduce-scatters inside
them), the schedule's event simulation adds the bubbles and the P2P hops, and the
boundary (replication and tied-weight all-reduces, optimizer) follows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from micscompile.core.collectives import CommStats, fmt_bytes
from micscompile.core.pipeline_schedule import Op, PipeSchedule, make_schedule
from micscompile.core.plan import PlanError, ResolvedPlan
from micscompile.core.program import Kind, Prefetch, Program, backward_start, digest
from micscompile.cost_model.collective_time import P2P, collective_time_s
from micscompile.cost_model.simulator import Event, Prediction, simulate_program
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import LoweredFlat, lower_flat
from micscompile.lowering.pipeline_split import PipelineSplit, split
from micscompile.memory.lifetimes import pipeline_buffers, write_into_arena
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
        text = "|".join(self.program(c).fingerprint() for c in range(len(self.chunks)))
        return digest(text + str(self.schedule) + str(self.split.starts))

    def collective_fingerprint(self) -> str:
        return digest("|".join(self.collective_order()))

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.program(c).peak_gathered_bytes for c in self.my_chunks())

    def wire_bytes(self) -> dict[tuple[str, str], int]:
        """Predicted wire bytes of this rank's chunks' collectives for one step."""
        out: dict[tuple[str, str], int] = {}
        for c in self.my_chunks():
            for key, v in self.program(c).wire_bytes().items():
                out[key] = out.get(key, 0) + v
        return out

    def programs(self) -> dict[int, Program]:
        return {c: self.program(c) for c in self.my_chunks()}

    def comm_stats(self, stats: CommStats | None = None) -> CommStats:
        """This rank's chunks' collectives over one step, together."""
        stats = CommStats() if stats is None else stats
        for program in self.programs().values():
            program.comm_stats(stats)
        return stats

    def predict(self, cluster: Cluster | None = None, *, buffer_bytes: int = 0, flops_per_step: float | None = None,
                scaling: bool = False, **costs) -> Prediction:
        """``simulate_pipeline`` on ``cluster`` (default: the one it was lowered for). Not yet priced
        for pipelines: the model's buffers (``buffer_bytes``) and the scaling baseline (``scaling``)."""
        cluster = cluster or self.cluster
        if cluster is None:
            raise ValueError("no cluster to price the pipeline on: pass one (e.g. Cluster.preset('local'))")
        pred = simulate_pipeline(self, cluster, **costs)
        if flops_per_step is not None:
            pred.flops_per_step = flops_per_step
        return pred

    def rewrite_for_arena(self, arena: bool) -> list[Buffer]:
        """Rewrite this rank's chunks for the arena, then return the step's buffers in schedule order
        (``lifetimes.pipeline_buffers``)."""
        write_into_arena([(self.chunks[c].graph, self.chunks[c].ctx) for c in self.my_chunks()], self.plan.plan, arena)
        return pipeline_buffers(self)

    def __str__(self) -> str:
        rp, sp = self.plan, self.split
        ends = (*sp.starts[1:], len(sp.units))
        lines = [f"micscompile pipeline  rank {self.rank}/{rp.world_size}  {rp}",
                 f"{len(self.chunks)} chunks (chunk c runs on pipeline rank c % {rp.stages}):"]
        for c, st in enumerate(sp.stages):
            blocks = ", ".join(b or "<root>" for b in sp.units[sp.starts[c]:ends[c]])
            sent = sum(t.nbytes for t in st.send_act)
            lines.append(f"  chunk {c}: {blocks}  ({sp.chunk_time_s()[c] * 1e3:.3f} ms predicted, "
                         f"sends {fmt_bytes(sent)} of activations per micro-batch)")
        if sp.tied:
            lines.append("tied parameters (gradients all-reduced between chunks at the boundary): "
                         + ", ".join(f"{n} {list(cs)}" for n, cs in sp.tied.items()))
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
    sched = make_schedule(plan.pipeline_schedule, rp.stages, rp.micro_batches, plan.pipeline_chunks)
    sp = split(trace, rp, cluster.gpu if cluster is not None else None, starts=starts)
    mine = set(sched.chunks_of(rp.stage_of(rank)))
    chunks = [
        lower_flat(st.graph, rp, cluster, groups, rank, device=device, prefetch=prefetch or DEFAULT_DISTANCES,
                 costs=costs, need_graph=c in mine, disable=disable, log=log if c in mine else None)
        for c, st in enumerate(sp.stages)
    ]
    _check_tied_layouts(sp, chunks)
    return LoweredPipeline(rp, sp, sched, chunks, rank, cluster)


def _check_tied_layouts(sp: PipelineSplit, chunks: list[LoweredFlat]) -> None:
    """A tied parameter's partial gradients are summed piece by piece at the boundary: every chunk
    holding it must shard it alike (refused here, before any collective)."""
    for name, holders in sp.tied.items():
        spans = set()
        for c in holders:
            layout, slot = next((ly, s) for ly in chunks[c].program.layouts for s in ly.slots if s.name == name)
            spans.add(tuple(layout.local_range(slot, r) for r in range(layout.partition_size)))
        if len(spans) > 1:
            raise PlanError(f"tied parameter {name} is sharded differently in chunks {list(holders)} (it shares "
                            "a bucket with other parameters); leave bucket_bytes unset so that it has a bucket of its own")


def _halves(program: Program) -> tuple[Program, Program, Program]:
    """(forward, backward, boundary) of a chunk's Program, each runnable by the simulator alone."""
    one = dataclasses.replace(program.plan, plan=program.plan.plan.replace(micro_batches=1))
    acts = program.micro_step
    cut = backward_start(acts)
    cut = len(acts) if cut is None else cut

    def part(micro, boundary):
        return dataclasses.replace(program, plan=one, micro_step=micro, boundary=boundary)

    return part(acts[:cut], []), part(acts[cut:], []), part([], program.boundary)


def _carried_bytes(forward: Program) -> int:
    """What a chunk's forward leaves live for its backward (saved activations and the outputs it
    sends): the live bytes after its last computation, not its transient peak (gathered weights,
    attention scores), which it frees before the next micro-batch."""
    last = next((a for a in reversed(forward.micro_step) if a.kind is Kind.COMPUTE), None)
    return max(int(last.activation_bytes), 0) if last is not None else 0


def chunk_in_flight(sched: PipeSchedule) -> list[int]:
    """Per chunk: the most micro-batches whose forward ran and backward did not (saved activations)."""
    most = [0] * (sched.stages * sched.chunks)
    for actions in sched.ranks:
        live = [0] * len(most)
        for a in actions:
            if a.op is Op.FORWARD:
                live[a.chunk] += 1
                most[a.chunk] = max(most[a.chunk], live[a.chunk])
            elif a.op is Op.BACKWARD:
                live[a.chunk] -= 1
    return most


def simulate_pipeline(pp: LoweredPipeline, cluster: Cluster, *, record: bool = True, **costs) -> Prediction:
    """One optimizer step of the pipeline on ``cluster`` (see the module docstring). ``exposed_comm_s``
    is the busiest rank's communication not hidden behind its compute (bubbles are
    ``bubble_fraction``). ``record``: keep every stage's forward and backward spans as events (one
    track per stage: what the timeline picture draws)."""
    rp, sp, sched = pp.plan, pp.split, pp.schedule
    m = rp.micro_batches
    fwd, bwd, edge, exposed, static, acts, saved = [], [], [], [], [], [], []
    halves: dict[int, tuple] = {}  # chunks of one shape share their Program (mc.autotune): priced once
    for c in range(len(pp.chunks)):
        program = pp.program(c)
        if id(program) not in halves:
            f_half, b_half, boundary = _halves(program)
            f = simulate_program(f_half, cluster, record=False, accumulate=False, **costs)
            b, e = (simulate_program(h, cluster, record=False, **costs) for h in (b_half, boundary))
            halves[id(program)] = f, b, e, _carried_bytes(f_half)
        f, b, e, carried = halves[id(program)]
        fwd.append(f.step_time_s)
        bwd.append(b.step_time_s)
        edge.append(e.step_time_s)
        exposed.append(m * (f.exposed_comm_s + b.exposed_comm_s) + e.step_time_s)
        static.append(f.static_memory_bytes)
        acts.append((f.peak_memory_bytes - f.static_memory_bytes, b.peak_memory_bytes - b.static_memory_bytes))
        saved.append(carried)
    # the activations of one micro-batch crossing a cut, t chains sharing the node link when it crosses nodes
    first, k = rp.pipe_ranks(0), rp.gpus_per_node
    hops = []
    for c, st in enumerate(sp.stages[:-1]):
        a, b = first[c % rp.stages], first[(c + 1) % rp.stages]
        chains = rp.partition_size if a // k != b // k else 1
        hops.append(collective_time_s(P2P, sum(t.nbytes for t in st.send_act) * chains, [a, b], cluster))
    timeline = sched.simulate(fwd, bwd, max(hops, default=0.0))
    in_flight = chunk_in_flight(sched)
    ranks = [sched.chunks_of(r) for r in range(rp.stages)]
    # a chunk keeps what its forward saved for each micro-batch in flight; its backward's peak on top of one
    peaks = [sum(static[c] + (in_flight[c] - 1) * saved[c] for c in cs) + max(max(acts[c]) for c in cs)
             for cs in ranks]
    compute = [sum(m * (fwd[c] + bwd[c]) for c in cs) for cs in ranks]
    flops = sum(a.flops for c in range(len(pp.chunks)) for a in pp.program(c).micro_step)
    pred = Prediction(
        step_time_s=timeline.makespan_s + max(sum(edge[c] for c in cs) for cs in ranks),
        compute_s=max(compute), exposed_comm_s=max(sum(exposed[c] for c in cs) for cs in ranks),
        stream_busy_s={"compute": max(compute)}, peak_memory_bytes=int(max(peaks)),
        static_memory_bytes=int(max(sum(static[c] for c in cs) for cs in ranks)),
        flops_per_step=m * flops / rp.stages, world_size=rp.world_size,
    )
    pred.bubble_fraction = timeline.bubble_fraction
    if record:
        pred.events = [Event(f"stage {r}", str(a), start, end)
                       for r, spans in enumerate(timeline.spans) for a, start, end in spans]
    return pred
