"""The Program: one rank's ordered actions for one optimizer step.

Lowered from the rewritten graph: each collective node becomes an action, each run
of compute nodes between them one COMPUTE action; the micro-step list repeats
``micro_batches`` times, then the boundary actions (loss all-reduce, the waits for the
second hops, optimizer step) run once. The graph's node order *is* the order the
runtime executes, so the Program is an exact description, not an estimate.

Short codes (``str(action)``): ``AG3`` issue all-gather of bucket 3, ``W:AG3`` wait
for it, ``REL3`` release it, ``AGN3`` issue the next micro-step's all-gather of bucket
3 (not on the last micro-step), ``AGC3`` the all-gather ``AGN3`` issued (issued here
only on the first micro-step), ``RS3``/``AR3`` reduce-scatter / all-reduce bucket 3's
gradients, ``PK3`` add them straight into the accumulator (p = 1), ``SH3`` start bucket
3's second hop (2-hop, d > 1: its accumulated shard all-reduced over the replication group;
last micro-step only, a pipeline chunk's last backward, waited at the boundary as ``W:SH3``),
``C`` compute, ``ARL`` loss all-reduce, ``OPT`` optimizer step; ``TAR``/``TAG``/``TRS`` a tensor-parallel
all-reduce / all-gather / reduce-scatter of an activation or its gradient (blocking, on the compute's path).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from micscompile.core import collectives as C
from micscompile.core.collectives import CommStats, GroupInfo, fmt_bytes
from micscompile.core.errors import Error, InputError
from micscompile.core.plan import ResolvedPlan
from micscompile.core.sharding import BucketLayout

REGION_FWD = "fwd"
REGION_BWD = "bwd"
"""The phase in a node's ``META_REGION`` (trace) and an action's ``region``: forward or backward."""


@dataclass(frozen=True)
class Prefetch:
    """Where the gathers of one Program go (lowering.flat picks one under the budget)."""

    distance: int = 1
    """Issue each gather this many use intervals ahead of its use (0: right before its wait)."""
    keep_live: int = 0
    """This many buckets, those used last in forward first, keep their forward gather live into
    their first backward use instead of being released and gathered again."""
    across_micro_steps: bool = False
    """The first ``distance`` gathers of micro-step i+1 are issued during the tail of micro-step i's
    backward (the parameters do not change between micro-steps), not at the start of i+1."""

    def __post_init__(self) -> None:
        for name in ("distance", "keep_live"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"Prefetch.{name} must be an int >= 0, got {value!r}")

    def __str__(self) -> str:
        extra = f", {self.keep_live} kept live into backward" if self.keep_live else ""
        extra += ", across micro-steps" if self.across_micro_steps else ""
        return f"prefetch {self.distance}{extra}"


class Kind(enum.Enum):
    COMPUTE = "C"
    ALL_GATHER = "AG"
    ALL_GATHER_NEXT = "AGN"
    WAIT = "W"
    RELEASE = "REL"
    REDUCE_SCATTER = "RS"
    ALL_REDUCE = "AR"
    PACK = "PK"
    SECOND_HOP = "SH"
    LOSS_ALL_REDUCE = "ARL"
    NORM_ALL_REDUCE = "ARN"
    OPTIMIZER = "OPT"
    UPDATE_GATHER = "AGU"
    """``optimizer_sharding="world"``: after the optimizer, a bucket's updated shard all-gathered over the replicas."""
    TENSOR_ALL_REDUCE = "TAR"
    """Tensor parallelism (``lowering.tensor_split``): a partial activation or gradient summed over the tensor
    group, on the compute's path (blocking: the next op reads it)."""
    TENSOR_ALL_GATHER = "TAG"
    """Tensor parallelism: a split value made whole on every tensor rank, on the compute's path."""
    TENSOR_REDUCE_SCATTER = "TRS"
    """Sequence parallelism: a partial value summed over the tensor group, each rank keeping its piece of
    the sequence, on the compute's path (``tensor_bytes``: the whole value's)."""
    CONTEXT_ALL_TO_ALL = "CA2A"
    """Context parallelism (``lowering.context_split``): Ulysses' all-to-all over the context group, between a
    split over the sequence and one over the heads, on the compute's path (``tensor_bytes``: one rank's buffer)."""

    __hash__ = object.__hash__  # (members are singletons: identity, not Enum's hash of the name in Python, which
    # mc.autotune's schedule and Program simulations call tens of millions of times)


