"""Event-driven simulation of one rank's Program on a Cluster.

Streams: one compute stream; one communication stream per process group ("shard",
"replicate", "world"), each running its collectives in issue order (as NCCL and
gloo do per group). An issue action enqueues its collective on its group's stream
at the compute stream's current time; a WAIT blocks the compute stream until that
collective ends (the blocked time is *exposed* communication); COMPUTE advances
the compute stream by the roofline time of its ops.

Compute time of an action (cost_model.specs.GpuSpec):
``matmul_flops / (peak * matmul_efficiency) + mem_bytes / (bandwidth * memory_efficiency)
+ ops * op_overhead_s``. Packing gradients before a reduction costs a read and a
write of the bucket on the compute stream. ``Cluster.overlap`` < 1 charges the
compute stream ``(1 - overlap)`` of every collective's time (cores shared with the
communication library, as gloo on a small CPU machine), plus
``Cluster.collective_overhead_s`` per collective. A calibrated cluster instead has, per
group size, ``Cluster.collective_interference``: the exposed fraction of the collective's
duration, charged at issue, and a slowdown of the compute that runs while it is in flight
(until its wait), up to a maximum (measured on 4 gloo ranks over 2 cores: ~all of a
gather's duration is exposed and compute beside it runs 10-50% slower); a collective
issued while another of its group is in flight takes ``queued_fraction`` of its duration
(gloo runs a group's collectives on two threads); and it starts once the group's last rank has
issued it, ``arrival_wait_s * (c / 1 ms) ** arrival_exponent`` later, c being the compute since the
group's previous collective ended (its ranks do not run the same ops in the same time).

Memory per rank: static (parameter shard + gradient shard + optimizer state:
``state_bytes_per_param`` per shard element, 16 for fp32 Adam, of which Adam's m and v, 8, over 1/d of
the shard with ``optimizer_sharding="world"``), buffers, gathered
buckets (issue -> release), packed gradient buckets (issue -> wait) and activations
(Program.activation_bytes).
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

from micscompile.core.collectives import fmt_bytes
from micscompile.core.program import BLOCKING, COLLECTIVE_OF_KIND, Action, Kind, Program
from micscompile.cost_model.collective_time import (
    ALL_GATHER,
    REDUCE_SCATTER,
    collective_time_s,
    hierarchical_stages_s,
    nodes_spanned,
)
from micscompile.cost_model.specs import Cluster, GpuSpec


@dataclass
class _InFlight:
    """A collective issued and not yet waited for."""

    end_s: float
    group: str
    frees_bytes: int
    """Released at its wait (a packed gradient bucket; gathered buckets are released explicitly)."""
    finish_s: float = 0.0
    """Compute-stream time its wait adds (a hierarchical gather's reorder and intra-node stage, a
    peer's copy-out of the gathered bytes)."""
    slowdown: float = 0.0
    """Fraction by which compute beside it runs slower..."""
    slowdown_left_s: float = 0.0
    """...until it has cost this much."""


@dataclass(frozen=True)
class Event:
    track: str
    """"compute" or a communication stream ("comm:shard", ...)."""
    name: str
    start_s: float
    end_s: float


@dataclass
class Prediction:
    """What one optimizer step of a plan costs on a cluster (one rank; ranks are symmetric)."""

    step_time_s: float
    compute_s: float
    """Busy time of the compute stream (compute, packing, optimizer)."""
    exposed_comm_s: float
    """Time the compute stream spent blocked on communication."""
    stream_busy_s: dict[str, float]
    peak_memory_bytes: int
    static_memory_bytes: int
    flops_per_step: float
    """FLOPs one rank performs per step (graph FLOPs, or the caller's formula)."""
    world_size: int
    events: list[Event] = field(default_factory=list, repr=False)
    memory: list[tuple[float, int]] = field(default_factory=list, repr=False)
    scaling_efficiency: float | None = None
    """Per-GPU throughput relative to training on one partition group alone."""
    bubble_fraction: float | None = None
    """Pipelines: idle time of the busiest pipeline rank over its busy time."""
    action_spans: list[tuple[float, float, int]] = field(default_factory=list, repr=False)
    """(start, end, live bytes after) per action of the micro-step (as the first micro-step runs it;
    one only the last runs, such as a second hop, as the last), then per boundary action; a
    collective's span runs from its issue to its completion."""
    uncertainty: float = 0.0
    """Relative half-width of the step time's interval: the cluster's held-out prediction error
    (``Cluster.prediction_error``; 0: none known)."""
    exposed_boundary_s: float = 0.0
    """Of ``exposed_comm_s``: the time the step waits at the boundary for its gradient all-reduces over
    the replicas (2-hop's second hop), the loss's and the gradient norm's."""
    comm_charged_s: float = 0.0
    """Of ``compute_s``: what collectives cost the compute stream itself (their exposed share where
    communication shares the compute's cores or engines, ``Cluster.overlap`` < 1 or calibrated)."""

    def fits(self, cluster) -> bool:
        """Its peak memory fits ``cluster``'s device."""
        return self.peak_memory_bytes <= cluster.gpu.memory_bytes

    def interval(self) -> str:
        """``"+-14%"``, or ``"(no held-out error for this cluster)"``."""
        return f"+-{self.uncertainty:.0%}" if self.uncertainty else "(no held-out error for this cluster)"

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_step / self.step_time_s / 1e12

    def __str__(self) -> str:
        busy = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self.stream_busy_s.items()))
        eff = f", scaling efficiency {self.scaling_efficiency:.1%}" if self.scaling_efficiency is not None else ""
        eff += f", pipeline bubble {self.bubble_fraction:.1%} of the compute" if self.bubble_fraction is not None else ""
        return (
            f"step {self.step_time_s * 1e3:.2f} ms {self.interval()} on {self.world_size} ranks: "
            f"compute {self.compute_s * 1e3:.2f} ms, "
            f"exposed comm {self.exposed_comm_s * 1e3:.2f} ms ({self.exposed_boundary_s * 1e3:.2f} ms of it at the "
            f"boundary), {self.tflops_per_gpu:.3g} TFLOP/s per GPU, "
            f"peak memory {fmt_bytes(self.peak_memory_bytes)} (static {fmt_bytes(self.static_memory_bytes)}){eff}\n"
            f"stream busy: {busy}{self._bound()}"
        )

    def _bound(self) -> str:
        """Where a communication stream is busier than the compute it could hide under (the compute
        stream less what collectives cost it): no schedule hides the difference, so the step is at
        least that stream's time. A lower bound: optimizer and packing time hide nothing either."""
        stream, busy = max(((k, v) for k, v in self.stream_busy_s.items() if k.startswith("comm:")),
                           key=lambda kv: kv[1], default=(None, 0.0))
        hideable = self.compute_s - self.comm_charged_s
        if stream is None or busy <= hideable:
            return ""
        return (f"\nbound by {stream}: its links are busy {busy * 1e3:.1f} ms, longer than the {hideable * 1e3:.1f} "
                f"ms of compute they could hide under; no schedule hides the other "
                f"{(busy - hideable) * 1e3:.1f} ms (a larger micro-batch brings more compute to hide it under)")

    def to_chrome_trace(self, path: str | Path) -> None:
        """A Perfetto / chrome://tracing timeline: compute and comm tracks, memory counter."""
        tracks = {t: i for i, t in enumerate(dict.fromkeys(e.track for e in self.events))}
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": t}} for t, i in tracks.items()]
        trace += [
            {"name": e.name, "ph": "X", "pid": 0, "tid": tracks[e.track], "ts": e.start_s * 1e6,
             "dur": (e.end_s - e.start_s) * 1e6}
            for e in self.events
        ]
        trace += [{"name": "memory", "ph": "C", "pid": 0, "ts": t * 1e6, "args": {"bytes": b}} for t, b in self.memory]
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


