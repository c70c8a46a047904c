"""``mc.autotune``: choose partition size, pipeline stages, micro-batch size and memory options.

From one trace (``mc.trace(..., symbolic_batch=True)``: every node's bytes and FLOPs are sympy
expressions in the micro-batch size) and the cost model, without the cluster:

1. ``search_space.configs`` lists every valid (S, p or t, b, checkpoint, offload, hierarchical)
   for the world size and global batch; each is priced with each prefetch choice that applies.
2. A candidate whose model states alone exceed the device (a lower bound of its planned peak)
   is infeasible without pricing. Every other one is priced by ``repricing.Pricer``: the same
   passes, Program and event simulation as ``mc.simulate``, lowered once per plan structure.
   Its memory is the simulated peak of the planned Program (model states, gathered and reduced
   buckets, activations with their planned lifetimes, offloaded or not); over the device's
   capacity it is infeasible, with the reason kept.
   They are priced lowest floor first (``tune.floor``: a provable lower bound of the step, read off the
   trace); one whose floor is above the ``top``-th best step so far and its family's best is not simulated.
3. Feasible candidates are ranked by predicted step time; each says why it beat the next.

``measure=True`` then runs the top candidates for a few steps on the process group
(``mc.compile``) and re-ranks them by measured step time.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from micscompile.core.collectives import fmt_bytes
from micscompile.core.errors import InputError, UsageError
from micscompile.core.launch import collective_device, usable_cores
from micscompile.core.plan import Plan, PlanError
from micscompile.core.program import Prefetch
from micscompile.cost_model.calibrate import device_sync
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.tensor_split import TensorSplitError
from micscompile.runtime.compile import compile as compile_step
from micscompile.trace import TrainGraph, fewer_collections
from micscompile.tune.repricing import OverMemory, Pricer
from micscompile.tune.search_space import (
    MAX_MICRO_BATCH,
    OPTIMIZER_SHARDING,
    TENSOR,
    ZERO_BUBBLE,
    check_global_batch,
    configs,
    family,
    prefetches,
    smallest_batch,
    state_floor_bytes,
)


@dataclass
class Candidate:
    """One plan (with its micro-batch size and prefetch choice) and what it is predicted to cost."""

    plan: Plan
    micro_batch_size: int
    prefetch: Prefetch
    feasible: bool
    reason: str = ""
    """Why it is infeasible (empty when feasible)."""
    prediction: Prediction | None = None
    why: str = ""
    """Why it ranks above the next candidate."""
    measured_step_s: float | None = None
    """``measure=True``: mean measured step time on the process group."""
    tie: bool = False
    """Its predicted interval overlaps the best candidate's (``Prediction.uncertainty``): the
    prediction cannot tell them apart; measure them (``measure=True``)."""
    over_memory_bytes: int | None = None
    """A pipeline ruled out by its planned peak (this, above the device's memory) before its step was simulated
    (``Pricer.predict``'s ``capacity``); its ``prediction`` is then None."""
    floor_s: float | None = None
    """A lower bound of its predicted step time (``Pricer.floor``, or its Program's): priced best first, a candidate
    whose floor is above the ``top``-th best step and its family's best is not simulated (``reason`` says so)."""

    @property
    def family(self) -> str:
        """"MiCS", "MiCS-Pipe" or "PTD-P" (``search_space.family``)."""
        return family(self.plan.pipeline_stages, self.plan.tensor_parallel_size)

    @property
    def step_time_s(self) -> float | None:
        return self.prediction.step_time_s if self.prediction else None

    @property
    def tflops_per_gpu(self) -> float | None:
        return self.prediction.tflops_per_gpu if self.prediction else None

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.prediction.peak_memory_bytes if self.prediction else self.over_memory_bytes

    @property
    def exposed_comm_s(self) -> float | None:
        return self.prediction.exposed_comm_s if self.prediction else None

    def label(self) -> str:
        p = self.plan
        pipe = f"S={p.pipeline_stages}" + (f" v={p.chunks}" if p.chunks > 1 else "")
        pipe += " zb" if p.weight_split else ""
        parts = [f"{pipe} t={p.partition_size}" if p.pipeline_stages > 1 else f"p={p.partition_size}",
                 f"b={self.micro_batch_size}", f"{'m' if p.pipeline_stages > 1 else 's'}={p.micro_batches}"]
        if p.tensor_parallel_size > 1:
            parts.insert(1, f"tp={p.tensor_parallel_size}" + (" sp" if p.sequence_parallel else ""))
        if p.checkpoint:
            parts.append("ckpt" if p.checkpoint is True else "sel-ckpt")
        if p.offload_activations:
            parts.append("offload")
        if p.hierarchical is False:
            parts.append("flat")
        if self.prefetch != Prefetch(distance=0):
            parts.append(short(self.prefetch))
        return " ".join(parts)

    def __str__(self) -> str:
        if not self.feasible:
            return f"{self.label()}: infeasible: {self.reason}"
        pred = self.prediction
        tie = ", a tie with the best" if self.tie else ""
        return (f"{self.label()}: {pred.step_time_s:.3f} s/step {pred.interval()}{tie}, "
                f"{pred.tflops_per_gpu:.3g} TFLOP/s per GPU, "
                f"peak {fmt_bytes(pred.peak_memory_bytes)}, exposed comm {pred.exposed_comm_s:.3f} s")


def short(pf: Prefetch) -> str:
    """``d2``: gathers 2 ahead; ``+x`` across micro-steps; ``+keep2``: 2 buckets kept live."""
    return f"d{pf.distance}" + ("+x" if pf.across_micro_steps else "") + (f"+keep{pf.keep_live}" if pf.keep_live else "")


def _why(a: Candidate, b: Candidate) -> str:
    """Why ``a`` ranks above ``b``: the part of the step time that differs most."""
    pa, pb = a.prediction, b.prediction
    gain = pb.step_time_s - pa.step_time_s
    parts = {"exposed communication": pb.exposed_comm_s - pa.exposed_comm_s,
             "compute (recomputation, packing, optimizer)": pb.compute_s - pa.compute_s}
    if (pa.bubble_fraction or 0) or (pb.bubble_fraction or 0):
        parts["pipeline bubble"] = gain - sum(parts.values())
    what, most = max(parts.items(), key=lambda kv: kv[1])
    if gain <= 0:
        return f"as fast as {b.label()} (predicted), priced first"
    if overlaps(pa, pb):
        return f"{gain / pb.step_time_s:.2%} faster than {b.label()}, within the prediction's {pa.interval()}: a tie"
    head = f"{gain / pb.step_time_s:.2%} faster than {b.label()}"
    return head + (f": {most:.3f} s less {what}" if most > 0 else "")


def overlaps(a: Prediction, b: Prediction) -> bool:
    """Whether two predictions' step-time intervals overlap."""
    lo, hi = sorted((a, b), key=lambda p: p.step_time_s)
    return lo.step_time_s * (1 + lo.uncertainty) >= hi.step_time_s * (1 - hi.uncertainty)


def print_table(cands: Sequence[Candidate], top: int = 10, file=None) -> None:
    """The top feasible candidates, the columns users compare (``~``: a tie with the best, within the
    predictions' interval)."""
    rows = [c for c in cands if c.feasible][:top]
    if rows and rows[0].prediction.uncertainty:
        print(f"predicted step times {rows[0].prediction.interval()} (held-out error on this cluster); "
              f"~: a tie with the best", file=file)
    measured = any(c.measured_step_s is not None for c in rows)
    head = (f"{'#':>3} {'S':>3} {'v':>3} {'tp':>3} {'p/t':>5} {'d':>5} {'b':>3} {'s/m':>5} {'ckpt':>5} {'offl':>5} "
            f"{'hier':>5} {'opt':>5} "
            f"{'prefetch':<9} {'step s':>8} {'TFLOP/s':>8} {'peak':>10} {'exp.comm s':>10} {'bubble':>7}")
    head += f" {'measured s':>10}" if measured else ""
    print(head, file=file)
    print("-" * len(head), file=file)
    for i, c in enumerate(rows):
        p, pred = c.plan, c.prediction
        d = pred.world_size // (p.pipeline_stages * p.partition_size * p.tensor_parallel_size)
        tp = f"{p.tensor_parallel_size}{'s' if p.sequence_parallel else ''}"
        bubble = f"{pred.bubble_fraction:.1%}" if pred.bubble_fraction is not None else "-"
        ck = {False: "-", True: "full", "selective": "sel", "attention": "attn"}[p.checkpoint]
        v = f"{p.chunks}{'z' if p.weight_split else ''}"
        line = (f"{i + 1:>3} {p.pipeline_stages:>3} {v:>3} {tp:>3} {p.partition_size:>5} {d:>5} "
                f"{c.micro_batch_size:>3} "
                f"{p.micro_batches:>5} {ck:>5} {'yes' if p.offload_activations else '-':>5} {str(p.hierarchical):>5} "
                f"{'world' if p.optimizer_sharding == 'world' else '-':>5} {short(c.prefetch):<9} "
                f"{pred.step_time_s:>7.4f}{'~' if c.tie else ' '} {pred.tflops_per_gpu:>8.3g} "
                f"{fmt_bytes(pred.peak_memory_bytes):>10} {pred.exposed_comm_s:>10.3f} {bubble:>7}")
        line += f" {c.measured_step_s:>10.4f}" if measured and c.measured_step_s is not None else ""
        print(line, file=file)


FAMILIES = ("MiCS", "MiCS-Pipe", "PTD-P")


def print_families(cands: Sequence[Candidate], file=None) -> None:
    """The best candidate of each family of the seeds (MiCS: sharding alone; MiCS-Pipe: stages of sharded ranks;
    PTD-P: tensor groups, with stages or not, sharded or not) and how far behind the best it is; a family whose
    interval overlaps the best's is a tie."""
    good = [c for c in cands if c.feasible]
    if not good:
        return
    best = good[0]
    print(f"{'family':<10} {'candidates':>10} {'best':<58} {'step s':>8} {'TFLOP/s':>8} {'vs best':>9}", file=file)
    for fam in FAMILIES:
        mine = [c for c in cands if c.family == fam]
        top = next((c for c in good if c.family == fam), None)
        if top is None:
            why = "no candidate" if not mine else f"none fits ({mine[0].reason or 'not priced'})"
            print(f"{fam:<10} {len(mine):>10} {why[:80]}", file=file)
            continue
        behind = top.step_time_s / best.step_time_s - 1
        vs = "best" if top is best else f"+{behind:.1%}" + ("~" if overlaps(best.prediction, top.prediction) else "")
        print(f"{fam:<10} {len(mine):>10} {top.label()[:58]:<58} {top.step_time_s:>8.3f} {top.tflops_per_gpu:>8.3g} "
              f"{vs:>9}", file=file)
    print(f"the best is {best.family}; ~: within the predictions' {best.prediction.interval()}, a tie", file=file)
    print_zero_bubble(good, file)


def print_zero_bubble(good: Sequence[Candidate], file=None) -> None:
    """Whether a zero-bubble schedule won: the best pipeline with one against its twin with the backward whole
    (the same plan under 1F1B or interleaved 1F1B), where both were priced and fit."""
    zb = next((c for c in good if c.plan.weight_split), None)
    if zb is None:
        return
    schedule = "interleaved" if zb.plan.chunks > 1 else "1f1b"
    twin = next((c for c in good if c.plan == dataclasses.replace(zb.plan, pipeline_schedule=schedule)
                 and c.micro_batch_size == zb.micro_batch_size and c.prefetch == zb.prefetch), None)
    than = f" against {twin.step_time_s:.3f} s for the same plan under {schedule}" if twin else ""
    print(f"zero bubble: the best pipeline with a split backward is {zb.label()} ({zb.plan.pipeline_schedule}), "
          f"{zb.step_time_s:.3f} s{than}", file=file)


def autotune(
    trace: TrainGraph,
    cluster: Cluster,
    *,
    global_batch_size: int,
    base_plan: Plan | None = None,
    partition_sizes: Sequence[int] | None = None,
    pipeline_stages: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpoint: Sequence = (False, True, "selective"),
    offload: Sequence[bool] = (False, True),
    hierarchical: Sequence = ("auto", False),
    pipeline_chunks: Sequence[int] = (1, 2),
    optimizer_sharding: Sequence[str] = OPTIMIZER_SHARDING,
    tensor: Sequence[tuple[int, bool]] = TENSOR,
    zero_bubble: Sequence[bool] = ZERO_BUBBLE,
    flops_per_sample: float | None = None,
    workers: int | None = None,
    exhaustive: bool = False,
    progress: bool = True,
    top: int = 10,
    verbose: bool = True,
    measure: bool = False,
    **measure_kwargs,
) -> list[Candidate]:
    """Every candidate plan for training ``trace``'s model with ``global_batch_size`` samples per step
    on ``cluster``, best first: the feasible ones by predicted step time, then the infeasible ones
    with their reasons.

    ``trace``: ``mc.trace(..., symbolic_batch=True)`` searches ``micro_batch_sizes`` (default: every
    size up to 32 that splits the batch); a concrete trace searches only its own micro-batch size.
    ``base_plan`` holds the fields not searched (dtypes, bucket_bytes, budget; default: the trace's
    compute dtype). The other sequences narrow the search (``pipeline_chunks``: v, interleaved 1F1B
    where v > 1; ``optimizer_sharding``: ``Plan.optimizer_sharding``, "world" where d > 1; ``tensor``: the
    (tensor group size, sequence parallelism) pairs, default every size dividing a node up to 8, with and without;
    ``zero_bubble``: a pipeline's backward whole and/or split into B and W, ZB-H1 or interleaved zero-bubble).
    ``flops_per_sample``: what TFLOP/s counts (default: the graph's FLOPs without
    recomputation). ``workers``: the (t, sequence parallelism) groups priced in that many forked processes (each
    group's tensor split and lowerings are its own; the same candidates in the same order); None (the default):
    one per core this process may run on (``usable_cores``), as ``micscompile autotune`` does.
    Each group is priced best first (lowest floor first, ``Candidate.floor_s``, a pipeline's first without its
    schedule's timeline, then with it where that did not rule it out; the largest group first, and the
    groups, in processes too, share what must be beaten); a candidate whose floor is above the ``top``-th best step
    priced so far and its family's best is not simulated: the top ``top``, each family's best and the ties among
    them are those of pricing every candidate. ``exhaustive=True`` simulates every one.
    ``verbose`` prints the top ``top``; ``progress`` shows a progress bar.
    ``measure=True``: see ``measure_top`` (its keyword arguments: model, loss_fn, make_batch, ...).
    """
    n, k = cluster.world_size, cluster.gpus_per_node
    check_global_batch(n, global_batch_size, tensor, k)
    unknown = [o for o in optimizer_sharding if o not in OPTIMIZER_SHARDING]
    if unknown:
        raise InputError(f"optimizer_sharding lists the homes autotune searches, 'partition' and/or 'world' (it "
                         f"prices each as a candidate, where 'auto' would choose inside one), got {unknown}")
    if not any(k % t == 0 and n % t == 0 for t, _ in tensor):
        raise PlanError(f"no tensor group size of {sorted({t for t, _ in tensor})} divides a node of {k} GPUs "
                        f"(and the {n} ranks)")
    base = base_plan or Plan(param_dtype=trace.compute_dtype or torch.float32)
    sizes = micro_batch_sizes or (None if trace.batch_symbols else (trace.batch_size,))
    narrowed = dict(gpus_per_node=k, units=len(trace.blocks), partition_sizes=partition_sizes,
                    pipeline_stages=pipeline_stages, micro_batch_sizes=sizes, checkpoint=checkpoint, offload=offload,
                    hierarchical=hierarchical, chunks=pipeline_chunks, optimizer_sharding=optimizer_sharding,
                    tensor=tensor, zero_bubble=zero_bubble)
    space = configs(n, global_batch=global_batch_size, **narrowed)
    if not space:
        smallest = smallest_batch(n, global_batch_size, **narrowed)
        raise PlanError(f"no plan splits a global batch of {global_batch_size} over {n} ranks (micro-batch sizes "
                        f"{_sizes(sizes)}; a pipeline of S stages at least S micro-batches): every rank of a stage "
                        f"trains on samples of its own, so a batch needs b * n / S | batch and batch >= b * n; "
                        + (f"the smallest that works here is {smallest}" if smallest else
                           "none works with these choices: widen them (pipeline stages, micro-batch sizes)"))
    pricer = Pricer(trace, cluster, sorted({c.micro_batch for c in space}))
    # one structure at a time: its lowering is shared by all its candidates (and a tensor split by its (t, sp) group)
    space.sort(key=lambda c: (str(c.structure), c.partition, str(c.hierarchical), c.micro_batch))
    groups = [list(g) for _, g in itertools.groupby(space, key=lambda c: (c.tensor, c.sequence))]
    counts = [sum(len(prefetches(c)) for c in g) for g in groups]
    bar = tqdm(total=sum(counts), desc="autotune", unit="plan",
               disable=None if progress else True,  # (None: off where stderr is no terminal)
               leave=False)
    job = _Job(pricer, base, cluster, global_batch_size, flops_per_sample,
               sum(trace.param_shapes[name].numel() for name in trace.param_names), None if exhaustive else top)
    workers = usable_cores() if workers is None else workers
    with fewer_collections():
        if workers > 1 and len(groups) > 1:
            job.beat = _ToBeat(job.top, multiprocessing.get_context("fork").Array("d", [math.inf] * (1 + len(FAMILIES))))
            results = _in_processes(job, groups, counts, workers, bar)
        else:
            done = {i: job.price(groups[i], bar) for i in sorted(range(len(groups)), key=lambda i: -counts[i])}
            results = [done[i] for i in range(len(groups))]  # (the largest first, as in processes; in their order)
    bar.close()
    out = [c for group, _ in results for c in group]
    unsplit = sum(u for _, u in results)  # candidates whose tensor groups the model's shapes do not split
    ranked = rank(out)
    if measure:
        ranked = measure_top(ranked, **measure_kwargs)
    if verbose:
        good, priced = sum(c.feasible for c in ranked), sum(c.prediction is not None for c in ranked)
        over = sum(c.over_memory_bytes is not None for c in ranked)
        below = sum(c.prediction is None and c.floor_s is not None for c in ranked) - over
        print(f"autotune: {len(ranked)} candidates on {n} x {cluster.gpu.name} ({cluster.name}), global batch "
              f"{global_batch_size}: {priced} simulated ({len(ranked) - priced - unsplit - below - over} ruled out by "
              f"their model states alone" + (f", {below} by their floors" if below else "")
              + (f", {over} by their planned peaks" if over else "")
              + (f", {unsplit} not priced: tensor groups the model does not split" if unsplit else "")
              + f"), {good} feasible")
        print_table(ranked, top)
        print()
        print_families(ranked)
    return ranked


@dataclass
class _Job:
    """What pricing a group of configurations needs (a forked worker inherits it)."""

    pricer: Pricer
    base: Plan
    cluster: Cluster
    global_batch: int
    flops_per_sample: float | None
    num_params: int
    top: int | None
    """Priced best first, skipping what cannot be among the ``top`` best or its family's best; None: price all."""
    beat: _ToBeat | None = None
    """What a candidate must beat (shared by the groups, and by forked workers where ``shared``)."""

    def __post_init__(self) -> None:
        self.beat = self.beat or _ToBeat(self.top)

    def price(self, space: Sequence, bar=None) -> tuple[list[Candidate], int]:
        """Each configuration of ``space`` with each of its prefetch choices, in order; and how many were not
        priced because the model's shapes do not split into their tensor groups. Simulated lowest floor first
        (``Pricer.floor``; ``_ToBeat``)."""
        cluster, capacity, out, todo, unsplit = self.cluster, self.cluster.gpu.memory_bytes, [], [], 0
        tick = bar.update if bar is not None else (lambda n=1: None)
        for cfg in space:
            plan, pfs = cfg.plan(self.base), prefetches(cfg)
            floor = state_floor_bytes(self.num_params, cfg)
            if floor > capacity:
                tick(len(pfs))
                out += [Candidate(plan, cfg.micro_batch, pf, False, f"model states alone need "
                                  f"{fmt_bytes(floor)} per GPU (16 B per parameter over S*p = "
                                  f"{cfg.stages * cfg.partition} ranks, Adam's 8 over d times more with "
                                  f"optimizer_sharding='world'), more than the {fmt_bytes(capacity)} of a "
                                  f"{cluster.gpu.name}") for pf in pfs]
                continue
            try:  # (a pipeline's without its timeline: run below, where this one does not rule it out)
                lows = [self.pricer.floor(plan, cfg.micro_batch, pf, timeline=False) if self.top else 0.0 for pf in pfs]
            except (PlanError, TensorSplitError) as exc:  # a tensor size the model's shapes do not split
                tick(len(pfs))
                unsplit += len(pfs)
                out += [Candidate(plan, cfg.micro_batch, pf, False, f"not priced: {exc}".splitlines()[0])
                        for pf in pfs]
                continue
            per_sample = self.flops_per_sample or self.pricer.graph_flops(cfg.micro_batch) / cfg.micro_batch
            for pf, low in zip(pfs, lows):
                todo.append((low, len(out), plan, cfg.micro_batch, pf, per_sample))
                out.append(None)
        beat = self.beat
        for low, i, plan, b, pf, per_sample in sorted(todo, key=lambda x: x[:2]):
            tick()
            fam, limit = family(plan.pipeline_stages, plan.tensor_parallel_size), math.inf
            try:
                if self.top:
                    limit = beat.limit(fam)
                    if low <= limit and plan.pipeline_stages > 1:
                        low = self.pricer.floor(plan, b, pf)
                    if low > limit:
                        out[i] = _below(plan, b, pf, low, limit)
                        continue
                pred = self.pricer.predict(plan, b, pf, limit, capacity if self.top else None)
            except (PlanError, TensorSplitError) as exc:  # a tensor size the model's shapes do not split
                unsplit += 1
                out[i] = Candidate(plan, b, pf, False, f"not priced: {exc}".splitlines()[0])
                continue
            if isinstance(pred, OverMemory):  # (a pipeline's planned peak, before its timeline is simulated)
                out[i] = Candidate(plan, b, pf, False, f"planned peak {fmt_bytes(pred.peak_bytes)} exceeds the "
                                   f"{fmt_bytes(capacity)} of a {cluster.gpu.name} (its step not simulated)",
                                   over_memory_bytes=pred.peak_bytes, floor_s=low)
                continue
            if not isinstance(pred, Prediction):  # (its Program's floor, above the limit)
                out[i] = _below(plan, b, pf, pred, limit)
                continue
            pred.flops_per_step = per_sample * self.global_batch / cluster.world_size
            out[i] = self._priced(plan, b, pf, pred, low if self.top else None)
            if out[i].feasible:
                beat.add(fam, pred.step_time_s)
        self._price_twin(out)
        return out, unsplit

    def _priced(self, plan: Plan, b: int, pf: Prefetch, pred: Prediction, floor: float | None) -> Candidate:
        capacity, fits = self.cluster.gpu.memory_bytes, pred.fits(self.cluster)
        reason = "" if fits else (f"planned peak {fmt_bytes(pred.peak_memory_bytes)} exceeds the "
                                  f"{fmt_bytes(capacity)} of a {self.cluster.gpu.name}")
        return Candidate(plan, b, pf, fits, reason, pred, floor_s=floor)

    def _price_twin(self, out: list[Candidate]) -> None:
        """The twin (``print_zero_bubble``) of the best zero-bubble pipeline, simulated where its floor skipped it."""
        zb = min((c for c in out if c.feasible and c.plan.weight_split), key=lambda c: c.step_time_s, default=None)
        if zb is None:
            return
        twin = dataclasses.replace(zb.plan, pipeline_schedule="interleaved" if zb.plan.chunks > 1 else "1f1b")
        for i, c in enumerate(out):
            if c.plan == twin and c.micro_batch_size == zb.micro_batch_size and c.prefetch == zb.prefetch \
                    and c.prediction is None and c.floor_s is not None and c.over_memory_bytes is None:
                pred = self.pricer.predict(c.plan, c.micro_batch_size, c.prefetch)
                pred.flops_per_step = zb.prediction.flops_per_step  # (the same plan but its schedule)
                out[i] = self._priced(c.plan, c.micro_batch_size, c.prefetch, pred, c.floor_s)


def _below(plan: Plan, b: int, pf: Prefetch, low: float, limit: float) -> Candidate:
    return Candidate(plan, b, pf, False, f"not simulated: its floor, {low:.4g} s a step, is above the {limit:.4g} s "
                     "it must beat", floor_s=low)


class _ToBeat:
    """What a candidate must beat to be printed: the ``top``-th best feasible step priced so far, or else its
    family's best (each family's best is printed). Steps only fall as more are priced, so a candidate whose floor is
    above both now cannot be either at the end (a relative 1e-6 above: the floors are sums, the steps timelines).
    Forked workers share theirs (``shared``: the least of each one's ``top``-th best and each family's best, an upper
    bound of the search's own, as the ``top``-th best of some candidates is of the ``top``-th best of all)."""

    def __init__(self, top: int | None, shared=None) -> None:
        self.top, self.steps, self.family, self.shared = top or 1, [], {}, shared

    def limit(self, fam: str) -> float:
        kth = -self.steps[0] if len(self.steps) >= self.top else math.inf
        best = self.family.get(fam, math.inf)
        if self.shared is not None:
            kth, best = min(kth, self.shared[0]), min(best, self.shared[1 + FAMILIES.index(fam)])
        return max(kth, best) * (1 + 1e-6)

    def add(self, fam: str, step: float) -> None:
        heapq.heappush(self.steps, -step)
        if len(self.steps) > self.top:
            heapq.heappop(self.steps)
        self.family[fam] = min(step, self.family.get(fam, math.inf))
        if self.shared is not None:
            with self.shared.get_lock():
                if len(self.steps) >= self.top:
                    self.shared[0] = min(self.shared[0], -self.steps[0])
                i = 1 + FAMILIES.index(fam)
                self.shared[i] = min(self.shared[i], step)


_FORKED: tuple | None = None
"""(job, groups) of ``_in_processes``, which forked workers inherit rather than receive pickled."""


def _price_group(i: int) -> tuple[list[Candidate], int]:
    job, groups = _FORKED
    return job.price(groups[i])


def _in_processes(job: _Job, groups: list[list], sizes: list[int], workers: int, bar) -> list[tuple]:
    """``job.price`` of each group in ``workers`` forked processes, the largest groups first; the results in the
    groups' order (the candidates' order, and so the ranking's ties, those of pricing them one after another)."""
    global _FORKED
    order = sorted(range(len(groups)), key=lambda i: -sizes[i])
    _FORKED, done = (job, groups), {}
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(groups))) as pool:
            for i, result in zip(order, pool.imap(_price_group, order)):
                done[i] = result
                bar.update(sizes[i])
    finally:
        _FORKED = None
    return [done[i] for i in range(len(groups))]


