"""The partition size priced on a cluster: what ``micscompile plan`` takes when no ``-p`` is given.

The thesis takes "the smallest number of nodes that allow us to train" (section 3.5.1) and finds
the smallest group fastest (section 3.5.2.1: p=8 is 1.6x p=64 for BERT 10B), with gradient
accumulation amortizing the all-reduce over the replicas. Without it (one micro-batch per step)
that all-reduce carries the whole model through each node's NICs every step and can outlast the
backward (gpt:13b on 16 p4d nodes at p=8: the replicas' links are busy 2.5 s against 1.1 s of
compute), where a partition group of two nodes halves it. So the partition size is priced, not
assumed: every power of two from 1 to the ranks of a stage (to one node with pipeline stages,
whose groups stay inside a node) whose fp32 shard and gradient accumulator alone fit the device,
each lowered and simulated as ``mc.simulate`` prices a plan. One node (what ``mc.Plan`` and
``simulate`` take without a partition size) stays unless a size that fits is predicted at least ``PARTITION_TIE`` faster, or
one node does not fit; then the smallest size within ``PARTITION_TIE`` of the fastest is taken
(the thesis's rule: fewer ranks to gather from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from micscompile.core.plan import Plan, PlanError, ResolvedPlan
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.lowered import lower
from micscompile.lowering.predict import model_buffer_bytes
from micscompile.trace import TrainGraph

PARTITION_TIE = 0.05
"""One node stays unless a size is predicted at least this fraction faster; sizes within it of the
fastest are a tie, which the smallest takes (the threshold ``Plan.optimizer_sharding="auto"`` and
``Plan.codegen="auto"`` use to leave their default: two plans priced by one model on one trace, whose
ratio is surer than either time)."""

STATE_BYTES_PER_PARAM = 8
"""Bytes per parameter a rank holds whatever the plan: its fp32 shard and its fp32 gradient
accumulator (``Plan.param_dtype``'s master weights); a partition size whose 1/p of them (of a stage's
average 1/S of the model with pipeline stages) does not fit the device is not priced."""


@dataclass
class PricedSize:
    """One partition size: its prediction, or why it was not priced."""

    partition_size: int
    prediction: Prediction | None = None
    skipped: str = ""

    def fits(self, cluster: Cluster) -> bool:
        return self.prediction is not None and self.prediction.fits(cluster)


@dataclass
class PartitionChoice:
    """What ``choose_partition_size`` priced and took."""

    plan: ResolvedPlan
    """The plan at the chosen partition size."""
    priced: list[PricedSize] = field(default_factory=list)
    why: str = ""

    def table(self, cluster: Cluster) -> str:
        head = f"{'p':>6}{'d':>6}{'step ms':>12}{'peak GiB':>10}  fits"
        lines = [head, "-" * len(head)]
        stage_ranks = self.plan.world_size // self.plan.stages
        for r in self.priced:
            mark = " <-" if r.partition_size == self.plan.partition_size else ""
            d = stage_ranks // r.partition_size
            if r.prediction is None:
                lines.append(f"{r.partition_size:>6}{d:>6}{'':>12}{'':>10}  no: {r.skipped}")
                continue
            pred = r.prediction
            lines.append(f"{r.partition_size:>6}{d:>6}{pred.step_time_s * 1e3:>12.1f}"
                         f"{pred.peak_memory_bytes / 2**30:>10.2f}  {'yes' if r.fits(cluster) else 'no'}{mark}")
        return "\n".join(lines)


def one_node(plan: Plan, cluster: Cluster) -> int:
    """The partition size without pricing: one node, or a stage's ranks where they are fewer (in tensor
    groups with ``Plan.tensor_parallel_size``)."""
    tp = plan.tensor_parallel_size
    return max(1, min(cluster.gpus_per_node // tp, cluster.world_size // (plan.pipeline_stages * tp)))


def candidate_sizes(plan: Plan, cluster: Cluster) -> list[int]:
    """Powers of two from 1 to a stage's ranks (to one node with pipeline stages) dividing them, and
    one node (``one_node``) where a node is not a power of two (in tensor groups)."""
    tp = plan.tensor_parallel_size
    stage_ranks = cluster.world_size // (plan.pipeline_stages * tp)
    top = min(stage_ranks, cluster.gpus_per_node // tp) if plan.pipeline_stages > 1 else stage_ranks
    sizes, p = {one_node(plan, cluster)}, 1
    while p <= top:
        if stage_ranks % p == 0:
            sizes.add(p)
        p *= 2
    return sorted(sizes)


def _fitting(priced: list[PricedSize], cluster: Cluster, size: int) -> PricedSize | None:
    """The row of ``size`` if it was priced and fits, else None."""
    return next((r for r in priced if r.partition_size == size and r.fits(cluster)), None)


def pick(priced: list[PricedSize], cluster: Cluster, default: int, tie: float = PARTITION_TIE) -> PricedSize | None:
    """One node (``default``) unless a size that fits is predicted at least ``tie`` faster (or it does
    not fit); then the smallest size within ``tie`` of the fastest. None if none fits."""
    fitting = [r for r in priced if r.fits(cluster)]
    if not fitting:
        return None
    best = min(r.prediction.step_time_s for r in fitting)
    node = _fitting(priced, cluster, default)
    if node is not None and node.prediction.step_time_s < best * (1 + tie):
        return node
    return min((r for r in fitting if r.prediction.step_time_s <= best * (1 + tie)), key=lambda r: r.partition_size)


def choose_partition_size(trace: TrainGraph, plan: Plan, cluster: Cluster, *,
                          progress: Callable[[str], None] | None = None) -> PartitionChoice:
    """Price ``plan`` at every ``candidate_sizes`` on ``cluster`` and take one (module docstring).
    ``trace`` is a concrete trace (``lowering.predict.concrete``). Where none fits, one node (the
    default) is taken and the caller's memory check says so."""
    world, k = cluster.world_size, cluster.gpus_per_node
    params = sum(trace.param_shapes[name].numel() for name in trace.param_names)
    priced: list[PricedSize] = []
    for p in candidate_sizes(plan, cluster):
        row = PricedSize(p)
        priced.append(row)
        state = STATE_BYTES_PER_PARAM * params / (p * plan.pipeline_stages)  # a stage's share, on average
        # (params: the trace's; a tensor-parallel trace's are already a tensor rank's pieces)
        if state > cluster.gpu.memory_bytes:
            row.skipped = f"its fp32 shard and gradients alone are {state / 2**30:.1f} GiB"
            continue
        try:
            rp = plan.replace(partition_size=p).resolve(world, k)
            lowered = lower(trace, rp, cluster, need_graph=False)
            row.prediction = lowered.predict(cluster, buffer_bytes=model_buffer_bytes(trace), scaling=True)
        except PlanError as e:  # this size cannot work (the others may)
            row.skipped = str(e)
            continue
        if progress:
            progress(f"priced p={p}: {row.prediction.step_time_s * 1e3:.1f} ms")
    default = one_node(plan, cluster)
    chosen = pick(priced, cluster, default)
    p = chosen.partition_size if chosen else default
    node = _fitting(priced, cluster, default)
    if chosen is None:
        why = f"none of {len(priced)} sizes fits {cluster.gpu.name}; one node ({default})"
    elif node is None:
        why = f"{chosen.prediction.step_time_s * 1e3:.1f} ms; one node (p={default}) does not fit or cannot work"
    elif chosen is node:
        others = [r for r in priced if r is not node and r.fits(cluster)]
        fastest = min(others, key=lambda r: r.prediction.step_time_s, default=None)
        gain = node.prediction.step_time_s / fastest.prediction.step_time_s if fastest else 0.0
        why = (f"{node.prediction.step_time_s * 1e3:.1f} ms, one node (p={default}): " +
               ("the only size that fits" if fastest is None else "the fastest that fits" if gain <= 1 else
                f"p={fastest.partition_size} is only {gain:.3f}x faster, under {1 + PARTITION_TIE:.2f}x"))
    else:
        ratio = node.prediction.step_time_s / chosen.prediction.step_time_s
        why = (f"{chosen.prediction.step_time_s * 1e3:.1f} ms, {ratio:.2f}x faster than one node (p={default}, "
               f"{node.prediction.step_time_s * 1e3:.1f} ms)")
    return PartitionChoice(plan.replace(partition_size=p).resolve(world, k), priced,
                           f"partition size {p} (priced on {cluster.name}, no -p given): {why}")