GATHERS = (Kind.ALL_GATHER, Kind.ALL_GATHER_NEXT)
OPTIMIZER_STATE_BYTES_PER_PARAM = 8
"""Of ``state_bytes_per_param``, the optimizer's own state per element (Adam's m and v in fp32): what
``optimizer_sharding="world"`` keeps for 1/d of the shard only."""


def compute_time_s(action: Action, gpu: GpuSpec, dtype: str = "float32") -> float:
    if action.measured_s is not None:
        return action.measured_s
    return (
        action.matmul_flops / (gpu.flops(dtype) * gpu.matmul_efficiency)
        + action.mem_bytes / (gpu.memory_bandwidth_bps * gpu.memory_efficiency)
        + action.ops * gpu.op_overhead_s
    )


def _charge_s(cluster: Cluster, cost: dict[str, float] | None, duration: float) -> float:
    """What a collective of ``duration`` costs the compute stream: its group's calibrated exposed share (``cost``),
    else ``charge_s``."""
    return charge_s(cluster, duration) if cost is None else cost["exposed_fraction"] * duration


def _pack_s(nbytes: int, gpu: GpuSpec) -> float:
    """Packing a reduction's ``nbytes`` of gradients into its bucket on the compute stream (read and written once)."""
    return _memory_time_s(2 * nbytes, gpu, ops=3)


def _least_share(cost: dict[str, float] | None) -> float:
    """The least share of its duration a collective of a calibrated group (``cost``) takes: queued behind another of
    its group it takes ``queued_fraction`` (floors only: the simulation applies it where it is queued)."""
    return min(1.0, cost.get("queued_fraction", 1.0)) if cost else 1.0


def charge_s(cluster: Cluster, duration: float) -> float:
    """The compute-stream time a collective of ``duration`` costs on a cluster without calibrated interference:
    ``(1 - overlap) * duration + collective_overhead_s``."""
    return (1 - cluster.overlap) * duration + cluster.collective_overhead_s


class _Run(NamedTuple):
    """Consecutive COMPUTE and blocking tensor-collective actions, priced as one (``coalesced``)."""

    kind: object
    time_s: float
    """How far the run moves the compute stream: its compute, and each collective's duration (blocking: the
    next op waits for it) or its charge where the charge is longer."""
    compute_s: float
    """Compute-stream busy time: the compute and the collectives' charges."""
    charged_s: float
    exposed_s: float
    comm: tuple[tuple[str, float], ...]
    """(stream, busy time) of its collectives."""
    activation_peak_bytes: int | None
    """Most activation bytes alive during its computes (None: it has none)."""
    activation_bytes: int | None
    """Activation bytes alive after it (None: it has no compute, they stay as they were)."""
    carried: bool = False


RUN = object()
"""The kind of a ``_Run``."""


