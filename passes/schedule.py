"""schedule: how far ahead each gather is issued, chosen with the simulator under the budget.

A deeper prefetch hides more of a gather behind the compute before its use, and keeps
more gathered buckets live. The pass lowers the graph once with every gather at its
use (distance 0), derives the Program of each candidate distance (1: one use interval
ahead, FSDP's default; up to MAX_DISTANCE) by moving issues in it, prices each with
the event simulator on the cluster, and keeps the fastest whose peak of
gathered-parameter bytes fits ``Plan.memory_budget_bytes`` (ties: the shallower one),
searching from 1 deeper only while it helps; the graph is then lowered at the chosen
distance.
A budget below the smallest peak any distance reaches (distance 0: the largest use
interval's buckets) is refused with that minimum. Every rank runs the same
deterministic search on the same trace, so every rank picks the same Program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from micscompile.collectives import fmt_bytes
from micscompile.cost_model.simulator import simulate_program
from micscompile.cost_model.specs import Cluster
from micscompile.passes.context import CPU, PassContext, make_context
from micscompile.passes.manager import build_pass_list, run_passes
from micscompile.plan import PlanError, ResolvedPlan
from micscompile.program import Action, Kind, Program, build_program
from micscompile.trace import TrainGraph

MAX_DISTANCE = 4


@dataclass(frozen=True)
class Candidate:
    distance: int
    peak_gathered_bytes: int
    step_time_s: float | None
    """Simulated, when a cluster was given."""
    exposed_comm_s: float | None

    def __str__(self) -> str:
        timing = (f"  step {self.step_time_s * 1e3:9.3f} ms, exposed comm {self.exposed_comm_s * 1e3:9.3f} ms"
                  if self.step_time_s is not None else "")
        return f"prefetch {self.distance}: gathered peak {fmt_bytes(self.peak_gathered_bytes):>10}{timing}"


@dataclass(frozen=True)
class Schedule:
    program: Program
    candidates: tuple[Candidate, ...]
    distance: int
    ctx: PassContext | None = None
    graph: torch.fx.Graph | None = None
    """The rewritten graph of the chosen distance (None when only the Program was asked for)."""
    records: list | None = None


def with_prefetch(program: Program, distance: int) -> Program:
    """``program`` (lowered at distance 0: every gather issued right before its wait) with each
    gather issued ``distance`` use intervals ahead instead, exactly as insert_collectives places
    it: right after the wait of the gather ``distance`` before, the first ones before the first
    wait. Lowering once and moving issues is what keeps the search fast (~0.7 s per lowering at 175B)."""
    actions = list(program.micro_step)
    issues = [i for i, a in enumerate(actions) if a.kind is Kind.ALL_GATHER]
    if distance == 0 or not issues:
        return program
    moved = {i: actions[i] for i in issues}
    after: dict[int, Action] = {}  # index of a wait -> the issue that follows it
    before_first: list[Action] = []
    for k, i in enumerate(issues):
        if k == 0:
            continue  # already right before the first wait
        if k < distance:
            before_first.append(moved[i])
        else:
            after[issues[k - distance] + 1] = moved[i]  # the wait of gather k - distance
    out: list[Action] = []
    for i, a in enumerate(actions):
        if i in moved and i != issues[0]:
            continue
        out.append(a)
        if i == issues[0]:
            out += before_first
        if i in after:
            out.append(after[i])
    return dataclasses.replace(program, micro_step=out)


def schedule(
    trace: TrainGraph,
    rp: ResolvedPlan,
    cluster: Cluster | None,
    groups: dict,
    rank: int = 0,
    *,
    device: torch.device = CPU,
    distances: tuple[int, ...] | None = None,
    costs: dict | None = None,
    need_graph: bool = True,
    disable=(),
    log=None,
) -> Schedule:
    """Lower ``trace`` under ``rp`` at each prefetch distance and keep the best that fits the budget.

    The search starts at 1 (FSDP's one-ahead) and goes deeper while that fits the budget and
    the simulation says it is faster (without a cluster it stays at 1); 0 only when 1 does
    not fit. ``distances`` lists the candidates instead (e.g. ``(0,)``: no prefetch).
    ``costs`` go to ``simulate_program``. ``need_graph=False``: only the Program is wanted (no
    second lowering; ctx, graph and records are None).
    """
    budget = rp.plan.memory_budget_bytes
    if rp.partition_size == 1:
        distances = (0,)  # nothing is gathered
    searching = distances is None
    todo = [1] if searching else list(distances)
    # lower once at distance 0; other distances move the gathers' issues in the Program
    ctx0 = make_context(trace, rp, device, prefetch_distance=0)
    graph0, records0 = run_passes(trace.graph_copy(), ctx0, build_pass_list(rp.plan), disable=disable, log=log)
    base = build_program(graph0, rp, ctx0.layouts, groups, rank)
    base.cluster = cluster
    best, candidates = None, []
    while todo:
        d = todo.pop(0)
        program = with_prefetch(base, d)
        pred = simulate_program(program, cluster, record=False, **(costs or {})) if cluster is not None else None
        cand = Candidate(d, program.peak_gathered_bytes, pred and pred.step_time_s, pred and pred.exposed_comm_s)
        candidates.append(cand)
        fits = budget is None or cand.peak_gathered_bytes <= budget
        # strictly faster wins (ties keep the shallower); without a cluster the deeper of 0 and 1 that fits
        better = fits and (best is None or pred is None or pred.step_time_s < best[0].step_time_s)
        if better:
            best = (cand, program)
        if searching:  # 1, then deeper while it fits and (simulated) helps; 0 only if 1 does not fit
            if d >= 1 and better and pred is not None and pred.exposed_comm_s > 0 and d < MAX_DISTANCE:
                todo.append(d + 1)
            elif d == 1 and not fits:
                todo.append(0)
    if best is None:
        minimum = min(c.peak_gathered_bytes for c in candidates)
        raise PlanError(
            f"memory_budget_bytes={budget:,} is below {minimum:,} bytes ({fmt_bytes(minimum)}), the fewest "
            f"gathered-parameter bytes any schedule of this plan keeps live (largest bucket "
            f"{fmt_bytes(max(lay.full_bytes for lay in ctx0.layouts))}); raise the budget to at least "
            f"{minimum:,}, or lower bucket_bytes / raise partition_size"
        )
    cand, program = best
    if not need_graph:
        return Schedule(program, tuple(candidates), cand.distance)
    if cand.distance == 0:
        return Schedule(program, tuple(candidates), 0, ctx0, graph0, records0)
    ctx = make_context(trace, rp, device, prefetch_distance=cand.distance)
    graph, records = run_passes(trace.graph_copy(), ctx, build_pass_list(rp.plan), disable=disable)
    program = build_program(graph, rp, ctx.layouts, groups, rank)
    program.cluster = cluster
    return Schedule(program, tuple(candidates), cand.distance, ctx, graph, records)
