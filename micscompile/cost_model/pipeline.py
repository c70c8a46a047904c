"""Pricing a pipeline (MiCS-Pipe): its chunks' Programs, split into forward and backward halves
and simulated, placed on the pipeline schedule IR's event simulation (docs/design.md#glossary-and-formulas)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from micscompile.core.pipeline_schedule import Op, PipeSchedule
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Kind, Program, backward_start
from micscompile.cost_model.collective_time import ALL_GATHER, P2P, collective_time_s
from micscompile.cost_model.simulator import Event, Prediction, simulate_program
from micscompile.cost_model.specs import Cluster


def halves(program: Program) -> tuple[Program, Program, Program, Program | None]:
    """(forward, backward, boundary, W) of a chunk's Program, each runnable by the simulator alone; W is
    a zero-bubble chunk's weight-gradient phase (its actions marked ``weight``; the backward is then B
    alone), else None. The backward half (W where split) holds the second hops (2-hop over d > 1
    replicas) that the chunk's last backward starts; the boundary does not wait for them
    (``simulate_pipeline`` places them). Each half is one micro-batch of one chunk: its plan says so
    (m = 1, one chunk), which the pipeline's own schedule may not allow (interleaved needs m % S == 0),
    so the half's plan is a plain 1F1B one."""
    one = dataclasses.replace(program.plan, plan=program.plan.plan.replace(
        micro_batches=1, pipeline_chunks=1, pipeline_schedule="1f1b"))
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


