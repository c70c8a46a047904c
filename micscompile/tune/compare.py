"""What switching buys on N nodes: micscompile's best partition size against the peers, priced on
one trace (``micscompile simulate MODEL --compare-peers --nodes 2 4 8 ...``).

Per cluster size: micscompile at each partition size (default: powers of two from one node to
the whole cluster), with hierarchical and flat gathers across nodes (the fastest that fits the
device memory is its row), DeepSpeed ZeRO-3, FSDP2
full shard, FSDP2 HSDP sharded inside a node and Megatron-LM (tensor groups of a node, the fewest
pipeline stages its model states fit in), each by its peer model
(``lowering.peers``, docs/peer-models.md). Every figure carries the cluster's held-out error
(``Prediction.uncertainty``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from micscompile.core.plan import Plan, PlanError, divisors
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.predict import simulate
from micscompile.lowering.tensor_split import TensorSplitError
from micscompile.trace import TrainGraph
from micscompile.tune.search_space import Config, state_floor_bytes

SYSTEM_ROWS = ("micscompile", "deepspeed-zero3", "fsdp2", "fsdp2-hsdp", "megatron")
LABELS = {"micscompile": "micscompile (best p)", "deepspeed-zero3": "DeepSpeed ZeRO-3", "fsdp2": "FSDP2 full shard",
          "fsdp2-hsdp": "FSDP2 HSDP (shard in a node)", "megatron": "Megatron-LM (PTD-P)"}


@dataclass
class PeerRow:
    """One system on one cluster size."""

    nodes: int
    gpus: int
    system: str
    """One of ``SYSTEM_ROWS``."""
    partition_size: int | None = None
    tensor: int = 1
    """Megatron-LM's tensor group size t (its row: t and S in the table)."""
    stages: int = 1
    hierarchical: bool | str = False
    """Its gathers across nodes (micscompile: ``Plan.hierarchical``)."""
    prediction: Prediction | None = None
    """Set by ``compare_peers``."""
    fits: bool = False
    """Its peak memory fits the device."""

    @property
    def tflops_per_gpu(self) -> float:
        return self.prediction.tflops_per_gpu


def _row(trace: TrainGraph, nodes: int, cluster: Cluster, system: str, plan: Plan) -> PeerRow:
    """``plan`` priced as ``system`` ("fsdp2-hsdp": FSDP2's model at the plan's partition size)."""
    row = PeerRow(nodes, cluster.world_size, system, plan.partition_size, plan.hierarchical)
    row.prediction = simulate(trace, plan, cluster, scaling=False, system=system.removesuffix("-hsdp"))
    row.fits = row.prediction.fits(cluster)
    return row