def coalesced(program: Program, cluster: Cluster, compute_dtype: str) -> list:
    """``program.micro_step`` with each run of consecutive COMPUTE and blocking (tensor) collectives as one
    ``_Run``, for a simulation without a timeline on a cluster without calibrated interference: there a compute
    action moves the compute stream by its time alone, and a blocking collective, on a stream nothing else uses
    (each one is done before the next action), by its duration or its charge, whichever is longer. The same
    prediction up to float rounding (tested: ``test_coalesced_runs_price_as_their_actions``), with a third of
    the handler calls on a tensor-parallel Program."""
    gpu, out, run = cluster.gpu, [], []
    priced: dict[tuple, float] = {}

    def close() -> None:
        if len(run) < 2:
            out.extend(run)
        else:
            time = compute = charged = exposed = 0.0
            comm: dict[str, float] = defaultdict(float)
            peak, act = None, 0
            for a in run:
                if a.kind is Kind.COMPUTE:
                    d = compute_time_s(a, gpu, compute_dtype)
                    time, compute = time + d, compute + d
                    peak = a.activation_peak_bytes if peak is None else max(peak, a.activation_peak_bytes)
                    act = a.activation_bytes
                    continue
                key = (a.kind, a.tensor_bytes, a.group)
                if key not in priced:
                    priced[key] = collective_time_s(program.collective_of(a), a.tensor_bytes,
                                                    program.groups[a.group].ranks, cluster)
                d = priced[key]
                if d <= 0:
                    continue
                charge = charge_s(cluster, d)
                time += max(d, charge)
                compute, charged, exposed = compute + charge, charged + charge, exposed + max(d - charge, 0.0)
                comm[f"comm:{a.group}"] += d
            if peak is None:  # (collectives alone: the activations stay as they were)
                act = None
            out.append(_Run(RUN, time, compute, charged, exposed, tuple(comm.items()), peak, act))
        run.clear()

    for a in program.micro_step:
        if a.kind is Kind.COMPUTE or (a.kind in BLOCKING and not a.hierarchical):
            run.append(a)
        else:
            close()
            out.append(a)
    close()
    return out


def _memory_time_s(nbytes: float, gpu: GpuSpec, ops: int = 1) -> float:
    return nbytes / (gpu.memory_bandwidth_bps * gpu.memory_efficiency) + ops * gpu.op_overhead_s


def accumulate_time_s(shard_numel: float, gpu: GpuSpec, buckets: int) -> float:
    """A micro-step's gradient accumulation into the shard accumulators: ``shard_numel`` fp32 elements read twice and
    written once, one operation per bucket."""
    return _memory_time_s(3 * shard_numel * 4, gpu, ops=buckets)


def issued_count(program: Program, a: Action) -> int:
    """In how many of the step's micro-steps ``a`` runs (``Program.issues``: the first, every middle one alike, the
    last)."""
    s = program.plan.micro_batches
    first, end = (s - 1 if a.kind is Kind.SECOND_HOP else 0), (1 if a.carried else s)
    return max(0, min(end, s - 1 if a.kind is Kind.ALL_GATHER_NEXT else s) - first)


def stream_floor_s(kind: str, nbytes: int, ranks: Sequence[int], cluster: Cluster) -> float:
    """The least time a communication stream spends on a collective (``kind``) of ``nbytes`` over ``ranks``: flat,
    or for an all-gather or reduce-scatter the inter-node stage of a hierarchical one where the group spans nodes,
    whichever is less (a calibrated group's queued share where it is smaller)."""
    d = collective_time_s(kind, nbytes, ranks, cluster)
    if kind in (ALL_GATHER, REDUCE_SCATTER) and nodes_spanned(ranks, cluster.gpus_per_node) > 1:
        d = min(d, hierarchical_stages_s(kind, nbytes, ranks, cluster)[0])
    return d * _least_share(cluster.collective_interference.get(str(len(ranks))))


def floor_s(program: Program, cluster: Cluster, compute_dtype: str | None = None) -> float:
    """A lower bound of ``simulate_program(program, cluster).step_time_s`` (no peer option), from sums without a
    timeline: the compute stream runs each compute action, packs each reduction, waits out each blocking (tensor)
    collective and is charged each other one, one after another; each communication stream runs its collectives one
    after another (a hierarchical one's inter-node stage; a calibrated group's queued share where it is smaller).
    The step ends after both. ``mc.autotune`` skips a candidate whose floor is above every step it must beat."""
    gpu = cluster.gpu
    dtype = compute_dtype or str(program.plan.plan.param_dtype).removeprefix("torch.")
    compute, streams, priced = 0.0, defaultdict(float), {}
    counted = [(a, issued_count(program, a)) for a in program.micro_step] + [(a, 1) for a in program.boundary
                                                                            if a.kind is not Kind.WAIT]
    for a, n in counted:
        if not n:
            continue
        if a.kind is Kind.COMPUTE:
            compute += n * compute_time_s(a, gpu, dtype)
            continue
        if a.kind in (Kind.PACK, Kind.REDUCE_SCATTER, Kind.ALL_REDUCE):
            compute += n * _pack_s(a.tensor_bytes, gpu)
        if a.kind not in COLLECTIVE_OF_KIND or a.group not in program.groups:
            continue
        kind = program.collective_of(a)
        key = (a.kind, a.tensor_bytes, a.group, a.hierarchical)
        if key not in priced:
            ranks = program.groups[a.group].ranks
            d = (hierarchical_stages_s(kind, a.tensor_bytes, ranks, cluster)[0] if a.hierarchical else
                 collective_time_s(kind, a.tensor_bytes, ranks, cluster))
            cost = cluster.collective_interference.get(str(len(ranks)))
            d *= _least_share(cost)
            priced[key] = d, _charge_s(cluster, cost, d) if d > 0 else 0.0
        d, charge = priced[key]
        if a.kind in BLOCKING and not a.hierarchical:
            compute += n * max(d, charge)
        else:
            compute += n * charge
            streams[a.group] += n * d
    return max(compute, *streams.values())