def _walked_peak(actions, saved, w_saved, acts, w_acts) -> int:
    """A zero-bubble rank's activation peak over its schedule: each F adds what its chunk saves (its own
    peak on top while it runs), each B trades that for what W reads (its peak counted with its micro-batch's
    saved values, as a backward's is), each W frees that (likewise). At v = 1 a 1F1B schedule walked so gives
    ``simulate_pipeline``'s formula: (in flight - 1) saved micro-batches under the largest phase's peak."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            peak, live = max(peak, live + acts[a.chunk][0]), live + saved[a.chunk]
        elif a.op is Op.BACKWARD:
            peak = max(peak, live - saved[a.chunk] + acts[a.chunk][1])
            live += w_saved[a.chunk] - saved[a.chunk]
        elif a.op is Op.WEIGHT:
            peak, live = max(peak, live - w_saved[a.chunk] + w_acts[a.chunk]), live - w_saved[a.chunk]
    return peak


def simulate_pipeline(rp: ResolvedPlan, sched: PipeSchedule, programs: Sequence[Program], sent_bytes: Sequence[int],
                      cluster: Cluster, *, record: bool = True, gathered_bytes: Sequence[int] = (),
                      grad_sync_after_backward: bool = False, **costs) -> Prediction:
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
    ``grad_sync_after_backward``: a rank's second hops start once its last backward has ended (Megatron-LM's
    data-parallel all-reduce after the whole pipeline schedule), not as each chunk's last backward starts."""
    m = rp.micro_batches
    fwd, bwd, wgt, edge, exposed, static, acts, saved, hop_end, hop_busy = [], [], [], [], [], [], [], [], [], []
    w_saved, w_acts = [], []
    priced: dict[int, tuple] = {}  # chunks of one shape share their Program (mc.autotune): priced once
    for program in programs:
        if id(program) not in priced:
            f_half, b_half, boundary, w_half = halves(program)
            f = simulate_program(f_half, cluster, record=False, accumulate=False, **costs)
            # (the gradients' accumulation is priced in the phase that accumulates them: W where split)
            b = simulate_program(b_half.without_second_hops(), cluster, record=False, accumulate=w_half is None, **costs)
            e = simulate_program(boundary, cluster, record=False, **costs)
            w = simulate_program(w_half.without_second_hops(), cluster, record=False, **costs) if w_half else None
            ends = w_half or b_half  # (the phase whose last run starts the second hops)
            has_hops = any(a.kind is Kind.SECOND_HOP for a in ends.micro_step)
            last = simulate_program(ends, cluster, record=False, **costs) if has_hops else None
            carried = _carried_bytes(f_half)
            # what W reads waits from B to W (all the forward saved, where B computes nothing: a first chunk's)
            w_carried = (_carried_bytes(b_half) if any(a.kind is Kind.COMPUTE for a in b_half.micro_step)
                         else carried) if w_half else 0
            priced[id(program)] = f, b, e, last, carried, w, w_carried
        f, b, e, last, carried, w, w_carried = priced[id(program)]
        fwd.append(f.step_time_s)
        bwd.append(b.step_time_s)
        wgt.append(w.step_time_s if w else 0.0)
        edge.append(e)
        exposed.append(m * (f.exposed_comm_s + b.exposed_comm_s + (w.exposed_comm_s if w else 0.0))
                       + e.exposed_comm_s)
        # the last backward (W) with its second hops: when they end (from its start), how long they hold the links
        hop_end.append(last.step_time_s if last else 0.0)
        hop_busy.append(last.stream_busy_s.get("comm:replicate", 0.0) if last else 0.0)
        static.append(f.static_memory_bytes)
        acts.append((f.peak_memory_bytes - f.static_memory_bytes, b.peak_memory_bytes - b.static_memory_bytes))
        saved.append(carried)
        w_saved.append(w_carried)
        w_acts.append(w.peak_memory_bytes - w.static_memory_bytes if w else 0)
    # the activations of one micro-batch crossing a cut, the p * tp ranks of a stage sharing the node link when
    # it crosses nodes; a scattered one then all-gathered inside the receiving tensor group
    first, k = rp.pipe_ranks(0), rp.gpus_per_node
    hops = []
    for c, nbytes in enumerate(sent_bytes[:-1]):
        a, b = first[c % rp.stages], first[(c + 1) % rp.stages]
        ranks = rp.partition_size * rp.tensor if a // k != b // k else 1
        hop = collective_time_s(P2P, nbytes * ranks, [a, b], cluster)
        if c < len(gathered_bytes) and gathered_bytes[c]:
            hop += collective_time_s(ALL_GATHER, gathered_bytes[c], list(rp.tensor_ranks(b)), cluster)
        hops.append(hop)
    split = sched.split_backward
    timeline = sched.simulate(fwd, bwd, max(hops, default=0.0), wgt if split else None)
    makespan = timeline.makespan_s
    in_flight = chunk_in_flight(sched)
    ranks = [sched.chunks_of(r) for r in range(rp.stages)]
    # each rank's second hops, chunk by chunk as their last backwards start, one after another on its links
    replicated, events = [], []
    if grad_sync_after_backward:  # (nothing left to overlap: each takes its busy time)
        hop_end = list(hop_busy)
    for r, spans in enumerate(timeline.spans):
        ender = Op.WEIGHT if split else Op.BACKWARD
        last_start = {a.chunk: start for a, start, _ in spans if a.op is ender}  # (the last one wins)
        free = 0.0
        if grad_sync_after_backward:  # every chunk's hops after the rank's whole schedule, one after another
            done = max((end for _, _, end in spans), default=0.0)
            last_start = dict.fromkeys(last_start, done)
        for c in sorted((c for c in ranks[r] if hop_busy[c]), key=last_start.__getitem__):
            start = max(last_start[c], free)
            free = max(last_start[c] + hop_end[c], free + hop_busy[c])
            events.append(Event(f"stage {r} replicate", f"second hop chunk {c}", start, free))
        replicated.append(free)
    # a rank's boundary: its second hops and the loss all-reduce (every rank's compute) done, then the rest
    ends = [max(makespan, replicated[r]) + sum(edge[c].step_time_s for c in cs) for r, cs in enumerate(ranks)]
    waits = [max(0.0, replicated[r] - makespan) for r in range(rp.stages)]
    # a chunk keeps what its forward saved for each micro-batch in flight; its backward's peak on top of one
    if split:  # walked: a micro-batch holds what its F saved until its B, then what W reads until its W
        peaks = [sum(static[c] for c in cs) + _walked_peak(sched.ranks[r], saved, w_saved, acts, w_acts)
                 for r, cs in enumerate(ranks)]
    else:
        peaks = [sum(static[c] + (in_flight[c] - 1) * saved[c] for c in cs) + max(max(acts[c]) for c in cs)
                 for cs in ranks]
    compute = [sum(m * (fwd[c] + bwd[c] + wgt[c]) for c in cs) for cs in ranks]
    flops = sum(a.flops for program in programs for a in program.micro_step)
    busy = {"compute": max(compute)}
    if any(hop_busy):
        busy["comm:replicate"] = max(sum(hop_busy[c] for c in cs) for cs in ranks)
    pred = Prediction(
        step_time_s=max(ends), compute_s=max(compute),
        exposed_comm_s=max(sum(exposed[c] for c in cs) + waits[r] for r, cs in enumerate(ranks)),
        stream_busy_s=busy, peak_memory_bytes=int(max(peaks)),
        static_memory_bytes=int(max(sum(static[c] for c in cs) for cs in ranks)),
        flops_per_step=m * flops / rp.stages, world_size=rp.world_size, uncertainty=cluster.prediction_error,
        exposed_boundary_s=max(waits[r] + sum(edge[c].exposed_boundary_s for c in cs) for r, cs in enumerate(ranks)),
    )
    pred.bubble_fraction = timeline.bubble_fraction
    if record:
        pred.events = [Event(f"stage {r}", str(a), start, end)
                       for r, spans in enumerate(timeline.spans) for a, start, end in spans] + events
    return pred