def compare_peers(trace: TrainGraph, cluster: Cluster, nodes: Sequence[int], plan: Plan | None = None, *,
                  partition_sizes: Sequence[int] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[PeerRow]:
    """Rows for every cluster size in ``nodes`` (``cluster`` gives the node type) and every system of
    ``SYSTEM_ROWS``; ``plan`` gives micro-batches, dtypes and checkpointing (its partition size is
    searched over ``partition_sizes`` for micscompile)."""
    check_nodes(nodes)
    plan = plan or Plan()
    rows: list[PeerRow] = []
    for n in nodes:
        c = cluster.with_nodes(n)
        world, k = c.world_size, min(c.gpus_per_node, c.world_size)
        sizes = [p for p in (partition_sizes or _powers_of_two(k, world)) if world % p == 0]
        if not sizes:
            raise PlanError(f"no partition size in {list(partition_sizes or [])} divides {world} ranks")
        ours = [_row(trace, n, c, "micscompile", dataclasses.replace(plan, partition_size=p, hierarchical=h))
                for p in sizes for h in ((plan.hierarchical, False) if p > k and plan.hierarchical else (False,))]
        rows.append(min(ours, key=lambda r: (not r.fits, r.prediction.step_time_s)))
        rows.append(_row(trace, n, c, "deepspeed-zero3", dataclasses.replace(plan, partition_size=world)))
        rows.append(_row(trace, n, c, "fsdp2", dataclasses.replace(plan, partition_size=world)))
        if world > k:
            rows.append(_row(trace, n, c, "fsdp2-hsdp", dataclasses.replace(plan, partition_size=k)))
        if (megatron := _megatron_row(trace, n, c, plan)) is not None:
            rows.append(megatron)
        if progress:
            progress(f"{n} nodes priced")
    return rows


def _megatron_row(trace: TrainGraph, nodes: int, cluster: Cluster, plan: Plan) -> PeerRow | None:
    """Megatron-LM as its paper tunes it (§5.4: tensor groups inside a node, pipelines only for a model that does not
    fit): for each tensor size t dividing a node (``plan.tensor_parallel_size`` alone where > 1), the fewest
    pipeline stages S whose model states (16 B a parameter over t * S ranks) fit in 80% of the device; the fastest
    that fits the device is the row. The same global batch: ``plan.micro_batches`` per rank, t * S times as many
    per pipeline. None where no (t, S) splits the model (its heads, its blocks) or the cluster."""
    world = cluster.world_size
    params = sum(trace.param_shapes[name].numel() for name in trace.param_names)
    sizes = [plan.tensor_parallel_size] if plan.tensor_parallel_size > 1 else divisors(min(cluster.gpus_per_node, world))
    rows = []
    for t in (t for t in sizes if world % t == 0):
        unsharded = (Config(stages=S, partition=1, micro_batch=1, micro_batches=1, checkpoint=False, offload=False,
                            hierarchical="auto", tensor=t) for S in divisors(world // t))
        S = next((c.stages for c in unsharded if state_floor_bytes(params, c) <= 0.8 * cluster.gpu.memory_bytes),
                 world // t)
        if S > 1 and 2 * S > len(trace.blocks):
            continue
        megatron = dataclasses.replace(plan, tensor_parallel_size=t, pipeline_stages=S,
                                       micro_batches=plan.micro_batches * t * S)
        row = PeerRow(nodes, world, "megatron", tensor=t, stages=S)
        try:
            row.prediction = simulate(trace, megatron, cluster, scaling=False, system="megatron")
        except (PlanError, TensorSplitError):
            continue
        row.fits = row.prediction.fits(cluster)
        rows.append(row)
    return min(rows, key=lambda r: (not r.fits, r.prediction.step_time_s), default=None)


def check_nodes(nodes: Sequence[int]) -> None:
    """Cluster sizes to compare: at least one, each a positive node count."""
    if not nodes or any(n < 1 for n in nodes):
        raise PlanError(f"nodes must be positive cluster sizes, got {list(nodes)}")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, p = [], lo
    while p <= hi:
        out.append(p)
        p *= 2
    return out or [hi]


def format_table(rows: Sequence[PeerRow]) -> str:
    """TFLOP/s per GPU by cluster size and system, and what micscompile's best plan buys over the
    fastest peer that fits (``*``: does not fit the device memory)."""
    nodes = list(dict.fromkeys(r.nodes for r in rows))
    head = f"{'nodes':>5} {'GPUs':>5} " + " ".join(f"{LABELS[s]:>28}" for s in SYSTEM_ROWS) + f" {'mc / best peer':>15}"
    lines = [head, "-" * len(head)]
    for n in nodes:
        mine = {r.system: r for r in rows if r.nodes == n}
        cells = []
        for s in SYSTEM_ROWS:
            r = mine.get(s)
            if r is None:
                cells.append(f"{'-':>28}")
            else:
                across = (r.partition_size or 0) > r.gpus // r.nodes
                p = f"p={r.partition_size}{' flat' if across and not r.hierarchical else ''} " if s == "micscompile" else ""
                p = f"t={r.tensor} S={r.stages} " if s == "megatron" else p
                cells.append(f"{p + f'{r.tflops_per_gpu:.3g}' + ('' if r.fits else '*'):>28}")
        ours = mine["micscompile"]
        peers = [r for s, r in mine.items() if s != "micscompile" and r.fits]
        ratio = "-"
        if peers:
            ratio = f"{ours.tflops_per_gpu / max(r.tflops_per_gpu for r in peers):.2f}x"
        gpus = next(iter(mine.values())).gpus
        lines.append(f"{n:>5} {gpus:>5} " + " ".join(cells) + f" {ratio:>15}")
    lines.append(f"TFLOP/s per GPU {rows[0].prediction.interval()}; *: does not fit the device memory")
    return "\n".join(lines)
