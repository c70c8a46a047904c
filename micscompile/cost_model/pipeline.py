"""Pricing a pipeline (MiCS-Pipe): its chunks' Programs, split into forward and backward halves
and simulated, placed on the pipeline schedule IR's event simulation (docs/design.md#glossary-and-formulas)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from micscompile.core.pipeline_schedule import (
    Op,
    PipeAction,
    PipeSchedule,
    Timeline,
    chunk_rank,
    make_schedule,
    zero_bubble_order,
)
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Kind, Program, backward_start
from micscompile.cost_model.collective_time import ALL_GATHER, P2P, collective_time_s
from micscompile.cost_model.simulator import MICSCOMPILE_RUNTIME, Event, Prediction, simulate_program
from micscompile.cost_model.specs import Cluster, default_cluster


def halves(program: Program) -> tuple[Program, Program, Program, Program | None]:
    """(forward, backward, boundary, W) of a chunk's Program, each runnable by the simulator alone; W is
    a zero-bubble chunk's weight-gradient phase (its actions marked ``weight``; the backward is then B
    alone), else None. The backward half (W where split) holds the second hops (2-hop over d > 1
    replicas) that the chunk's last backward starts; the boundary does not wait for them
    (``simulate_pipeline`` places them). Each half is one micro-batch of one chunk: its plan says so
    (m = 1, one chunk), which the pipeline's own schedule may not allow (interleaved needs m % S == 0),
    so the half's plan is a plain 1F1B one."""
    one = dataclasses.replace(program.plan, plan=program.plan.plan.replace(
        micro_batches=1, pipeline_chunks=None, pipeline_schedule="1f1b"))
    acts = program.micro_step
    cut = backward_start(acts)
    cut = len(acts) if cut is None else cut

    def part(micro, boundary):
        return dataclasses.replace(program, plan=one, micro_step=micro, boundary=boundary)

    weight = [a for a in acts[cut:] if a.weight]
    back = [a for a in acts[cut:] if not a.weight] if weight else acts[cut:]
    return (part(acts[:cut], []), part(back, []), part([], program.without_second_hops().boundary),
            part(weight, []) if weight else None)


def _carried_bytes(forward: Program) -> int:
    """What a chunk's forward leaves live for its backward (saved activations and the outputs it
    sends): the live bytes after its last computation, not its transient peak (gathered weights,
    attention scores), which it frees before the next micro-batch."""
    last = next((a for a in reversed(forward.micro_step) if a.kind is Kind.COMPUTE), None)
    return max(int(last.activation_bytes), 0) if last is not None else 0


class ChunkPrice(NamedTuple):
    """A chunk's Program priced phase by phase (``halves``), one micro-batch each."""

    forward: Prediction
    backward: Prediction
    """B alone where the backward is split."""
    boundary: Prediction
    last: Prediction | None
    """The phase that starts the second hops (W where split), simulated with them; None without any."""
    weight: Prediction | None
    saved: int
    """What the forward leaves live for the backward (``_carried_bytes``)."""
    w_saved: int
    """Where split: what B leaves live for W (all the forward saved where B computes nothing, a first chunk's)."""
    flops: int
    """One micro-batch's FLOPs (what TFLOP/s counts)."""


def price_chunk(program: Program, cluster: Cluster, **costs) -> ChunkPrice:
    f_half, b_half, boundary, w_half = halves(program)
    f = simulate_program(f_half, cluster, record=False, accumulate=False, **costs)
    # (the gradients' accumulation is priced in the phase that accumulates them: W where split)
    b = simulate_program(b_half.without_second_hops(), cluster, record=False, accumulate=w_half is None, **costs)
    e = simulate_program(boundary, cluster, record=False, **costs)
    w = simulate_program(w_half.without_second_hops(), cluster, record=False, **costs) if w_half else None
    ends = w_half or b_half
    last = simulate_program(ends, cluster, record=False, **costs) if any(
        a.kind is Kind.SECOND_HOP for a in ends.micro_step) else None
    saved = _carried_bytes(f_half)
    w_saved = (_carried_bytes(b_half) if any(a.kind is Kind.COMPUTE for a in b_half.micro_step) else saved) \
        if w_half else 0
    return ChunkPrice(f, b, e, last, w, saved, w_saved, sum(int(a.flops) for a in program.micro_step))


