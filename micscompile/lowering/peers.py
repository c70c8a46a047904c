"""The peers priced on the same trace: ``mc.simulate(..., system="deepspeed-zero3" | "deepspeed-mics" | "fsdp2")``.

A peer is described by what its runtime does differently from micscompile's, each rule read from
its source (docs/peer-models.md cites the lines):

* **the Plan its traffic follows**: whom it shards over, whether gathers are hierarchical, when
  gradients are reduced;
* **its fetch granularity**: the collectives one block's gather is issued as;
* **its look-ahead**: how many gathers it keeps in flight;
* **its synchronization**: how much of a collective can hide behind compute.

DeepSpeed ZeRO-3 (docs/peer-models.md#deepspeed-zero-3): shards over every rank, flat gathers;
fetches per module with direct parameters, modules packed in fetch order into batches of at most
``stage3_prefetch_bucket_size`` (5e7) elements, one all-gather each (a larger module alone);
parameters of at most ``stage3_param_persistence_threshold`` (1e5) elements persist and are not
gathered per micro-step; gradients reduce-scattered over all ranks every micro-step ("ZeRO stage
>= 2 communicates during non gradient accumulation boundaries as well"). Synchronization: the
version the thesis measured (v0.5.6) synchronizes the device or the stream around each
collective (thesis §3.4, "coarse granularity"), and today's waits for the whole all-gather stream
after each fetch: a collective does not run beside compute, so none of it hides.

DeepSpeed-MiCS (``deepspeed/runtime/zero/mics.py``, the implementation the thesis measured): the
user's partition group, hierarchical gathers and 2-hop gradient sync as micscompile's, but
DeepSpeed's fetch granularity above, and the thesis's fine-grained synchronization (§3.4:
``wait_event`` / ``wait_stream``), so collectives overlap compute; one fetch ahead.

FSDP2 (docs/peer-models.md#fsdp2-fully_shard): one ``fully_shard`` unit per block, gathered as one
collective, one unit prefetched (forward and backward); a reduce-scatter every micro-batch and,
under HSDP (partition size < world), the replicate all-reduce after it, every micro-batch (not
priced yet: refused for more than one micro-batch); its streams overlap collectives with compute
as micscompile's do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from micscompile.core.plan import Plan
from micscompile.core.program import Prefetch
from micscompile.core.sharding import BucketLayout
from micscompile.cost_model.specs import Cluster

SYSTEMS = ("micscompile", "deepspeed-zero3", "deepspeed-mics", "fsdp2")

DS_PREFETCH_BUCKET_ELEMENTS = 50_000_000
"""``stage3_prefetch_bucket_size`` default (deepspeed/runtime/zero/config.py)."""
DS_PERSISTENCE_THRESHOLD = 100_000
"""``stage3_param_persistence_threshold`` default: parameters this small are never released."""


@dataclass(frozen=True)
class Peer:
    """What ``mc.simulate`` changes to price ``system`` instead of micscompile."""

    system: str
    plan: Plan
    """The Plan whose collectives the peer issues."""
    prefetch: tuple[Prefetch, ...] | None
    """Its look-ahead (None: micscompile's own search)."""
    overlap: float | None
    """Fraction of a collective that hides behind compute (None: the cluster's)."""
    fetch_elements: int | None = None
    """Gathers are issued in batches of at most this many elements (None: one per bucket)."""
    persistence_threshold: int = 0
    """Parameters of at most this many elements are not gathered per micro-step."""

    def cluster(self, cluster: Cluster) -> Cluster:
        if self.overlap is None:
            return cluster
        return dataclasses.replace(cluster, overlap=self.overlap, collective_interference={})

    def gather_pieces(self, layouts: Sequence[BucketLayout]) -> dict[int, tuple[int, ...]] | None:
        """Bucket -> bytes of each collective its gather is issued as."""
        if self.fetch_elements is None:
            return None
        return {lay.index: fetch_batches(lay, self.fetch_elements, self.persistence_threshold) for lay in layouts}


def fetch_batches(layout: BucketLayout, limit: int, persistent: int = 0) -> tuple[int, ...]:
    """DeepSpeed's fetches of one bucket, in bytes: its modules (parameters grouped by owning module,
    in layout order) packed in order into batches of at most ``limit`` elements, a larger module
    alone; parameters of at most ``persistent`` elements are left out."""
    modules: dict[str, int] = {}
    for slot in layout.slots:
        if slot.numel > persistent:
            owner = slot.name.rpartition(".")[0]
            modules[owner] = modules.get(owner, 0) + slot.numel
    batches: list[int] = []
    for numel in modules.values():
        if batches and batches[-1] + numel <= limit:
            batches[-1] += numel
        else:
            batches.append(numel)
    itemsize = layout.gather_dtype.itemsize
    return tuple(n * itemsize for n in batches)


def peer(system: str, plan: Plan, world_size: int) -> Peer:
    """The Peer pricing ``system`` for a user's ``plan`` on ``world_size`` ranks (its micro-batch
    count, dtypes, checkpointing and node size kept)."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    base = dataclasses.replace(  # a reduce-scatter every micro-step: with p = n, "2hop" has no second hop
        plan, pipeline_stages=1, pipeline_chunks=1, pipeline_schedule="1f1b", hierarchical=False, grad_sync="2hop",
        bucket_bytes=None, memory_budget_bytes=None, max_gathers_in_flight=None, codegen="eager")
    if system == "deepspeed-zero3":
        return Peer(system, dataclasses.replace(base, partition_size=world_size), (Prefetch(distance=0),),
                    overlap=0.0, fetch_elements=DS_PREFETCH_BUCKET_ELEMENTS,
                    persistence_threshold=DS_PERSISTENCE_THRESHOLD)
    if system == "deepspeed-mics":
        return Peer(system, dataclasses.replace(plan, bucket_bytes=None, codegen="eager"), (Prefetch(distance=1),),
                    overlap=None, fetch_elements=DS_PREFETCH_BUCKET_ELEMENTS,
                    persistence_threshold=DS_PERSISTENCE_THRESHOLD)
    if system == "fsdp2":
        if (plan.partition_size or 0) < world_size and plan.micro_batches > 1:
            raise ValueError("fsdp2 with HSDP (partition_size < world size) and micro_batches > 1 all-reduces over "
                             "the replicate group every micro-batch, which the simulator does not price yet (issue 26); "
                             "price micro_batches=1, or full shard (partition_size = world size)")
        return Peer(system, base, (Prefetch(distance=1),), overlap=None)
    return Peer(system, plan, None, overlap=None)
