"""Pricing a pipeline (MiCS-Pipe): its chunks' Programs, split into forward and backward halves
and simulated, placed on the pipeline schedule IR's event simulation (docs/design.md#glossary-and-formulas)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from micscompile.core.pipeline_schedule import Op, PipeSchedule
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Kind, Program, backward_start
from micscompile.cost_model.collective_time import P2P, collective_time_s
from micscompile.cost_model.simulator import Event, Prediction, simulate_program
from micscompile.cost_model.specs import Cluster


def halves(program: Program) -> tuple[Program, Program, Program]:
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


def simulate_pipeline(rp: ResolvedPlan, sched: PipeSchedule, programs: Sequence[Program], sent_bytes: Sequence[int],
                      cluster: Cluster, *, record: bool = True, **costs) -> Prediction:
    """One optimizer step of a pipeline on ``cluster``: each chunk's forward and backward are its
    Program's two halves simulated (gathers and reduce-scatters inside them), the schedule's event
    simulation adds the bubbles and the P2P hops (``sent_bytes``: the activations chunk c sends per
    micro-batch), and the boundary (replication and tied-weight all-reduces, optimizer) follows.
    ``exposed_comm_s`` is the busiest rank's communication not hidden behind its compute (bubbles
    are ``bubble_fraction``). ``record``: keep every stage's forward and backward spans as events
    (one track per stage: what the timeline picture draws)."""
    m = rp.micro_batches
    fwd, bwd, edge, exposed, static, acts, saved = [], [], [], [], [], [], []
    priced: dict[int, tuple] = {}  # chunks of one shape share their Program (mc.autotune): priced once
    for program in programs:
        if id(program) not in priced:
            f_half, b_half, boundary = halves(program)
            f = simulate_program(f_half, cluster, record=False, accumulate=False, **costs)
            b, e = (simulate_program(h, cluster, record=False, **costs) for h in (b_half, boundary))
            priced[id(program)] = f, b, e, _carried_bytes(f_half)
        f, b, e, carried = priced[id(program)]
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
    for c, nbytes in enumerate(sent_bytes[:-1]):
        a, b = first[c % rp.stages], first[(c + 1) % rp.stages]
        chains = rp.partition_size if a // k != b // k else 1
        hops.append(collective_time_s(P2P, nbytes * chains, [a, b], cluster))
    timeline = sched.simulate(fwd, bwd, max(hops, default=0.0))
    in_flight = chunk_in_flight(sched)
    ranks = [sched.chunks_of(r) for r in range(rp.stages)]
    # a chunk keeps what its forward saved for each micro-batch in flight; its backward's peak on top of one
    peaks = [sum(static[c] + (in_flight[c] - 1) * saved[c] for c in cs) + max(max(acts[c]) for c in cs)
             for cs in ranks]
    compute = [sum(m * (fwd[c] + bwd[c]) for c in cs) for cs in ranks]
    flops = sum(a.flops for program in programs for a in program.micro_step)
    pred = Prediction(
        step_time_s=timeline.makespan_s + max(sum(edge[c] for c in cs) for cs in ranks),
        compute_s=max(compute), exposed_comm_s=max(sum(exposed[c] for c in cs) for cs in ranks),
        stream_busy_s={"compute": max(compute)}, peak_memory_bytes=int(max(peaks)),
        static_memory_bytes=int(max(sum(static[c] for c in cs) for cs in ranks)),
        flops_per_step=m * flops / rp.stages, world_size=rp.world_size, uncertainty=cluster.prediction_error,
    )
    pred.bubble_fraction = timeline.bubble_fraction
    if record:
        pred.events = [Event(f"stage {r}", str(a), start, end)
                       for r, spans in enumerate(timeline.spans) for a, start, end in spans]
    return pred