def _memory(prices: Sequence[ChunkPrice]) -> tuple[list, list, list, list, list]:
    """Per chunk: (static bytes, saved, W's saved, (forward's, backward's) activation peak, W's peak)."""
    def act(p: Prediction | None) -> int:
        return p.peak_memory_bytes - p.static_memory_bytes if p else 0
    return ([p.forward.static_memory_bytes for p in prices], [p.saved for p in prices], [p.w_saved for p in prices],
            [(act(p.forward), act(p.backward)) for p in prices], [act(p.weight) for p in prices])


def _rank_peak(sched: PipeSchedule, r: int, mem: tuple) -> int:
    """Rank ``r``'s planned peak: its chunks' static bytes and activations. 1F1B-like schedules: (in flight - 1)
    saved micro-batches per chunk under the largest phase's peak; a zero-bubble one walked (``_walked_peak``)."""
    static, saved, w_saved, acts, w_acts = mem
    cs = sched.chunks_of(r)
    if sched.split_backward:
        return sum(static[c] for c in cs) + _walked_peak(sched.ranks[r], mem)
    in_flight = sched.chunk_in_flight
    return sum(static[c] + (in_flight[c] - 1) * saved[c] for c in cs) + max(max(acts[c]) for c in cs)


def pipeline_peak_bytes(sched: PipeSchedule, prices: Sequence[ChunkPrice]) -> int:
    """The busiest rank's planned peak (``_rank_peak``) of ``sched`` over chunks priced ``prices``: what
    ``simulate_pipeline`` reports, without its timeline (``mc.autotune`` rules out a pipeline that does not fit
    before simulating it)."""
    return _peak(sched, _memory(prices))


def _peak(sched: PipeSchedule, mem: tuple) -> int:
    return int(max(_rank_peak(sched, r, mem) for r in range(sched.stages)))


def chunk_prices(programs: Sequence[Program], priced: dict[int, ChunkPrice], cluster: Cluster, costs: dict) -> list:
    """Each chunk's ``price_chunk``, once per Program (chunks of one shape share theirs in mc.autotune); ``priced``
    keeps them by the Program's id for a later call on the same cluster and costs."""
    for p in programs:
        if id(p) not in priced:
            priced[id(p)] = price_chunk(p, cluster, **costs)
    return [priced[id(p)] for p in programs]


def memory_neutral(rp: ResolvedPlan, sched: PipeSchedule, programs: Sequence[Program], cluster: Cluster | None, *,
                   priced: dict[int, ChunkPrice] | None = None, nccl: bool = True, **costs) -> PipeSchedule:
    """The schedule ``rp`` runs on its lowered chunks: ``sched``, but for ZB-H1 as the paper defines it, zero bubble
    at 1F1B's peak memory. Each rank defers as many W's as the torch.distributed.pipelining order does (rank r:
    r), fewer where the W's it holds (their inputs and the output gradients B computed for them,
    ``ChunkPrice.w_saved``) would lift the pipeline's peak above 1F1B's on the same chunks (priced as
    ``simulate_pipeline`` prices both, on ``cluster``: without one, this machine's estimate; any prices the
    bytes). ``priced``: the chunks' prices, kept for ``simulate_pipeline`` on the same cluster and costs. ``nccl``:
    the schedule's receives posted as the runtime needs them (``make_schedule``), else its timeline only."""
    if rp.plan.pipeline_schedule != "zb-h1":
        return sched
    S, m = rp.stages, rp.micro_batches  # (v = 1: ZB-H1 runs one chunk per rank)
    cluster = cluster or default_cluster("cpu", "", rp.world_size, rp.gpus_per_node)
    mem = _memory(chunk_prices(programs, {} if priced is None else priced, cluster, costs))
    ref = make_schedule("1f1b", S, m, nccl=False)  # (its memory)
    budget = max(_rank_peak(ref, r, mem) for r in range(S))
    static = mem[0]

    def peak(r: int, d: int) -> int:
        return sum(static[c] for c in ref.chunks_of(r)) + _walked_peak(_zb_h1_order(S, m, r, d), mem)

    deferred = []
    for r in range(S):
        d = r
        while d > 0 and peak(r, d) > budget:
            d -= 1
        deferred.append(d)
    return make_schedule("zb-h1", S, m, 1, tuple(deferred), nccl)