ISSUE_KIND = {
    C.all_gather_issue: Kind.ALL_GATHER,
    C.all_gather_carried: Kind.ALL_GATHER,
    C.all_gather_next: Kind.ALL_GATHER_NEXT,
    C.reduce_scatter_issue: Kind.REDUCE_SCATTER,
    C.all_reduce_issue: Kind.ALL_REDUCE,
    C.accumulate_local: Kind.PACK,
    C.second_hop: Kind.SECOND_HOP,
    C.release: Kind.RELEASE,
}
COLLECTIVE_OF_KIND = {
    Kind.ALL_GATHER: C.ALL_GATHER, Kind.ALL_GATHER_NEXT: C.ALL_GATHER, Kind.REDUCE_SCATTER: C.REDUCE_SCATTER,
    Kind.ALL_REDUCE: C.ALL_REDUCE, Kind.LOSS_ALL_REDUCE: C.ALL_REDUCE, Kind.NORM_ALL_REDUCE: C.ALL_REDUCE,
    Kind.SECOND_HOP: C.ALL_REDUCE, Kind.UPDATE_GATHER: C.ALL_GATHER,
    Kind.TENSOR_ALL_REDUCE: C.ALL_REDUCE, Kind.TENSOR_ALL_GATHER: C.ALL_GATHER,
    Kind.TENSOR_REDUCE_SCATTER: C.REDUCE_SCATTER, Kind.CONTEXT_ALL_TO_ALL: C.ALL_TO_ALL,
}
TENSOR_KIND = {C.tensor_all_reduce: Kind.TENSOR_ALL_REDUCE, C.tensor_all_gather: Kind.TENSOR_ALL_GATHER,
               C.tensor_reduce_scatter: Kind.TENSOR_REDUCE_SCATTER}
"""The tensor-parallel collectives of a split graph, each an action of its own."""
CONTEXT_KIND = {C.context_to_heads: Kind.CONTEXT_ALL_TO_ALL, C.context_to_tokens: Kind.CONTEXT_ALL_TO_ALL}
"""The context-parallel collectives of a split graph, each an action of its own."""
BLOCKING_KIND = {**TENSOR_KIND, **CONTEXT_KIND}
"""Every collective a split graph runs on the compute's path, by its op."""
GROUP_OF_BLOCKING = {**dict.fromkeys(TENSOR_KIND.values(), "tensor"), Kind.CONTEXT_ALL_TO_ALL: "context"}
"""The group each blocking kind runs over."""
BLOCKING = frozenset(BLOCKING_KIND.values())
"""Collectives done when their action is: nothing waits for them later."""
"""The collective each communicating action kind issues (what it costs and how it is counted)."""


Amount = int | np.ndarray
"""FLOPs or bytes of a COMPUTE action: an int; in a Program lowered over several micro-batch sizes
at once (``tune.repricing``), a numpy array with one value per size, until ``repricing.at_index``
picks one size's ints (only such a Program is simulated or run)."""


class Action(NamedTuple):
    kind: Kind
    bucket: int | None = None
    waits_for: Kind | None = None
    """For WAIT: the kind of collective waited on."""
    group: str | None = None
    """Group name ("shard", "replicate", "world") for collectives."""
    tensor_bytes: int = 0
    """Size of the full buffer a collective works on."""
    ops: int = 0
    flops: Amount = 0
    """All FLOPs of a COMPUTE action (what TFLOP/s counts)."""
    matmul_flops: Amount = 0
    """FLOPs of matmul-class ops (priced at matmul throughput)."""
    mem_bytes: Amount = 0
    """Bytes read + written by the other ops (priced at memory bandwidth)."""
    activation_bytes: Amount = 0
    """Activations alive at the end of the action."""
    activation_peak_bytes: Amount = 0
    """Most activation bytes alive during the action."""
    measured_s: float | None = None
    """Profiled time of the action's ops (profile mode), preferred to the roofline estimate."""
    region: str = ""
    """COMPUTE: phase:block of its first (.. last) node; a collective: the phase it serves."""
    hierarchical: bool = False
    """ALL_GATHER / ALL_GATHER_NEXT / REDUCE_SCATTER in two stages, over the "inter" and "intra" groups."""
    carried: bool = False
    """For ALL_GATHER: after the first micro-step, the previous micro-step's ALL_GATHER_NEXT of
    this bucket issued it (the action issues nothing then)."""
    weight: bool = False
    """A zero-bubble pipeline's backward action of W, its weight-gradient phase (``passes.weight_split``;
    the others are B's)."""

    def __str__(self) -> str:
        if self.kind is Kind.WAIT:
            return f"W:{self.waits_for.value}{self.bucket}"
        if self.carried:
            return f"AGC{self.bucket}" + ("h" if self.hierarchical else "")
        if self.hierarchical:
            return f"{self.kind.value}{self.bucket}h"
        if self.kind in (Kind.COMPUTE, Kind.OPTIMIZER, Kind.LOSS_ALL_REDUCE, Kind.NORM_ALL_REDUCE):
            return self.kind.value
        return f"{self.kind.value}{self.bucket}"


