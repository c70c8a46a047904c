"""The peers priced on the same trace: ``mc.simulate(..., system="deepspeed-zero3" | "deepspeed-mics" | "fsdp2")``.

A peer is described by what its runtime does differently from micscompile's, each rule read from
its source (docs/peer-models.md cites the lines):

* **the Plan its traffic follows**: whom it shards over, whether gathers are hierarchical, when
  gradients are reduced;
* **its fetch granularity**: the collectives one block's gather is issued as;
* **its gradient buckets**: the collectives its reductions are issued as;
* **its look-ahead**: how many gathers it keeps in flight;
* **its synchronization**: which collectives the host waits for as soon as they are issued.

DeepSpeed ZeRO-3 (docs/peer-models.md#deepspeed-zero-3): shards over every rank, flat gathers;
fetches per module with direct parameters, modules packed in fetch order into batches of at most
``stage3_prefetch_bucket_size`` (5e7) elements, one all-gather each (a larger module alone), the
next batch prefetched on the all-gather stream while the current module computes; parameters of
at most ``stage3_param_persistence_threshold`` (1e5) elements persist and are not gathered per
micro-step; gradients copied into ``reduce_bucket_size`` (5e8-element) buckets, each
reduce-scattered over all ranks on its own stream when full, every micro-step ("ZeRO stage >= 2
communicates during non gradient accumulation boundaries as well"). ``"deepspeed-zero3-v0.5"``
is the version the thesis measured (v0.5.x, §3.4's "coarse granularity"): every parameter is its own
collective (``per_parameter``): its fetch all-gathers one parameter per call, and each gradient bucket
is reduce-scattered one parameter per call. Its host synchronizes the reduction stream before
reducing the next bucket (``reduction_stream.synchronize()`` in ``reduce_ipg_grads``), and each
fetch ends in ``torch.cuda.synchronize()``, which waits for every stream, the reductions in flight
included (``sync_at_fetch``). Today's DeepSpeed copies each fetched parameter out of the gathered
buffer at the fetch's wait (``copy_out="parameter"``); v0.5.x gathered each into its own storage.
``"deepspeed-zero3-v0.3"`` is 2021's before that (v0.3.12-v0.5.5, what the Megatron-LM paper's Table 2
measured): v0.5.x's per-parameter calls and synchronize, through torch's list API: the host loops over the
group's ranks for every call (``host_per_call_s``, ``DS_2021_HOST_S_PER_RANK``) and after each step for every
persistent parameter, c10d copies each gathered parameter out of its flat buffer (``copy_out="parameter"``).

DeepSpeed-MiCS (``deepspeed/runtime/zero/mics.py``, the thesis's MiCS upstream): the user's partition
group, hierarchical gathers and 2-hop gradient sync as micscompile's, DeepSpeed's fetch
granularity and gradient buckets above (its optimizer is ZeRO-3's), one fetch ahead; its
hierarchical gather runs all three stages (inter-node, reorder, intra-node) on the all-gather
stream, beside compute.

FSDP2 (docs/peer-models.md#fsdp2-fully_shard): one ``fully_shard`` unit per block, gathered as one
collective, one unit prefetched (forward and backward); a reduce-scatter every micro-batch and,
under HSDP (partition size < world), the replicate all-reduce of each reduced shard right after
it, every micro-batch, on its own stream; its streams overlap collectives with compute as
micscompile's do; each gathered unit is copied out into its parameters on the compute stream
(``copy_out="unit"``).

Megatron-LM (docs/peer-models.md#megatron-lm-ptd-p, v2.5 as the SC21 paper ran it): the plan's tensor
groups, pipeline stages and interleaving; no sharding (``partition_size=1``: each data-parallel rank keeps
its stage's whole fp16 weights, fp32 master weights and Adam state); no sequence parallelism (2022); the
gradients all-reduced over the d data-parallel replicas once the rank's whole backward is done, one
flattened all-reduce per model chunk (``allreduce_gradients`` after ``forward_backward_func``,
``grad_sync_after_backward``); the tensor all-reduces on the compute stream, as micscompile's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from micscompile.core.errors import InputError
from micscompile.core.plan import Plan
from micscompile.core.program import Prefetch
from micscompile.core.sharding import BucketLayout
from micscompile.cost_model.simulator import RuntimeCosts

SYSTEMS = ("micscompile", "deepspeed-zero3", "deepspeed-zero3-v0.5", "deepspeed-zero3-v0.3", "deepspeed-mics", "fsdp2",
           "megatron")

DS_PREFETCH_BUCKET_ELEMENTS = 50_000_000
"""``stage3_prefetch_bucket_size`` default (deepspeed/runtime/zero/config.py)."""
DS_PERSISTENCE_THRESHOLD = 100_000
"""``stage3_param_persistence_threshold`` default: parameters this small are never released."""
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""``reduce_bucket_size`` default (deepspeed/runtime/zero/config.py; the same in v0.5.x)."""
DS_MAX_REUSE_DISTANCE = 1_000_000_000
"""``stage3_max_reuse_distance`` default: a parameter whose module returns within this many fetched
elements is not released (coordinator l.653-662)."""
DS_CONFIG_KEYS = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "reduce_bucket_size",
                  "stage3_max_reuse_distance")