@functools.lru_cache(maxsize=4096)
def _zb_h1_order(S: int, m: int, r: int, d: int) -> tuple[PipeAction, ...]:
    """Rank ``r``'s compute order under ZB-H1 deferring ``d`` W's (cached: every ZB-H1 candidate of ``mc.autotune``
    with these S and m walks it)."""
    return tuple(PipeAction(op, mb, c) for op, mb, c in zero_bubble_order(S, m, 1, r, d))


def _walked_peak(actions: tuple[PipeAction, ...], mem: tuple) -> int:
    """A zero-bubble rank's activation peak over its schedule: each F adds what its chunk saves (its own
    peak on top while it runs), each B trades that for what W reads (its peak counted with its micro-batch's
    saved values, as a backward's is), each W frees that (likewise). At v = 1 a 1F1B schedule walked so gives
    ``simulate_pipeline``'s formula: (in flight - 1) saved micro-batches under the largest phase's peak.
    Walked in numpy over the rank's computes (``_computes``): the live bytes before each are a running sum."""
    _, saved, w_saved, acts, w_acts = mem
    op, chunk = _computes(actions)
    if not len(op):
        return 0
    s, ws = np.asarray(saved, dtype=np.int64)[chunk], np.asarray(w_saved, dtype=np.int64)[chunk]
    a = np.asarray(acts, dtype=np.int64).reshape(-1, 2)[chunk]
    wa = np.asarray(w_acts, dtype=np.int64)[chunk]
    forward, backward = op == 0, op == 1
    delta = np.where(forward, s, np.where(backward, ws - s, -ws))  # (what each leaves live)
    top = np.where(forward, a[:, 0], np.where(backward, a[:, 1] - s, wa - ws))  # (its peak over what was live)
    return int(max(0, (np.cumsum(delta) - delta + top).max()))


_COMPUTES: dict[int, tuple] = {}
"""``_computes``'s encodings by the id of the action tuple they encode (kept with it, so the id stays its own)."""