def hierarchical_stages(a: Action, groups: dict[str, GroupInfo]) -> list[Action]:
    """A hierarchical gather: across nodes (1/k of the buffer), then inside the node (all of it);
    a hierarchical reduce-scatter: inside the node, then across nodes (collectives.py)."""
    k = groups["intra"].size
    inter = a._replace(group="inter", tensor_bytes=a.tensor_bytes // k, hierarchical=False)
    intra = a._replace(group="intra", hierarchical=False)
    return [intra, inter] if a.kind is Kind.REDUCE_SCATTER else [inter, intra]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def backward_start(actions: list[Action]) -> int | None:
    """Index of the first backward action (compute actions never span both phases: build_program)."""
    return next((i for i, a in enumerate(actions) if a.region.startswith(REGION_BWD)), None)


class ProgramError(Error, RuntimeError):
    """A Program the runtime could not execute (a bug in a pass, not bad user input)."""


@dataclass
class Program:
    """Per-rank ordered actions: ``micro_step`` x micro_batches, then ``boundary``."""

    rank: int
    plan: ResolvedPlan
    layouts: tuple[BucketLayout, ...]
    groups: dict[str, GroupInfo]
    micro_step: list[Action]
    boundary: list[Action]
    cluster: Any = None
    """The ``cost_model.specs.Cluster`` it was scheduled for (lowering.flat); prices ``predict`` and ``print``."""
    prefetch: Prefetch | None = None
    """Where the schedule put the gathers."""
    choice: str = ""
    """How the schedule was chosen (``lowering.flat``): what was priced, and the choice's predicted gain;
    one line per choice (``note_choice``)."""
    pricer: Callable[..., Any] | None = None
    """``pricer(program, cluster, **costs)`` -> a ``cost_model.simulator.Prediction``: the lowering that
    built the Program hands it the cost model (core imports nothing above it, docs/design.md#layering)."""

    def note_choice(self, line: str, *, first: bool = False) -> None:
        """Add a line to ``choice`` (``first``: above the others)."""
        lines = [line, self.choice] if first else [self.choice, line]
        self.choice = "\n".join(x for x in lines if x)

    def issued_in(self, mb: int) -> list[Action]:
        """The actions micro-step ``mb`` runs: carried gathers are skipped after the first micro-step
        (the previous one's ALL_GATHER_NEXT issued them), next-gathers on the last, second hops on
        every other."""
        return [a for a in self.micro_step if self.issues(a, mb)]

    def issues(self, a: Action, mb: int) -> bool:
        """Whether micro-step ``mb`` runs ``a`` (``issued_in``)."""
        last = mb == self.plan.micro_batches - 1
        return not (a.carried and mb > 0) and not (a.kind is Kind.ALL_GATHER_NEXT and last) \
            and not (a.kind is Kind.SECOND_HOP and not last)

    def without_second_hops(self) -> Program:
        """The Program without its second hops (and their boundary waits): a cluster of one partition
        group, or a peer that all-reduces over the replicas after every reduce-scatter."""
        def keep(a: Action) -> bool:
            return Kind.SECOND_HOP not in (a.kind, a.waits_for)
        return dataclasses.replace(self, micro_step=[a for a in self.micro_step if keep(a)],
                                   boundary=[a for a in self.boundary if keep(a)])

    def _distinct_micro_steps(self) -> list[int]:
        """The first, a middle and the last micro-step: every other one repeats the middle one."""
        s = self.plan.micro_batches
        return sorted({0, min(1, s - 1), s - 1})

    def _walk(self):
        """(action, gathered bytes live after it, gathers in flight after it) over the first, a
        middle and the last micro-step (any other micro-step repeats a middle one)."""
        live, flight = 0, 0
        for mb in self._distinct_micro_steps():
            for a in self.issued_in(mb):
                if a.kind in (Kind.ALL_GATHER, Kind.ALL_GATHER_NEXT):
                    live, flight = live + a.tensor_bytes, flight + 1
                elif a.kind is Kind.RELEASE:
                    live -= a.tensor_bytes
                elif a.kind is Kind.WAIT and a.waits_for is Kind.ALL_GATHER:
                    flight -= 1
                yield a, live, flight

    @property
    def peak_gathered_bytes(self) -> int:
        """Most gathered-parameter bytes live at once (issue to release), over all micro-steps."""
        return max((live for _, live, _ in self._walk()), default=0)

    @property
    def regathered_buckets(self) -> frozenset[int]:
        """Buckets gathered again in backward (what ``Prefetch.keep_live`` can keep from forward)."""
        return frozenset(a.bucket for a in self.micro_step if a.kind is Kind.ALL_GATHER and a.region == REGION_BWD)

    @property
    def max_gathers_in_flight(self) -> int:
        """Most all-gathers issued and not yet waited for at once."""
        return max((flight for _, _, flight in self._walk()), default=0)

    def collective_order(self) -> list[str]:
        """Every collective one optimizer step issues, in order, as ``kind:group:bytes``. Every rank
        of a group must issue that group's collectives in the same order; ``mc.compile`` checks
        that all ranks hold the same list before the first collective of a step."""
        return [f"{self.collective_of(a)}:{a.group}:{a.tensor_bytes}" for a in self.collectives()]

    def collective_of(self, a: Action) -> str:
        """The collective ``a`` issues. The replicas' reduction (the second hop) is a reduce-scatter with
        ``optimizer_sharding="world"``: each rank then steps its 1/d of the shard, and ``UPDATE_GATHER``
        all-gathers the result."""
        if a.kind is Kind.SECOND_HOP and self.plan.optimizer_shards > 1:
            return C.REDUCE_SCATTER
        return COLLECTIVE_OF_KIND[a.kind]

    def collectives(self) -> list[Action]:
        """The collectives of one optimizer step, every micro-step expanded, in issue order; a
        hierarchical one as its two stages (group "inter" or "intra", that stage's buffer). A gather
        over one rank (p = 1 with mixed precision: only the cast to param_dtype) is none."""
        steps = [a for mb in range(self.plan.micro_batches) for a in self.issued_in(mb)]
        out = []
        for a in steps + self.boundary:
            cast_only = a.kind in (Kind.ALL_GATHER, Kind.ALL_GATHER_NEXT) and self.groups[a.group].size == 1
            if a.kind in COLLECTIVE_OF_KIND and not cast_only:
                out += hierarchical_stages(a, self.groups) if a.hierarchical else [a]
        return out

    def with_step_reductions(self, counted_loss: bool, grad_norm: bool) -> Program:
        """The boundary as the step runs it: the loss all-reduce carries (loss sum, count) with a
        counted loss (8 bytes), and the gradient norm's all-reduce over the world (4 bytes) follows
        the 2-hop all-reduce when the step clips or scales an fp16 loss (``runtime.step``)."""
        boundary = [a._replace(tensor_bytes=8) if a.kind is Kind.LOSS_ALL_REDUCE and counted_loss else a
                    for a in self.boundary]
        if grad_norm:
            boundary.insert(len(boundary) - 1, Action(Kind.NORM_ALL_REDUCE, group="world", tensor_bytes=4))
        return dataclasses.replace(self, boundary=boundary)

    def validate(self) -> None:
        """Raise ProgramError unless every micro-step waits for each collective it issued, after
        issuing it, uses gathered buckets only between wait and release, and ends with nothing
        gathered but what it carries to the next micro-step, and the boundary waits for the second hops."""
        pending: dict[tuple, int] = {}
        gathered: dict[int, int] = {}  # bucket -> gathers waited and not released
        for mb in self._distinct_micro_steps():
            actions = self.issued_in(mb)
            for i, a in enumerate(actions):
                where = f"micro-step {mb}, action {i} ({a})"
                if a.kind in COLLECTIVE_OF_KIND and a.kind not in BLOCKING:
                    key = (Kind.ALL_GATHER if a.kind is Kind.ALL_GATHER_NEXT else a.kind, a.bucket)
                    pending[key] = pending.get(key, 0) + 1
                elif a.kind is Kind.WAIT:
                    key = (a.waits_for, a.bucket)
                    if not pending.get(key):
                        raise ProgramError(f"{where}: waits for a collective that was not issued")
                    pending[key] -= 1
                    if a.waits_for is Kind.ALL_GATHER:
                        gathered[a.bucket] = gathered.get(a.bucket, 0) + 1
                elif a.kind is Kind.RELEASE:
                    if not gathered.get(a.bucket):
                        raise ProgramError(f"{where}: releases a bucket that is not gathered")
                    gathered[a.bucket] -= 1
            carry = sum(1 for a in actions if a.kind in (Kind.ALL_GATHER_NEXT, Kind.SECOND_HOP))
            left = sum(pending.values())
            if left != carry or any(gathered.values()):
                raise ProgramError(f"micro-step {mb} ends with {left} collectives not waited for "
                                   f"({carry} carried to the next or the boundary) and gathered buckets "
                                   f"{sorted(b for b, n in gathered.items() if n)} not released")
        hops = sorted(a.bucket for a in self.micro_step if a.kind is Kind.SECOND_HOP)
        if hops != sorted(a.bucket for a in self.boundary if a.waits_for is Kind.SECOND_HOP):
            raise ProgramError(f"the boundary does not wait for exactly the second hops of buckets {hops}")

    def fingerprint(self) -> str:
        return digest("|".join(map(repr, self.micro_step + self.boundary)) + repr(self.plan.plan))

    def collective_fingerprint(self) -> str:
        return digest("|".join(self.collective_order()))

    def comm_stats(self, stats: CommStats | None = None) -> CommStats:
        """One step's collectives as ``step.comm_stats()`` counts them once run: calls and wire
        bytes per (collective, group), intra- and inter-node (predicted, no process group).
        ``stats``: add them to these (a pipeline rank's chunks together)."""
        stats = CommStats() if stats is None else stats
        for a in self.collectives():
            rings = self.groups["intra"].size if a.group == "inter" else 1  # k rings share the node's NICs
            stats.record(self.collective_of(a), self.groups[a.group], a.tensor_bytes, parallel_rings=rings)
        return stats

    def wire_bytes(self) -> dict[tuple[str, str], int]:
        """Predicted per-rank wire bytes per (collective, group) for one step."""
        return {key: row.bytes for key, row in self.comm_stats().rows.items()}

    def predict(self, cluster=None, **costs):
        """Simulate this Program on ``cluster`` (default: the one it was scheduled for)."""
        cluster = cluster or self.cluster
        if cluster is None:
            raise InputError("no cluster to price the Program on: pass one (e.g. Cluster.preset('local'))")
        if self.pricer is None:
            raise InputError("this Program was built without the cost model: price it with "
                             "micscompile.cost_model.simulator.simulate_program(program, cluster)")
        return self.pricer(self, cluster, **costs)

    def to_chrome_trace(self, path, cluster=None) -> None:
        """A Perfetto-loadable timeline of one step: compute and comm tracks, memory counter."""
        self.predict(cluster).to_chrome_trace(path)

    def __str__(self) -> str:
        rp = self.plan
        pred = self.predict() if self.cluster is not None else None
        head = (
            f"micscompile Program  rank {self.rank}/{rp.world_size}  {rp}  "
            f"{len(self.layouts)} buckets, peak gathered {fmt_bytes(self.peak_gathered_bytes)}"
        )
        if self.prefetch is not None:
            head += f", {self.prefetch}, at most {self.max_gathers_in_flight} gathers in flight"
        if pred is not None:
            head += f"\npredicted on {self.cluster.name}: {pred.step_time_s * 1e3:.3f} ms per step, " \
                    f"exposed comm {pred.exposed_comm_s * 1e3:.3f} ms"
        if self.choice:
            head += f"\n{self.choice}"
        timing = f"{'start ms':>10}{'end ms':>10}{'live':>11}  " if pred is not None else ""
        cols = f"{'#':>4}  {timing}{'action':<8}{'bucket':<22}{'group':<18}{'bytes':>12}  detail"
        lines = [head, cols, "-" * len(cols)]
        spans = iter(pred.action_spans if pred is not None else ())

        def row(i: str, a: Action) -> str:
            bucket = self.layouts[a.bucket].name if a.bucket is not None else ""
            group = self.groups[a.group].label() if a.group else ""
            size = fmt_bytes(a.tensor_bytes) if a.tensor_bytes else ""
            detail = f"{a.ops} ops, {a.flops / 1e6:.2f} MFLOP  {a.region}" if a.kind is Kind.COMPUTE else ""
            span = next(spans, None)
            when = f"{span[0] * 1e3:>10.3f}{span[1] * 1e3:>10.3f}{fmt_bytes(span[2]):>11}  " if span else ""
            return f"{i:>4}  {when}{str(a):<8}{bucket[:21]:<22}{group[:17]:<18}{size:>12}  {detail}"

        lines += [row(str(i), a) for i, a in enumerate(self.micro_step)]
        lines.append(f"      ... the micro-step above runs {rp.micro_batches}x, then at the boundary:")
        lines += [row(f"B{i}", a) for i, a in enumerate(self.boundary)]
        return "\n".join(lines)