@dataclass(frozen=True)
class RuntimeCosts:
    """What a system's runtime spends that its Program's actions do not show: how it cuts its collectives, where
    it runs a hierarchical collective's local stages, the host's time per call, micro-step and step. The defaults
    are micscompile's own runtime; each peer supplies its own (``lowering.peers.Peer.runtime_costs``, read from
    its source: docs/peer-models.md)."""

    gather_pieces: Mapping[int, Sequence[int]] | None = None
    """bucket -> the bytes of the collectives its gather is issued as (a peer's fetch granularity), run one after
    the other on the group's stream; None: one collective of the whole bucket."""
    reduce_pieces: Mapping[int, Sequence[int]] | None = None
    """The same for a bucket's reduce-scatter (a peer's gradient buckets: empty where the bucket's gradients wait
    to be reduced with later ones)."""
    hierarchical_on_stream: bool = False
    """A hierarchical collective's reorder and intra-node stage run on its communication stream, not the compute
    stream."""
    replicate_every_micro_step: bool = False
    """Each reduce-scatter's shard is all-reduced over the replicate group right after it, every micro-step, on
    that group's stream (FSDP2's HSDP), and the boundary has no all-reduce of its own."""
    sync_at_fetch: bool = False
    """The host synchronizes the whole device when a fetched bucket's gather completes (a peer whose fetch ends in
    a device synchronize), so every reduction in flight finishes before the bucket computes."""
    copy_out_ops: Mapping[int, int] | None = None
    """bucket -> the copy kernels a peer runs on the compute stream at a gather's wait to copy the gathered bytes
    out into its parameters (FSDP2's ``split_with_sizes_copy``, DeepSpeed's ``torch.cat`` per parameter), each
    gathered byte read and written once."""
    host_per_micro_step_s: float = 0.0
    """Compute-stream time a peer's runtime adds per micro-step, spread over its gathers' waits (its hooks), where
    the host is the device (a CPU run; ``benchmarks/bench_peers.py --predict`` measures it at world size 1)."""
    host_per_step_s: float = 0.0
    """The same per step (its optimizer)."""
    grad_sync_after_backward: bool = False
    """The gradients' all-reduces over the replicas (the second hops) are issued once the step's last backward has
    computed, not as each bucket is reduced (Megatron-LM's ``allreduce_gradients`` after the whole backward)."""
    host_per_call_s: tuple[float, float] = (0.0, 0.0)
    """(gather, reduce-scatter) host time per collective call (per piece of ``gather_pieces`` / ``reduce_pieces``)
    on the compute stream before the call is launched: a peer whose host builds each call's per-rank tensor lists
    while the device is synchronized (DeepSpeed 2021)."""


MICSCOMPILE_RUNTIME = RuntimeCosts()
"""micscompile's own runtime: one collective per bucket, a hierarchical collective's local stages on the compute
stream, no host time beyond the ops' own."""
RUNTIME_COST_FIELDS = frozenset(f.name for f in fields(RuntimeCosts))
"""The keyword names ``mc.simulate`` takes as ``RuntimeCosts`` fields (what the caller gives wins over a peer's)."""

_SKIP = object()
"""A handler's answer for an action issued later (no span now)."""


def simulate_program(
    program: Program,
    cluster: Cluster,
    *,
    state_bytes_per_param: int = 16,
    optimizer_bytes_per_param: int = 28,
    buffer_bytes: int = 0,
    flops_per_step: float | None = None,
    compute_dtype: str | None = None,
    record: bool = True,
    accumulate: bool = True,
    runtime: RuntimeCosts = MICSCOMPILE_RUNTIME,
) -> Prediction:
    """Simulate ``program`` for one optimizer step on ``cluster``, in four phases (``_StepSimulation``):

    1. ``start_update_gathers``: the previous step's update gathers (``optimizer_sharding="world"``);
    2. ``run_micro_steps``: each micro-step's actions, each by its kind's handler (compute, gathers,
       reductions, second hops, waits, tensor collectives, releases), identical middle ones skipped ahead;
    3. ``issue_deferred_second_hops``: the second hops a runtime issues after its backward;
    4. ``run_boundary``: the loss all-reduce, the norm, the optimizer.

    Every collective is priced and enqueued by ``_StepSimulation.issue``: a new collective family joins with a
    handler in ``MICRO_STEP_HANDLERS`` (or ``BOUNDARY_HANDLERS``) and its pricing in ``cost_model.collective_time``.

    ``optimizer_bytes_per_param``: memory traffic of the optimizer step per shard element (AdamW reads param,
    grad, m, v and writes param, m, v: 7 x 4 bytes). ``compute_dtype`` prices matmuls at that dtype's peak
    (default: the Plan's param_dtype; a what-if such as fp16 peak for an fp32 Program otherwise).
    ``record=False`` (no timeline): once a middle micro-step starts in the state the previous one started in
    (times relative to its start), the remaining middle ones repeat it and are skipped ahead in one go, so a step
    of many micro-batches costs about four (equal to simulating each one up to float rounding). ``accumulate``:
    each micro-step ends in the gradients' accumulation into the shard accumulators (not for a pipeline chunk's
    forward half). ``runtime``: the system's runtime costs (micscompile's, or a peer's).
    """
    if runtime.replicate_every_micro_step:  # the peer all-reduces after every reduce-scatter instead
        program = program.without_second_hops()
    sim = _StepSimulation(program, cluster, runtime, record=record,
                          compute_dtype=compute_dtype or str(program.plan.plan.param_dtype).removeprefix("torch."),
                          state_bytes_per_param=state_bytes_per_param, buffer_bytes=buffer_bytes)
    sim.start_update_gathers()
    sim.run_micro_steps(accumulate)
    sim.issue_deferred_second_hops()
    sim.run_boundary(optimizer_bytes_per_param)
    return sim.prediction(flops_per_step)


