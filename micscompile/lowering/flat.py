"""schedule: where each gather goes, chosen with the simulator under the memory budget.

Three knobs (passes.context.Prefetch), the decisions FSDP's and DeepSpeed's runtime
hooks make on the fly, made once here:

* distance: issue each gather this many use intervals ahead (1: FSDP's default). Deeper
  hides more of a gather behind compute and keeps more buckets live and in flight.
* across micro-steps: the first gathers of micro-step i+1 are issued during the tail of
  micro-step i's backward instead of at its start.
* keep live: the buckets used last in forward keep their gather into backward (the
  thesis's liveness knob) instead of being gathered again.

The pass lowers the graph once with every gather at its use (distance 0), derives each
candidate's Program from it (``with_keep_live`` drops gathers, ``with_prefetch`` moves issues),
prices it with the event simulator on the cluster and keeps the fastest whose peak of
gathered-parameter bytes fits ``Plan.memory_budget_bytes`` (ties: the earlier,
cheaper one); the graph is then lowered with the choice. A budget below the smallest
peak any candidate reaches (distance 0: the largest use interval's buckets) is refused
with that minimum. Every rank runs the same deterministic search on the same trace,
so every rank picks the same Program.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from micscompile.core.collectives import CommStats, fmt_bytes
from micscompile.core.plan import PlanError, ResolvedPlan
from micscompile.core.program import REGION_BWD, Action, Kind, Prefetch, Program, ProgramError, backward_start
from micscompile.cost_model.collective_time import ALL_GATHER, collective_time_s, hierarchical_time_s
from micscompile.cost_model.simulator import Prediction, simulate_program
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.build import build_program
from micscompile.lowering.groups import planned_groups
from micscompile.memory.lifetimes import run_runtime_passes, step_buffers
from micscompile.memory.planner import Buffer
from micscompile.passes.context import CPU, PassContext, make_context
from micscompile.passes.insert_collectives import AFTER, CUT, FIRST, carried_gathers, issue_slot, keep_live_choice
from micscompile.passes.manager import build_pass_list, run_passes
from micscompile.trace import TrainGraph

MAX_DISTANCE = 4


def keep_live_counts(regathered: int) -> list[int]:
    """The ``Prefetch.keep_live`` counts the search prices: 1 to 4, then doubling, then all
    ``regathered`` buckets (where the gathers cannot hide, keeping every one live is what pays:
    DeepSpeed's ``stage3_max_live_parameters``); O(log n) simulations for n blocks."""
    counts = {k for k in (1, 2, 3, 4) if k <= regathered}
    k = 8
    while k < regathered:
        counts.add(k)
        k *= 2
    return sorted(counts | ({regathered} if regathered else set()))


@dataclass(frozen=True)
class PrefetchCandidate:
    prefetch: Prefetch
    peak_gathered_bytes: int
    step_time_s: float | None
    """Simulated, when a cluster was given."""
    exposed_comm_s: float | None

    def __str__(self) -> str:
        timing = (f"  step {self.step_time_s * 1e3:9.3f} ms, exposed comm {self.exposed_comm_s * 1e3:9.3f} ms"
                  if self.step_time_s is not None else "")
        return f"{self.prefetch!s:<40} gathered peak {fmt_bytes(self.peak_gathered_bytes):>10}{timing}"


@dataclass(frozen=True)
class LoweredFlat:
    """A flat plan lowered for one rank (``lowering.lowered.Lowered``): its Program, the prefetch
    candidates the search priced, and the rewritten graph the runtime runs."""

    program: Program
    candidates: tuple[PrefetchCandidate, ...]
    prefetch: Prefetch
    ctx: PassContext | None = None
    graph: torch.fx.Graph | None = None
    """The rewritten graph of the chosen distance (None when only the Program was asked for)."""
    records: list | None = None
    searched: str = ""
    """The fingerprint of the Program the search chose, before the graph was lowered: the same on every
    rank whether or not it lowered the graph (whose Program may cut its compute differently, e.g. around
    offload copies). A pipeline fingerprints its other ranks' chunks by it."""

    @property
    def plan(self) -> ResolvedPlan:
        return self.program.plan

    @property
    def rank(self) -> int:
        return self.program.rank

    def programs(self) -> dict[int, Program]:
        return {0: self.program}

    def collective_order(self) -> list[str]:
        return self.program.collective_order()

    def fingerprint(self) -> str:
        return self.program.fingerprint()

    def collective_fingerprint(self) -> str:
        return self.program.collective_fingerprint()

    @property
    def peak_gathered_bytes(self) -> int:
        return self.program.peak_gathered_bytes

    def comm_stats(self, stats: CommStats | None = None) -> CommStats:
        return self.program.comm_stats(stats)

    def wire_bytes(self) -> dict[tuple[str, str], int]:
        return self.program.wire_bytes()

    def predict(self, cluster: Cluster | None = None, *, buffer_bytes: int = 0, flops_per_step: float | None = None,
                scaling: bool = False, **costs) -> Prediction:
        """Simulate the Program on ``cluster`` (default: the one it was scheduled for). ``scaling``:
        also price it on a cluster of one partition group (``Prediction.scaling_efficiency``)."""
        cluster = cluster or self.program.cluster
        pred = self.program.predict(cluster, buffer_bytes=buffer_bytes, flops_per_step=flops_per_step, **costs)
        if scaling and self.plan.replicas > 1:
            base_program, base_cluster = _one_group(self.program, cluster)
            base = simulate_program(base_program, base_cluster, buffer_bytes=buffer_bytes, record=False, **costs)
            pred.scaling_efficiency = base.step_time_s / pred.step_time_s
        elif scaling:
            pred.scaling_efficiency = 1.0
        return pred

    def rewrite_for_runtime(self, arena: bool) -> list[Buffer]:
        """Run the runtime's passes on the graph (``lifetimes.run_runtime_passes``), then return the
        step's buffers as the runtime runs it (``lifetimes.step_buffers``)."""
        run_runtime_passes([(self.graph, self.ctx)], self.plan.plan, arena)
        return step_buffers(self.graph, self.program)

    def __str__(self) -> str:
        return str(self.program)


def _one_group(program: Program, cluster: Cluster) -> tuple[Program, Cluster]:
    """The same Program on a cluster of exactly one partition group (the scaling baseline): p tensor
    groups of tp ranks."""
    rp = program.plan
    p, k, ranks = rp.partition_size, rp.gpus_per_node, rp.partition_size * rp.tensor
    small = cluster.with_nodes(-(-ranks // k)) if ranks >= k else dataclasses.replace(cluster, nodes=1,
                                                                                      gpus_per_node=ranks)
    rp1 = ResolvedPlan(rp.plan, ranks, min(k, ranks), p, 1, tensor=rp.tensor)
    one = program.without_second_hops()
    return dataclasses.replace(one, plan=rp1, groups=planned_groups(rp1)), small


def with_prefetch(program: Program, distance: int, across_micro_steps: bool = False) -> Program:
    """``program`` (lowered at distance 0: every gather issued right before its wait) with each
    gather issued ``distance`` use intervals ahead instead, exactly as insert_collectives places
    it: right after the wait of the gather ``distance`` before, the first ones before the first
    wait; ``across_micro_steps``: the first ``distance`` gathers carried from the previous
    micro-step, issued right after the waits of the last ``distance``. Lowering once and moving
    issues is what keeps the search fast (~0.7 s per lowering at 175B)."""
    actions = list(program.micro_step)
    issues = [i for i, a in enumerate(actions) if a.kind is Kind.ALL_GATHER]
    if distance == 0 or not issues:
        return program
    n = len(issues)
    carried = carried_gathers(n, distance, across_micro_steps, program.plan.micro_batches)
    # a pipeline chunk: backward gathers are issued no earlier than backward starts (insert_collectives)
    cut = backward_start(actions) if program.plan.stages > 1 else None
    phases = [actions[i].region for i in issues]
    at_cut: list[Action] = []
    moved = {i: actions[i]._replace(carried=k < carried) for k, i in enumerate(issues)}
    after: dict[int, Action] = {}  # index of a wait -> the issue that follows it
    before_first: list[Action] = []
    for k, i in enumerate(issues):
        slot, j = issue_slot(k, phases, distance, cut is not None)
        if slot == CUT:
            at_cut.append(moved[i])
        elif slot == FIRST:
            before_first.append(moved[i])
        elif slot == AFTER:
            after[issues[j] + 1] = moved[i]  # the wait of gather j
    for j in range(carried):  # where gather n + j would go: the next micro-step's gather j
        after[issues[n - distance + j] + 1] = moved[issues[j]]._replace(kind=Kind.ALL_GATHER_NEXT, carried=False)
    out: list[Action] = []
    for i, a in enumerate(actions):
        if i == cut:
            out += at_cut
        if i in moved:
            if i != issues[0]:
                continue
            a = moved[i]
        out.append(a)
        if i == issues[0]:
            out += before_first
        if i in after:
            out.append(after[i])
    return dataclasses.replace(program, micro_step=out)


def with_keep_live(program: Program, keep: int) -> Program:
    """``program`` (lowered at distance 0) with the ``keep`` buckets whose forward use ends last
    kept gathered into their next (backward) use: their last forward release and the next gather
    and wait go, as insert_collectives' keep_live merges those intervals. The collectives are
    exactly the lowering's; its compute differs only by the views no longer re-derived."""
    if keep == 0:
        return program
    actions = program.micro_step
    last_release = {a.bucket: i for i, a in enumerate(actions) if a.kind is Kind.RELEASE and a.region != REGION_BWD}
    gathers: dict[int, list[int]] = {}  # bucket -> where its gathers and their waits are (one pass, not one per bucket)
    waits: dict[int, list[int]] = {}
    for j, a in enumerate(actions):
        if a.kind is Kind.ALL_GATHER:
            gathers.setdefault(a.bucket, []).append(j)
        elif a.kind is Kind.WAIT and a.waits_for is Kind.ALL_GATHER:
            waits.setdefault(a.bucket, []).append(j)
    pairs: dict[int, tuple[int, int]] = {}  # bucket -> (its last forward release, its next gather)
    for b, i in last_release.items():
        later = gathers.get(b, [])
        k = bisect.bisect_right(later, i)
        if k < len(later):
            pairs[b] = (i, later[k])
    drop = set()
    for b in keep_live_choice({b: i for b, (i, _) in pairs.items()}, pairs, keep):
        i, j = pairs[b]
        mine = waits[b]
        drop |= {i, j, mine[bisect.bisect_right(mine, j)]}
    return dataclasses.replace(program, micro_step=[a for i, a in enumerate(actions) if i not in drop])


def apply_prefetch(program: Program, pf: Prefetch) -> Program:
    """``program`` (lowered at distance 0) scheduled as ``pf`` says."""
    program = with_prefetch(with_keep_live(program, pf.keep_live), pf.distance, pf.across_micro_steps)
    return dataclasses.replace(program, prefetch=pf)


def hierarchical_buckets(rp: ResolvedPlan, layouts, cluster: Cluster | None, groups: dict) -> frozenset[int]:
    """Plan.hierarchical: True / False for every bucket; "auto": the buckets whose all-gather the
    cost model prices faster in stages on ``cluster`` (none without a cluster). Only when the
    partition group spans whole nodes (ResolvedPlan.spans_nodes); the bucket's reduce-scatter follows
    its gather."""
    mode = rp.plan.hierarchical
    if not rp.spans_nodes or mode is False or (mode == "auto" and cluster is None):
        return frozenset()
    if mode is True:
        return frozenset(lay.index for lay in layouts)
    ranks = groups["shard"].ranks
    return frozenset(
        lay.index for lay in layouts
        if hierarchical_time_s(ALL_GATHER, lay.full_bytes, ranks, cluster)
        < collective_time_s(ALL_GATHER, lay.full_bytes, ranks, cluster)
    )


def _collectives_of(program: Program) -> list[Action]:
    return [a for a in program.micro_step if a.kind is not Kind.COMPUTE]


def _as_prefetch(choice: Prefetch | int) -> Prefetch:
    return choice if isinstance(choice, Prefetch) else Prefetch(distance=choice)


def lower_flat(
    trace: TrainGraph,
    rp: ResolvedPlan,
    cluster: Cluster | None,
    groups: dict,
    rank: int = 0,
    *,
    device: torch.device = CPU,
    prefetch: Sequence[Prefetch | int] | None = None,
    costs: dict | None = None,
    need_graph: bool = True,
    disable=(),
    log=None,
) -> LoweredFlat:
    """Lower ``trace`` under ``rp`` with the best Prefetch that fits the budget.

    The search (with a cluster) is greedy, one knob at a time, each kept only when the
    simulation says strictly faster and it fits ``memory_budget_bytes`` (None: whatever keeps
    more gathered than the first choice must fit the device's memory in the simulation):
    distance 1 (FSDP's one-ahead), deeper while it helps (up to ``Plan.max_gathers_in_flight``,
    at most MAX_DISTANCE), 0 only when 1 does not fit; then issuing the first gathers across
    micro-steps; then keeping 1, 2, 3, 4, 8, ... all buckets live from forward into backward (each
    tried, ``keep_live_counts``). Without a
    cluster: distance 1 (0 if 1 does not fit). ``prefetch`` lists the candidates instead
    (ints are distances; e.g. ``(0,)``: no prefetch). ``costs`` go to ``simulate_program``.
    ``need_graph=False``: only the Program is wanted (no second lowering; ctx, graph and
    records are None).
    """
    budget = rp.plan.memory_budget_bytes
    limit = min(MAX_DISTANCE, rp.plan.max_gathers_in_flight or MAX_DISTANCE)
    forced = None if prefetch is None else [_as_prefetch(c) for c in prefetch]
    if rp.partition_size == 1:
        forced = [Prefetch(distance=0)]  # nothing is gathered
    passes = build_pass_list(rp.plan)

    # buckets, layouts and the hierarchical choice once; each lowering only changes the Prefetch
    ctx0 = make_context(trace, rp, device)
    ctx0 = dataclasses.replace(ctx0, hierarchical=hierarchical_buckets(rp, ctx0.layouts, cluster, groups))

    def lower(pf: Prefetch, log=None) -> tuple:
        ctx = dataclasses.replace(ctx0, prefetch=pf)
        graph, records = run_passes(trace.graph_copy(), ctx, passes, disable=disable, log=log)
        program = dataclasses.replace(build_program(graph, rp, ctx.layouts, groups, rank),
                                      cluster=cluster, pricer=simulate_program)
        return ctx, graph, records, program

    base = lower(Prefetch(distance=0))  # (ctx, graph, records, Program): every gather at its use
    best, candidates = None, []

    def consider(pf: Prefetch) -> bool:
        """Price ``pf``; True when it fits and is strictly faster than the best so far."""
        nonlocal best
        program = apply_prefetch(base[3], pf)
        pred = simulate_program(program, cluster, record=False, **(costs or {})) if cluster is not None else None
        cand = PrefetchCandidate(pf, program.peak_gathered_bytes, pred and pred.step_time_s, pred and pred.exposed_comm_s)
        candidates.append(cand)
        if budget is not None:
            fits = cand.peak_gathered_bytes <= budget
        else:  # the device's capacity: what keeps more gathered than the first choice must fit in it
            fits = (best is None or pred is None or cand.peak_gathered_bytes <= best[0].peak_gathered_bytes
                    or pred.fits(cluster))
        better = fits and (best is None or pred is None or pred.step_time_s < best[0].step_time_s)
        if better:
            best = (cand, program)
        return better

    if forced is not None:
        for pf in forced:
            consider(pf)
    elif not consider(Prefetch(distance=1)):
        consider(Prefetch(distance=0))
    elif cluster is not None:
        d = 1
        while d < limit and best[0].exposed_comm_s > 0 and consider(Prefetch(distance=d + 1)):
            d += 1
        if rp.micro_batches > 1:
            consider(dataclasses.replace(best[0].prefetch, across_micro_steps=True))
        base_choice = best[0].prefetch
        for k in keep_live_counts(len(base[3].regathered_buckets)):  # each: a kept bucket whose gather was
            try:                                                      # hidden gains nothing
                consider(dataclasses.replace(base_choice, keep_live=k))
            except PlanError:  # fewer buckets are used in both forward and backward
                break
    if best is None:
        minimum = min(c.peak_gathered_bytes for c in candidates)
        layouts = ctx0.layouts
        raise PlanError(
            f"memory_budget_bytes={budget:,} is below {minimum:,} bytes ({fmt_bytes(minimum)}), the fewest "
            f"gathered-parameter bytes any schedule of this plan keeps live (largest bucket "
            f"{fmt_bytes(max(lay.full_bytes for lay in layouts))}); raise the budget to at least "
            f"{minimum:,}, or lower bucket_bytes / raise partition_size"
        )
    cand, program = best
    program = dataclasses.replace(program, choice=_choice(cand, candidates, cluster, forced is not None))
    program.validate()
    if not need_graph:
        return LoweredFlat(program, tuple(candidates), cand.prefetch, searched=program.fingerprint())
    pf = cand.prefetch
    reuse = pf == Prefetch(distance=0) and log is None  # the search lowered exactly this one already
    ctx, graph, records, lowered_program = base if reuse else lower(pf, log)
    if _collectives_of(lowered_program) != _collectives_of(program):
        raise ProgramError("the lowered graph's collectives differ from those the search chose")
    return LoweredFlat(dataclasses.replace(lowered_program, prefetch=pf, choice=program.choice), tuple(candidates), pf,
                       ctx, graph, records, searched=program.fingerprint())


def _choice(cand: PrefetchCandidate, candidates: list[PrefetchCandidate], cluster: Cluster | None, forced: bool) -> str:
    """One line for ``print(program)``: the schedule chosen, how, and its predicted gain over prefetching
    one use interval ahead (the default without a cluster)."""
    how = "given" if forced else "chosen"
    if cluster is None or cand.step_time_s is None:
        return f"schedule: {cand.prefetch} ({how}; no cluster to price candidates on)"
    line = f"schedule: {cand.prefetch}, {how} of {len(candidates)} priced on {cluster.name}"
    base = next((c for c in candidates if c.prefetch == Prefetch(distance=1) and c.step_time_s), None)
    if base is not None and base is not cand:
        line += (f": {cand.step_time_s * 1e3:.3f} ms predicted, {base.step_time_s / cand.step_time_s:.2f}x "
                 f"prefetch 1's {base.step_time_s * 1e3:.3f} ms")
    return line


def lower_evaluation(
    trace: TrainGraph, rp: ResolvedPlan, train: LoweredFlat, groups: dict, rank: int = 0, *, device: torch.device = CPU,
) -> tuple[torch.fx.Graph, Program]:
    """The forward-only twin of a lowered training step (``Step.evaluate``): ``trace`` is the forward
    and loss alone (``trace(forward_only=True)``), rewritten with the training step's buckets, layouts
    and hierarchical gathers: each bucket gathered ahead at the training's prefetch distance and
    released after its last use; no reduce-scatter, no recomputation, no offload, nothing kept for a
    backward. Refused when the forward alone would bucket the parameters differently."""
    passes = [(name, fn) for name, fn in build_pass_list(rp.plan) if name not in ("checkpoint", "offload")]
    pf = Prefetch(distance=train.prefetch.distance)
    ctx = dataclasses.replace(make_context(trace, rp, device, pf), hierarchical=train.ctx.hierarchical)
    if ctx.layouts != train.ctx.layouts:
        raise ProgramError("evaluate: the forward alone buckets the parameters differently from the training "
                           "step (a parameter used only in backward?); it cannot run on the step's shards")
    graph, _ = run_passes(trace.graph_copy(), ctx, passes)
    program = build_program(graph, rp, ctx.layouts, groups, rank)
    loss_only = [a for a in program.boundary if a.kind is Kind.LOSS_ALL_REDUCE]  # no gradient, no optimizer
    return graph, dataclasses.replace(program, boundary=loss_only, prefetch=pf)