"""The DeepSpeed config keys ``mc.simulate(..., peer_config=...)`` takes for its DeepSpeed peers."""
DS_2021_HOST_S_PER_RANK = (9e-6, 10e-6, 12e-6)
"""DeepSpeed 2021's (v0.3.12-v0.5.5, on PyTorch 1.7-1.8) host time per rank of the group, per collective call:
(a parameter's all-gather, a parameter's reduce-scatter, one persistent parameter's copy after the step). Its
calls take torch's list API: DeepSpeed builds the world's partitions in a Python loop (``for i in
range(self.world_size)``: a ``narrow`` each, partition_parameters.py l.623, l.741 at v0.3.13) and c10d copies
each of them in or out of its flat buffer (``ProcessGroupNCCL::allgather``: one ``copy_`` per output tensor);
after the step the persistent parameters are copied out rank by rank (l.681). Component estimates, not fitted
on any row: a Python ``narrow`` 2.5 us (measured on this machine, torch 2.13; 2.8 us in pytorch#28890's op
benchmark), a CUDA ``copy_`` launch with its ``recordStream`` about 5 us, 1-2 us of list and rank bookkeeping;
the post-step loop does two narrows, a view and a copy from Python. The measurement that would pin them: one
GPU timing N ``narrow`` + N ``copy_`` at N = 1536 on torch 1.8 (docs/peer-models.md)."""