class _StepSimulation:
    """One rank's step on a cluster, as clocks: the compute stream's time ``t``, each communication stream's
    ``stream_free``, each group's ``aligned`` (when its ranks were last together), the collectives in flight
    (``pending``, by the action kind and bucket their wait names), and the bytes alive (``static`` + ``dynamic``
    + ``activations``)."""

    __slots__ = ("program", "cluster", "runtime", "record", "gpu", "compute_dtype", "groups", "layouts",
                 "shard_numel", "opt_numel", "static", "t", "busy", "stream_free", "aligned", "waits_for_arrival",
                 "pending", "events", "memory", "dynamic", "activations", "peak", "exposed", "spans", "priced",
                 "slowing", "updates", "deferred", "host_s", "ends", "boundary_exposed", "micro_step_handlers",
                 "boundary_handlers", "optimizer_bytes_per_param")

    def __init__(self, program: Program, cluster: Cluster, runtime: RuntimeCosts, *, record: bool,
                 compute_dtype: str, state_bytes_per_param: int, buffer_bytes: int) -> None:
        self.program, self.cluster, self.runtime, self.record = program, cluster, runtime, record
        self.gpu, self.compute_dtype = cluster.gpu, compute_dtype
        self.groups, self.layouts = program.groups, program.layouts
        self.shard_numel = sum(lay.row_numel for lay in self.layouts)
        # optimizer_sharding="world": each rank keeps the optimizer state of, and steps, 1/d of its shard
        self.opt_numel = self.shard_numel // program.plan.optimizer_shards
        opt_state = min(OPTIMIZER_STATE_BYTES_PER_PARAM, state_bytes_per_param)
        self.static = (self.shard_numel * (state_bytes_per_param - opt_state) + self.opt_numel * opt_state
                       + buffer_bytes)
        self.t = 0.0
        self.busy: dict[str, float] = defaultdict(float)
        self.stream_free: dict[str, float] = defaultdict(float)
        self.aligned: dict[str, float] = defaultdict(float)
        self.waits_for_arrival = {name for name, g in self.groups.items()  # (only these groups' ``aligned`` matter)
                                  if cluster.collective_interference.get(str(g.size), {}).get("arrival_wait_s")}
        self.pending: dict[tuple[Kind, int | None], deque[_InFlight]] = defaultdict(deque)
        self.events: list[Event] = []
        self.memory: list[tuple[float, int]] = []
        self.dynamic = 0  # gathered + packed buckets
        self.activations = 0
        self.peak = self.static
        self.exposed = 0.0
        self.spans: dict[int, tuple[float, float, int]] = {}  # action index (micro-step, then boundary) -> its span
        self.priced: dict[tuple, tuple[float, float, float]] = {}  # (a step repeats few distinct collectives)
        self.slowing = 0  # collectives in flight that slow compute down
        self.updates: dict[int, float] = {}  # bucket -> when the previous step's update gather of it ends
        self.deferred: list[Action] = []  # second hops issued after the last backward (grad_sync_after_backward)
        self.host_s = 0.0  # a peer's host time per gather wait this micro-step (host_per_micro_step_s)
        self.ends: list[float] = []  # the boundary's collectives in flight
        self.boundary_exposed = 0.0
        self.optimizer_bytes_per_param = 0
        self.micro_step_handlers = {
            Kind.COMPUTE: self.on_compute, **dict.fromkeys(GATHERS, self.on_gather),
            **dict.fromkeys((Kind.REDUCE_SCATTER, Kind.ALL_REDUCE, Kind.PACK), self.on_reduce),
            Kind.SECOND_HOP: self.on_second_hop, Kind.WAIT: self.on_wait, **dict.fromkeys(BLOCKING, self.on_blocking),
            Kind.RELEASE: self.on_release, RUN: self.on_run}
        self.boundary_handlers = {
            Kind.LOSS_ALL_REDUCE: self.at_loss, Kind.UPDATE_GATHER: self.at_update, Kind.WAIT: self.at_wait,
            Kind.NORM_ALL_REDUCE: self.at_norm, Kind.OPTIMIZER: self.at_optimizer}

    # ---- the phases -------------------------------------------------------------------------------------------

    def start_update_gathers(self) -> None:
        """``optimizer_sharding="world"``, in the steady state: the previous step's update gathers run from this
        step's start (on the replicate stream); a bucket's first gather waits for its own (the runtime's
        ``collectives.settle``), a plan that gathers nothing for all of them, the optimizer for the rest."""
        program = self.program
        self.updates = {a.bucket: self.issue(a).end_s for a in program.boundary if a.kind is Kind.UPDATE_GATHER}
        if self.updates and not any(a.kind in GATHERS for a in program.micro_step):
            self.wait_until(max(self.updates.values()))
            self.updates.clear()

    def run_micro_steps(self, accumulate: bool) -> None:
        """Every micro-step's actions by their kinds' handlers, then the gradients' accumulation."""
        program, micro_batches, record = self.program, self.program.plan.micro_batches, self.record
        steps = program.micro_step if record or self.cluster.collective_interference else coalesced(
            program, self.cluster, self.compute_dtype)
        handlers = self.micro_step_handlers
        mb, seen = 0, None
        while mb < micro_batches:
            if not record and 1 <= mb < micro_batches - 1:  # exact: the same actions from the same state
                state = self.relative_state()
                if seen is not None and seen[0] == state:
                    self.fast_forward(micro_batches - 1 - mb, seen[1])
                    mb, seen = micro_batches - 1, None
                    continue
                seen = state, (self.t, dict(self.busy), self.exposed)
            if self.runtime.host_per_micro_step_s:
                self.spread_host_time(steps, mb)
            edge = mb == 0 or mb == micro_batches - 1  # (an action the first one skips: as the last runs it)
            for i, a in enumerate(steps):
                if not program.issues(a, mb):
                    continue
                start = self.t
                handler = handlers.get(a.kind)
                end = handler(a) if handler is not None else None
                if end is not _SKIP and edge:
                    self.note_span(start, self.t if end is None else end, i)
            if accumulate:
                self.run_compute(accumulate_time_s(self.shard_numel, self.gpu, len(self.layouts)), "accumulate")
            mb += 1

    def issue_deferred_second_hops(self) -> None:
        for a in self.deferred:
            self.pending[(a.kind, a.bucket)].append(self.issue(a))

    def run_boundary(self, optimizer_bytes_per_param: int) -> None:
        """The gradients' last reductions, the norm, the optimizer."""
        self.optimizer_bytes_per_param = optimizer_bytes_per_param
        for i, a in enumerate(self.program.boundary, start=len(self.program.micro_step)):
            start = self.t
            handler = self.boundary_handlers.get(a.kind)
            if handler is not None:
                self.note_span(start, handler(a), i)

    def prediction(self, flops_per_step: float | None) -> Prediction:
        program = self.program
        step = max([self.t, *self.stream_free.values()])
        charged = self.busy.pop("charged", 0.0)
        graph_flops = program.plan.micro_batches * sum(a.flops for a in program.micro_step)
        return Prediction(
            step_time_s=step, compute_s=self.busy["compute"], exposed_comm_s=self.exposed,
            stream_busy_s=dict(self.busy), peak_memory_bytes=int(self.peak), static_memory_bytes=int(self.static),
            flops_per_step=flops_per_step if flops_per_step is not None else graph_flops,
            world_size=program.plan.world_size, events=self.events, memory=self.memory,
            action_spans=[self.spans[i] for i in sorted(self.spans)], uncertainty=self.cluster.prediction_error,
            exposed_boundary_s=self.boundary_exposed, comm_charged_s=charged,
        )

    # ---- the clocks -------------------------------------------------------------------------------------------

    def note_memory(self, extra: int = 0) -> None:
        now = self.static + self.dynamic + extra
        self.peak = max(self.peak, now)
        if self.record:
            self.memory.append((self.t, now))

    def note_span(self, start: float, end: float, index: int) -> None:
        if self.record and index not in self.spans:
            self.spans[index] = (start, end, self.static + self.dynamic + self.activations)

    def run_compute(self, duration: float, name: str) -> None:
        if self.record and duration > 0:
            self.events.append(Event("compute", name, self.t, self.t + duration))
        self.t += duration
        self.busy["compute"] += duration

    def run_compute_beside_collectives(self, duration: float, name: str) -> None:
        """Compute, slowed by each collective in flight (issued, not yet done) up to that collective's maximum."""
        extra = 0.0
        for queue in self.pending.values() if self.slowing else ():  # (none slow compute uncalibrated)
            for c in queue:
                if c.end_s <= self.t:
                    continue  # done (a second hop is waited for only at the boundary)
                take = min(c.slowdown * duration, c.slowdown_left_s)
                c.slowdown_left_s -= take
                extra += take
        self.run_compute(duration, name)
        if extra > 0:
            self.run_compute(extra, "slowed by collectives in flight")

    def wait_until(self, end: float) -> None:
        if end > self.t:
            self.exposed += end - self.t
            self.t = end

    def enqueue(self, stream: str, duration: float, what: object, ready_s: float) -> float:
        """Run ``duration`` on ``stream`` from ``ready_s`` or when the stream frees up; returns its end."""
        start = max(ready_s, self.stream_free[stream])
        self.stream_free[stream] = start + duration
        self.busy[stream] += duration
        if self.record and duration > 0:
            self.events.append(Event(stream, str(what), start, start + duration))
        return start + duration

    def charge_exposed(self, cost: dict[str, float] | None, duration: float, what: object) -> dict[str, float] | None:
        """Charge the compute stream a collective's exposed share: the calibrated ``cost``'s, else
        ``(1 - overlap) * duration + collective_overhead_s``; returns ``cost``."""
        charge = _charge_s(self.cluster, cost, duration)
        self.run_compute(charge, f"comm cpu {what}" if self.record else "")
        self.busy["charged"] += charge  # (in busy so that skipping middle micro-steps scales it too)
        return cost

    def arrival_wait_s(self, cost: dict[str, float] | None, since_s: float) -> float:
        """How long the group's last rank is expected to arrive after this one, ``since_s`` of compute after the
        group's ranks were last together (its previous collective's end): calibrated."""
        if cost is None or since_s <= 0 or not cost.get("arrival_wait_s"):
            return 0.0
        return cost["arrival_wait_s"] * (since_s / 1e-3) ** cost.get("arrival_exponent", 0.5)

    def price(self, a: Action, pieces: Sequence[int] | None) -> tuple[float, float, float]:
        """(duration on the stream, reorder, intra-node stage) of ``a``, issued whole or as ``pieces``."""
        key = (a.kind, a.tensor_bytes if pieces is None else tuple(pieces), a.group, a.hierarchical)
        if key not in self.priced:
            kind, ranks, cluster = self.program.collective_of(a), self.groups[a.group].ranks, self.cluster
            stages = [hierarchical_stages_s(kind, b, ranks, cluster) if a.hierarchical else
                      (collective_time_s(kind, b, ranks, cluster), 0.0, 0.0)
                      for b in ((a.tensor_bytes,) if pieces is None else pieces)]
            self.priced[key] = tuple(sum(s) for s in zip(*stages)) if stages else (0.0, 0.0, 0.0)
        return self.priced[key]

    def issue(self, a: Action, frees_bytes: int = 0) -> _InFlight:
        """Enqueue ``a`` on its stream and charge compute its exposed share. A hierarchical collective's
        inter-node stage is what runs on the stream; its reorder and intra-node stage run on the compute stream
        (at the wait for a gather, before the issue for a reduce-scatter), as collectives.py runs them."""
        runtime = self.runtime
        group = self.groups[a.group]
        cost = self.cluster.collective_interference.get(str(group.size))
        gather = a.kind in GATHERS
        by_bucket = runtime.gather_pieces if gather else runtime.reduce_pieces if a.kind is Kind.REDUCE_SCATTER \
            else None
        pieces = by_bucket.get(a.bucket) if by_bucket else None
        duration, reorder, intra = self.price(a, pieces)
        host_s = runtime.host_per_call_s[0] if gather else runtime.host_per_call_s[1] \
            if a.kind is Kind.REDUCE_SCATTER else 0
        if host_s:  # (the host's loops over the group's ranks, one call after another)
            self.run_compute(host_s * (1 if pieces is None else len(pieces)), (f"host {a}" if self.record else ""))
        finish_s = 0.0
        if a.hierarchical and runtime.hierarchical_on_stream:
            duration, reorder, intra = duration + reorder + intra, 0.0, 0.0
        if a.hierarchical:
            if a.kind is Kind.REDUCE_SCATTER:
                self.run_compute(reorder + intra, (f"intra-node {a}" if self.record else ""))
            else:
                finish_s = reorder + intra
        if cost is not None and any(c.group == a.group and c.end_s > self.t
                                    for queue in self.pending.values() for c in queue):
            duration *= cost.get("queued_fraction", 1.0)  # shares the group's threads with one still running
        ready = self.t + self.arrival_wait_s(cost, self.t - self.aligned[a.group])
        flight = _InFlight(self.enqueue(f"comm:{a.group}", duration, a, ready), a.group, frees_bytes,
                           finish_s=finish_s)
        if duration <= 0:
            return flight
        self.aligned[a.group] = flight.end_s
        if self.charge_exposed(cost, duration, a) is None:
            return flight
        flight.slowdown, flight.slowdown_left_s = cost["slowdown"], cost["max_slowdown_s"]
        self.slowing += flight.slowdown > 0
        return flight

    def all_reduce_after(self, ready_s: float, nbytes: int) -> float:
        """An all-reduce of ``nbytes`` over the replicate group once ``ready_s`` has passed, on its stream,
        charging compute what ``issue`` charges a collective; returns when it ends."""
        ranks = self.groups["replicate"].ranks
        key = ("replicate", nbytes)
        if key not in self.priced:
            self.priced[key] = (collective_time_s("all_reduce", nbytes, ranks, self.cluster), 0.0, 0.0)
        duration = self.priced[key][0]
        end = self.enqueue("comm:replicate", duration, "all_reduce after reduce_scatter", ready_s)
        if duration > 0:
            self.charge_exposed(self.cluster.collective_interference.get(str(len(ranks))), duration,
                                "all_reduce after reduce_scatter")
        return end

    def spread_host_time(self, steps: list, mb: int) -> None:
        """A peer's host time per micro-step, spread over the gathers' waits (at the start without any)."""
        waits = sum(a.kind is Kind.WAIT and a.waits_for in GATHERS and self.program.issues(a, mb) for a in steps)
        self.host_s = self.runtime.host_per_micro_step_s / max(waits, 1)
        if not waits:
            self.run_compute(self.runtime.host_per_micro_step_s, "host")

    def relative_state(self) -> tuple:
        """Everything the rest of the step depends on, relative to now (``fast_forward``)."""
        t = self.t
        flights = tuple((key, tuple((round(f.end_s - t, 12), f.group, f.frees_bytes, f.finish_s, f.slowdown,
                                     round(f.slowdown_left_s, 12)) for f in q))
                        for key, q in sorted(self.pending.items(), key=str) if q)
        streams = tuple((k, round(max(v - t, 0.0), 12)) for k, v in sorted(self.stream_free.items()))
        together = tuple((k, round(v - t, 12)) for k, v in sorted(self.aligned.items()) if k in self.waits_for_arrival)
        return self.dynamic, self.activations, flights, streams, together

    def fast_forward(self, steps: int, before: tuple) -> None:
        """Every middle micro-step repeats the one just simulated (it started in the same relative state): advance
        the clocks, streams and counters by ``steps`` more of it."""
        t0, busy0, exposed0 = before
        period = self.t - t0
        self.t += steps * period
        self.exposed += steps * (self.exposed - exposed0)
        for k in list(self.busy):
            self.busy[k] += steps * (self.busy[k] - busy0.get(k, 0.0))
        for k in self.stream_free:
            self.stream_free[k] += steps * period
        for k in self.aligned:
            self.aligned[k] += steps * period
        for queue in self.pending.values():
            for f in queue:
                f.end_s += steps * period

    # ---- a micro-step's actions, by kind ------------------------------------------------------------------------

    def on_compute(self, a: Action) -> None:
        self.note_memory(a.activation_peak_bytes)
        self.run_compute_beside_collectives(compute_time_s(a, self.gpu, self.compute_dtype), a.region)
        self.activations = a.activation_bytes

    def on_gather(self, a: Action) -> float:
        if a.bucket in self.updates:
            self.wait_until(self.updates.pop(a.bucket))
        self.dynamic += a.tensor_bytes
        self.note_memory(self.activations)
        flight = self.issue(a)
        copies = self.runtime.copy_out_ops
        if copies is not None and a.bucket in copies:
            pieces = self.runtime.gather_pieces.get(a.bucket) if self.runtime.gather_pieces else None
            gathered = a.tensor_bytes if pieces is None else sum(pieces)
            flight.finish_s += _memory_time_s(2 * gathered, self.gpu, ops=copies[a.bucket])
        self.pending[(Kind.ALL_GATHER, a.bucket)].append(flight)  # a next-gather is waited for next micro-step
        return flight.end_s

    def on_reduce(self, a: Action) -> float | None:
        self.run_compute(_pack_s(a.tensor_bytes, self.gpu), (f"pack {a}" if self.record else ""))
        self.dynamic += a.tensor_bytes
        self.note_memory(self.activations)
        if a.kind is Kind.PACK:
            self.dynamic -= a.tensor_bytes  # consumed by accumulation right away
            return None
        flight = self.issue(a, frees_bytes=a.tensor_bytes)
        if self.runtime.replicate_every_micro_step and a.kind is Kind.REDUCE_SCATTER and "replicate" in self.groups:
            flight.end_s = self.all_reduce_after(flight.end_s, a.tensor_bytes // self.groups[a.group].size)
        self.pending[(a.kind, a.bucket)].append(flight)
        return flight.end_s

    def on_second_hop(self, a: Action):
        if self.runtime.grad_sync_after_backward:
            self.deferred.append(a)
            return _SKIP
        flight = self.issue(a)
        self.pending[(a.kind, a.bucket)].append(flight)  # waited at the boundary
        return flight.end_s

    def on_wait(self, a: Action) -> None:
        flight = self.pending[(a.waits_for, a.bucket)].popleft()
        self.slowing -= flight.slowdown > 0
        self.wait_until(flight.end_s)
        gather = a.waits_for in GATHERS
        if self.runtime.host_per_micro_step_s and gather:
            self.run_compute(self.host_s, "host")
        if self.runtime.sync_at_fetch and gather:  # (the reductions stay queued for their own waits)
            self.wait_until(max((f.end_s for (kind, _), queue in self.pending.items() if kind not in GATHERS
                                 for f in queue), default=self.t))
        self.dynamic -= flight.frees_bytes
        if flight.finish_s > 0:
            self.run_compute(flight.finish_s, (f"after {a}" if self.record else ""))

    def on_run(self, a: _Run) -> None:  # (``coalesced``: no timeline, no interference)
        if a.activation_peak_bytes is not None:
            self.note_memory(a.activation_peak_bytes)
            self.activations = a.activation_bytes
        self.t += a.time_s
        self.busy["compute"] += a.compute_s
        self.busy["charged"] += a.charged_s
        self.exposed += a.exposed_s
        for stream, d in a.comm:
            self.busy[stream] += d
            self.stream_free[stream] = self.t

    def on_blocking(self, a: Action) -> float:  # a tensor collective: the next op reads it
        end = self.issue(a).end_s
        self.wait_until(end)
        return end

    def on_release(self, a: Action) -> None:
        self.dynamic -= a.tensor_bytes
        self.note_memory(self.activations)

    # ---- the boundary's actions, by kind ------------------------------------------------------------------------

    def wait_boundary(self, end: float) -> None:
        before = self.exposed
        self.wait_until(end)
        self.boundary_exposed += self.exposed - before

    def at_loss(self, a: Action) -> float:
        self.ends.append(self.issue(a).end_s)  # nothing computes beside them: no slowdown
        return self.ends[-1]

    def at_update(self, a: Action) -> float:  # issued at the step's start (the previous step's)
        return self.t

    def at_wait(self, a: Action) -> float:  # a second hop started in the last micro-step
        flight = self.pending[(a.waits_for, a.bucket)].popleft()
        self.slowing -= flight.slowdown > 0
        self.ends.append(flight.end_s)
        return self.t

    def at_norm(self, a: Action) -> float:  # the norm of the summed gradients: after the sums
        self.wait_boundary(max(self.ends, default=self.t))
        self.ends[:] = [self.issue(a).end_s]
        return self.ends[-1]

    def at_optimizer(self, a: Action) -> float:
        self.wait_boundary(max([*self.ends, *self.updates.values()], default=self.t))
        gpu, n_params = self.gpu, sum(len(lay.slots) for lay in self.layouts)
        if gpu.optimizer_param_s is not None and gpu.optimizer_element_s is not None:
            opt_s = n_params * gpu.optimizer_param_s + self.opt_numel * gpu.optimizer_element_s
        else:
            opt_s = _memory_time_s(self.optimizer_bytes_per_param * self.opt_numel, gpu, ops=10 * n_params)
        self.run_compute(opt_s + self.runtime.host_per_step_s, "optimizer")
        return self.t