def _computes(actions: tuple[PipeAction, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(phase: 0 F, 1 B, 2 W; chunk) of each compute of ``actions``, in order (cached: a schedule's ranks and
    ZB-H1's orders are walked by every candidate of their shape)."""
    got = _COMPUTES.get(id(actions))
    if got is None or got[0] is not actions:
        if len(_COMPUTES) > 8192:
            _COMPUTES.clear()
        phase = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.WEIGHT: 2}
        mine = [(phase[a.op], a.chunk) for a in actions if a.op in phase]
        got = _COMPUTES[id(actions)] = (actions, np.array([p for p, _ in mine], dtype=np.int8),
                                        np.array([c for _, c in mine], dtype=np.int64))
    return got[1], got[2]


def pipeline_floor_s(stages: int, micro_batches: int, forward_s: Sequence[float], backward_s: Sequence[float], *,
                     split_backward: bool, v_shape: bool = False, hops_s: Sequence[float] | None = None) -> float:
    """A lower bound of the makespan of every schedule of ``make_schedule`` over chunks whose forward takes at least
    ``forward_s[c]`` and whose backward (B and W where split) at least ``backward_s[c]``. Each rank runs its
    actions one after another and each chunk's micro-batches in order, so rank r, whose lowest chunk is c0, starts
    after the first micro-batch's forward through the chunks below c0 and then runs all its work; unsplit, the
    last micro-batch's backward of c0 follows all of that work (every other action of the rank precedes it: in
    order, or through the last micro-batch's chain down the rank's higher chunks), and its backward through the
    chunks below c0 follows it. (Where split, a W may run after it: the first bound only.)
    ``hops_s``: at least how long each chunk's second hops hold the rank's links. The rank's last action is the last
    backward (W where split) of one of its chunks, c, whose hops start with it and end no sooner than ``hops_s[c]``
    later; it starts after all the rank's other work, which takes at least the rank's work less c's backward of one
    micro-batch; c unknown, the least over the rank's chunks."""
    n, m = len(forward_s), micro_batches
    rank = [chunk_rank(c, stages, v_shape) for c in range(n)]
    floor = 0.0
    for r in range(stages):
        mine = [c for c in range(n) if rank[c] == r]
        c0 = min(mine)
        work = m * sum(forward_s[c] + backward_s[c] for c in mine)
        floor = max(floor, sum(forward_s[:c0]) + work + (0.0 if split_backward else sum(backward_s[:c0])))
        if hops_s is not None:
            floor = max(floor, sum(forward_s[:c0]) + work + min(hops_s[c] - backward_s[c] for c in mine))
    return floor


def second_hops_end_s(timeline: Timeline, ranks: Sequence[Sequence[int]], ender: Op, hop_end: Sequence[float],
                      hop_busy: Sequence[float], *, after_schedule: bool = False,
                      events: list[Event] | None = None) -> list[float]:
    """When each rank's second hops end on ``timeline`` (``ranks``: each rank's chunks): chunk by chunk as their last
    ``ender`` starts (the phase a chunk's gradients are complete in: B, or W where split; ``after_schedule``: once
    the rank's whole schedule has ended), one after another on the rank's links, chunk c's ending ``hop_end[c]``
    after its start at the earliest and holding the links ``hop_busy[c]``. The end is monotone in the timeline's
    starts and the two times (a serial machine's jobs in release order), so floors in give a floor out.
    ``events``: each chunk's span appended."""
    out = []
    for r, spans in enumerate(timeline.spans):
        last_start = {a.chunk: start for a, start, _ in spans if a.op is ender}  # (the last one wins)
        if after_schedule:
            done = max((end for _, _, end in spans), default=0.0)
            last_start = dict.fromkeys(last_start, done)
        free = 0.0
        for c in sorted((c for c in ranks[r] if hop_busy[c]), key=last_start.__getitem__):
            start = max(last_start[c], free)
            free = max(last_start[c] + hop_end[c], free + hop_busy[c])
            if events is not None:
                events.append(Event(f"stage {r} replicate", f"second hop chunk {c}", start, free))
        out.append(free)
    return out


def simulate_pipeline(rp: ResolvedPlan, sched: PipeSchedule, programs: Sequence[Program], sent_bytes: Sequence[int],
                      cluster: Cluster, *, record: bool = True, gathered_bytes: Sequence[int] = (),
                      priced: dict[int, ChunkPrice] | None = None, **costs) -> Prediction:
    """One optimizer step of a pipeline on ``cluster``: each chunk's forward and backward are its
    Program's two halves simulated (gathers and reduce-scatters inside them), the schedule's event
    simulation adds the bubbles and the P2P hops (``sent_bytes``: the activations one rank of chunk c sends
    per micro-batch; ``gathered_bytes``: of them, the whole bytes its peer's tensor group all-gathers after a
    scattered send, ``pipeline_split.Transfer.pieces``). A chunk's second hops (its buckets' all-reduces over
    the replicas) start in its last backward and run on the rank's replication stream, one chunk's after
    another's, under the rest of the schedule; the boundary (loss all-reduce, optimizer) follows once every
    rank's compute and this rank's second hops are done. ``exposed_comm_s`` is the busiest rank's communication not hidden
    behind its compute (bubbles are ``bubble_fraction``). ``record``: keep every stage's forward and
    backward spans, and its second hops, as events (what the timeline picture and trace draw).
    ``costs["runtime"].grad_sync_after_backward``: a rank's second hops start once its last backward has ended
    (Megatron-LM's data-parallel all-reduce after the whole pipeline schedule), not as each chunk's last backward
    starts (the chunks are priced without it: the schedule places them).
    ``priced``: the chunks' prices already made on this cluster with these costs (``memory_neutral``'s)."""
    m = rp.micro_batches
    runtime = costs.get("runtime", MICSCOMPILE_RUNTIME)
    grad_sync_after_backward = runtime.grad_sync_after_backward
    if grad_sync_after_backward:
        costs = {**costs, "runtime": dataclasses.replace(runtime, grad_sync_after_backward=False)}
    fwd, bwd, wgt, edge, exposed, hop_end, hop_busy = [], [], [], [], [], [], []
    prices = chunk_prices(programs, {} if priced is None else priced, cluster, costs)
    for p in prices:
        w = p.weight
        fwd.append(p.forward.step_time_s)
        bwd.append(p.backward.step_time_s)
        wgt.append(w.step_time_s if w else 0.0)
        edge.append(p.boundary)
        exposed.append(m * (p.forward.exposed_comm_s + p.backward.exposed_comm_s + (w.exposed_comm_s if w else 0.0))
                       + p.boundary.exposed_comm_s)
        # the last backward (W) with its second hops: when they end (from its start), how long they hold the links
        hop_end.append(p.last.step_time_s if p.last else 0.0)
        hop_busy.append(p.last.stream_busy_s.get("comm:replicate", 0.0) if p.last else 0.0)
    mem = _memory(prices)
    static = mem[0]
    # the activations of one micro-batch crossing a cut, the p * tp ranks of a stage sharing the node link when
    # it crosses nodes; a scattered one then all-gathered inside the receiving tensor group
    first, k = rp.pipe_ranks(0), rp.gpus_per_node
    hops = []
    for c, nbytes in enumerate(sent_bytes[:-1]):
        if sched.rank_of(c) == sched.rank_of(c + 1):  # (ZB-V's turn: handed over on one rank)
            hops.append(0.0)
            continue
        a, b = first[sched.rank_of(c)], first[sched.rank_of(c + 1)]
        ranks = rp.partition_size * rp.tensor if a // k != b // k else 1
        hop = collective_time_s(P2P, nbytes * ranks, [a, b], cluster)
        if c < len(gathered_bytes) and gathered_bytes[c]:
            hop += collective_time_s(ALL_GATHER, gathered_bytes[c], list(rp.tensor_ranks(b)), cluster)
        hops.append(hop)
    split = sched.split_backward
    timeline = sched.simulate(fwd, bwd, max(hops, default=0.0), wgt if split else None)
    makespan = timeline.makespan_s
    ranks = [sched.chunks_of(r) for r in range(rp.stages)]
    events = []
    if grad_sync_after_backward:  # (nothing left to overlap: each takes its busy time)
        hop_end = list(hop_busy)
    replicated = second_hops_end_s(timeline, ranks, Op.WEIGHT if split else Op.BACKWARD, hop_end, hop_busy,
                                   after_schedule=grad_sync_after_backward, events=events)
    # a rank's boundary: its second hops and the loss all-reduce (every rank's compute) done, then the rest
    ends = [max(makespan, replicated[r]) + sum(edge[c].step_time_s for c in cs) for r, cs in enumerate(ranks)]
    waits = [max(0.0, replicated[r] - makespan) for r in range(rp.stages)]
    compute = [sum(m * (fwd[c] + bwd[c] + wgt[c]) for c in cs) for cs in ranks]
    flops = sum(p.flops for p in prices)
    busy = {"compute": max(compute)}
    if any(hop_busy):
        busy["comm:replicate"] = max(sum(hop_busy[c] for c in cs) for cs in ranks)
    pred = Prediction(
        step_time_s=max(ends), compute_s=max(compute),
        exposed_comm_s=max(sum(exposed[c] for c in cs) + waits[r] for r, cs in enumerate(ranks)),
        stream_busy_s=busy, peak_memory_bytes=_peak(sched, mem),  # (each micro-batch in flight keeps what it saved)
        static_memory_bytes=int(max(sum(static[c] for c in cs) for cs in ranks)),
        flops_per_step=m * flops / rp.stages, world_size=rp.world_size, uncertainty=cluster.prediction_error,
        exposed_boundary_s=max(waits[r] + sum(edge[c].exposed_boundary_s for c in cs) for r, cs in enumerate(ranks)),
    )
    pred.bubble_fraction = timeline.bubble_fraction
    if record:
        pred.events = [Event(f"stage {r}", str(a), start, end)
                       for r, spans in enumerate(timeline.spans) for a, start, end in spans] + events
    return pred