@dataclass(frozen=True)
class Peer:
    """What ``mc.simulate`` changes to price ``system`` instead of micscompile."""

    system: str
    plan: Plan
    """The Plan whose collectives the peer issues."""
    prefetch: tuple[Prefetch, ...] | None
    """Its look-ahead (None: micscompile's own search)."""
    fetch_elements: int | None = None
    """Gathers are issued in batches of at most this many elements (None: one per bucket)."""
    persistence_threshold: int = 0
    """Parameters of at most this many elements are not gathered per micro-step."""
    reduce_elements: int | None = None
    """Gradients are reduce-scattered in buckets of this many elements (None: one per bucket)."""
    hierarchical_on_stream: bool = False
    """A hierarchical gather's reorder and intra-node stage run on the communication stream."""
    max_reuse_distance: int | None = None
    """Forward gathers whose backward use comes within this many fetched elements stay live."""
    replicate_every_micro_step: bool = False
    """Each reduce-scatter is followed by the replicate group's all-reduce, every micro-step (HSDP)."""
    per_parameter: bool = False
    """Each parameter is its own collective, in a fetch batch and in a gradient bucket (DeepSpeed
    v0.5.x: ``_allgather_params_coalesced`` and ``_allgather_param`` all-gather one parameter per
    call, ``_reduce_scatter_gradients`` reduce-scatters one per call; docs/peer-models.md)."""
    sync_at_fetch: bool = False
    """Each fetch ends in a device synchronize, which waits for the reductions in flight too (DeepSpeed
    v0.5.x: ``fetch_sub_module`` calls ``_synchronize_communication``, whose ``torch.cuda.synchronize()``
    waits on every stream, the reduction stream included; stage3.py l.450-451, l.533-541)."""
    copy_out: str | None = None
    """Where a gather lands in a flat buffer its parameters are copied out of, on the compute stream at
    its wait: ``"unit"`` one copy per gathered bucket (FSDP2's ``split_with_sizes_copy`` in
    ``wait_for_unshard``), ``"parameter"`` one per fetched parameter (DeepSpeed's ``torch.cat`` in
    ``AllGatherCoalescedHandle.wait``); docs/peer-models.md cites the lines."""
    grad_sync_after_backward: bool = False
    """The gradients' all-reduces over the replicas start once the rank's whole backward is done (Megatron-LM
    v2.5: ``model.allreduce_gradients()`` in ``train_step`` after every micro-batch's backward)."""
    host_per_call_s: tuple[float, float] = (0.0, 0.0)
    """(gather, reduce-scatter) host time of each collective call, on the compute stream before its launch
    (DeepSpeed 2021: its per-rank list loops, with the device synchronized before every gather)."""
    host_per_persistent_s: float = 0.0
    """Host time per persistent parameter after each step (DeepSpeed 2021: its rank-by-rank copy-out)."""

    def kept_live(self, layouts: Sequence[BucketLayout]) -> int:
        """Buckets whose forward gather stays live into backward: between a bucket's forward and its
        backward use the later buckets are fetched twice (forward, then backward), so the last ones
        whose later buckets hold at most half the reuse distance."""
        if self.max_reuse_distance is None:
            return 0
        kept, after = 0, 0
        for lay in sorted(layouts, key=lambda lay: lay.index, reverse=True):
            if 2 * after > self.max_reuse_distance:
                break
            kept += 1
            after += lay.numel
        return kept

    def runtime_costs(self, layouts: Sequence[BucketLayout]) -> RuntimeCosts:
        """What ``simulate_program`` prices differently for this peer's runtime, on its Program's ``layouts``."""
        return RuntimeCosts(
            gather_pieces=None if self.fetch_elements is None else {
                lay.index: fetch_batches(lay, self.fetch_elements, self.persistence_threshold, self.per_parameter)
                for lay in layouts},
            reduce_pieces=None if self.reduce_elements is None else reduce_buckets(layouts, self.reduce_elements,
                                                                                   self.per_parameter),
            hierarchical_on_stream=self.hierarchical_on_stream,
            replicate_every_micro_step=self.replicate_every_micro_step, sync_at_fetch=self.sync_at_fetch,
            grad_sync_after_backward=self.grad_sync_after_backward, host_per_call_s=self.host_per_call_s,
            host_per_step_s=self.host_per_persistent_s * sum(s.numel <= self.persistence_threshold
                                                             for lay in layouts for s in lay.slots),
            copy_out_ops=None if self.copy_out is None else {
                lay.index: sum(s.numel > self.persistence_threshold for s in lay.slots)
                if self.copy_out == "parameter" else 1 for lay in layouts})


def reduce_buckets(layouts: Sequence[BucketLayout], limit: int, per_parameter: bool = False,
                   ) -> dict[int, tuple[int, ...]]:
    """DeepSpeed's gradient buckets as reduce-scatters per block, in bytes: gradients arrive in
    backward order (last block first, a block's parameters last first) and fill a bucket of
    ``limit`` elements, reduced when the next gradient would overflow it (a block larger than the
    bucket reduces inside itself); a block whose gradients all wait for later ones reduces nothing;
    the first block reduces what is left. ``per_parameter``: each bucket is reduced one parameter per
    collective."""
    out: dict[int, tuple[int, ...]] = {}
    filled: list[int] = []  # the element counts of the gradients in the open bucket
    order = sorted(layouts, key=lambda lay: lay.index, reverse=True)

    def flush(itemsize: int) -> list[int]:
        sizes = [n * itemsize for n in filled] if per_parameter else [sum(filled) * itemsize]
        filled.clear()
        return sizes

    for i, lay in enumerate(order):
        sizes: list[int] = []
        for slot in reversed(lay.slots):
            if filled and sum(filled) + slot.numel > limit:
                sizes += flush(lay.grad_dtype.itemsize)
            filled.append(slot.numel)
        if i == len(order) - 1 and filled:
            sizes += flush(lay.grad_dtype.itemsize)
        out[lay.index] = tuple(sizes)
    return out