def _sizes(sizes) -> str:
    return f"{min(sizes)}-{max(sizes)}" if sizes and len(sizes) > 1 and list(sizes) == list(
        range(min(sizes), max(sizes) + 1)) else ", ".join(map(str, sizes)) if sizes else f"1-{MAX_MICRO_BATCH}"


def rank(cands: list[Candidate], key: Callable[[Candidate], float] = lambda c: c.step_time_s) -> list[Candidate]:
    """Feasible candidates by ``key`` (ties: the order they were priced in), then the infeasible ones;
    each feasible one says why it beat the next."""
    good = sorted((c for c in cands if c.feasible), key=key)
    for a, b in zip(good, good[1:]):
        a.why = _why(a, b)
    for c in good[1:]:
        c.tie = overlaps(good[0].prediction, c.prediction)
    return good + [c for c in cands if not c.feasible]


def measure_top(ranked: list[Candidate], *, model: torch.nn.Module, loss_fn, make_batch: Callable[[int], tuple],
                optimizer=None, top_k: int = 3, steps: int = 3, warmup: int = 1, **compile_kwargs) -> list[Candidate]:
    """Run the ``top_k`` feasible candidates for ``steps`` steps each (after ``warmup``) on the
    initialized process group and re-rank them by mean measured step time; the rest follow in
    predicted order. ``make_batch(n)`` returns this rank's batch inputs for ``n`` samples (the
    model's inputs, then the loss's)."""
    if not torch.distributed.is_initialized():
        raise UsageError("measure=True runs candidates on the process group: call "
                           "torch.distributed.init_process_group first (e.g. under torchrun)")
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=1e-3))
    tried = [c for c in ranked if c.feasible][:top_k]
    for c in tried:
        local = c.micro_batch_size * c.plan.micro_batches  # this rank's (its pipeline's) samples per step
        example = make_batch(c.micro_batch_size)
        step = compile_step(model, c.plan, loss_fn=loss_fn, optimizer=optimizer, example_inputs=example,
                          prefetch=[c.prefetch], **compile_kwargs)
        batch = make_batch(local)
        for _ in range(warmup):
            step(*batch)
        device_sync()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(*batch)
        device_sync()
        torch.distributed.barrier()
        elapsed = torch.tensor([(time.perf_counter() - t0) / steps], device=collective_device())
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        c.measured_step_s = float(elapsed)
    done = sorted(tried, key=lambda c: c.measured_step_s)
    for a, b in zip(done, done[1:]):
        a.why = (f"measured {a.measured_step_s:.4f} s against {b.measured_step_s:.4f} s for {b.label()} "
                 f"(predicted {a.step_time_s:.4f} s and {b.step_time_s:.4f} s)")
    return done + [c for c in ranked if c not in tried]