def fetch_batches(layout: BucketLayout, limit: int, persistent: int = 0,
                  per_parameter: bool = False) -> tuple[int, ...]:
    """DeepSpeed's fetches of one bucket, in bytes: its modules (parameters grouped by owning module,
    in layout order) packed in order into batches of at most ``limit`` elements, a larger module
    alone; parameters of at most ``persistent`` elements are left out. ``per_parameter``: every
    parameter fetched is a collective of its own, issued one after another at the bucket's gather."""
    itemsize = layout.gather_dtype.itemsize
    if per_parameter:
        return tuple(slot.numel * itemsize for slot in layout.slots if slot.numel > persistent)
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
    return tuple(n * itemsize for n in batches)


def peer(system: str, plan: Plan, world_size: int, config: Mapping[str, float] | None = None) -> Peer:
    """The Peer pricing ``system`` for a user's ``plan`` on ``world_size`` ranks (its micro-batch
    count, dtypes, checkpointing and node size kept); ``config``: DeepSpeed config values
    (``DS_CONFIG_KEYS``) in place of its defaults."""
    if system not in SYSTEMS:
        raise InputError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    config = dict(config or {})
    unknown = set(config) - set(DS_CONFIG_KEYS)
    if unknown or (config and not system.startswith("deepspeed")):
        raise InputError(f"peer_config takes DeepSpeed's {', '.join(DS_CONFIG_KEYS)} for a DeepSpeed system; "
                         f"got {sorted(config)} for {system!r}")
    ds = {k: int(config.get(k, default)) for k, default in zip(DS_CONFIG_KEYS, (
        DS_PREFETCH_BUCKET_ELEMENTS, DS_PERSISTENCE_THRESHOLD, DS_REDUCE_BUCKET_ELEMENTS, DS_MAX_REUSE_DISTANCE))}
    base = dataclasses.replace(  # a reduce-scatter every micro-step: with p = n, "2hop" has no second hop
        plan, pipeline_stages=1, pipeline_chunks=None, pipeline_schedule="1f1b", hierarchical=False, grad_sync="2hop",
        tensor_parallel_size=1, sequence_parallel=False,  # (data parallelism alone)
        bucket_bytes=None, memory_budget_bytes=None, max_gathers_in_flight=None, codegen="eager",
        optimizer_sharding="partition")
    deepspeed = dict(prefetch=(Prefetch(distance=1),), fetch_elements=ds["stage3_prefetch_bucket_size"],
                     persistence_threshold=ds["stage3_param_persistence_threshold"],
                     reduce_elements=ds["reduce_bucket_size"], max_reuse_distance=ds["stage3_max_reuse_distance"])
    if system in ("deepspeed-zero3", "deepspeed-zero3-v0.5", "deepspeed-zero3-v0.3"):
        old = system != "deepspeed-zero3"
        host = {}
        if system.endswith("v0.3"):  # 2021's list API: per-rank host loops, c10d's copy out of its flat buffer
            g, r, post = DS_2021_HOST_S_PER_RANK
            host = dict(host_per_call_s=(g * world_size, r * world_size), host_per_persistent_s=post * world_size)
        return Peer(system, dataclasses.replace(base, partition_size=world_size), **deepspeed,
                    per_parameter=old, sync_at_fetch=old,
                    copy_out=None if system.endswith("v0.5") else "parameter", **host)
    if system == "deepspeed-mics":
        return Peer(system, dataclasses.replace(plan, bucket_bytes=None, codegen="eager", optimizer_sharding="partition",
                                                tensor_parallel_size=1, sequence_parallel=False),
                    **deepspeed, hierarchical_on_stream=True)
    if system == "megatron":  # no sharding, no SP; the plan's tensor groups, pipeline and interleaving
        megatron = dataclasses.replace(plan, partition_size=1, hierarchical=False, grad_sync="2hop", bucket_bytes=None,
                                       sequence_parallel=False, optimizer_sharding="partition", codegen="eager",
                                       memory_budget_bytes=None, max_gathers_in_flight=None)
        return Peer(system, megatron, (Prefetch(distance=0),), grad_sync_after_backward=True)
    if system == "fsdp2":  # HSDP (partition_size < world size): the replicate all-reduce every micro-batch
        return Peer(system, base, (Prefetch(distance=1),), copy_out="unit",
                    replicate_every_micro_step=(plan.partition_size or world_size) < world_size)
    return Peer(system, plan, None)
