"""The Plan: how one training step is partitioned and scheduled.

Terms (docs/design.md): n ranks, k ranks per node, p partition-group size (p | n),
d = n / p replication-group size, s micro-batches per optimizer step.

The node size k is not the Plan's: it is the cluster's (``Cluster.gpus_per_node``, what ``mc.simulate``,
``mc.autotune`` and ``mc.compile(cluster=...)`` plan for), else the launch's (torchrun's ``LOCAL_WORLD_SIZE``),
and ``resolve`` is given it.

A Plan is checked twice: ``__post_init__`` checks what the Plan alone can know
(and, if a process group is already initialized, the world size), and
``Plan.resolve(world_size, gpus_per_node)`` turns it into concrete group sizes
before any collective runs. Options that later passes will implement are refused
with a clear message instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from micscompile.core.errors import PlanError
from micscompile.core.schedules import CHOSEN_CHUNKS, INTERLEAVED, ZERO_BUBBLE, check_kind, check_schedule

PRECISIONS = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes Plan.param_dtype and Plan.reduce_dtype accept."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (in O(sqrt n): worlds of millions of ranks are priced)."""
    small = [q for q in range(1, math.isqrt(n) + 1) if n % q == 0] if n > 0 else []
    return small + [n // q for q in reversed(small) if q * q != n]




@dataclass(frozen=True, kw_only=True)
class Plan:
    """A MiCS partitioning plan for one training step."""

    partition_size: int | None = None
    """p: the ranks that together hold one copy of the model states a rank trains, each a 1/p shard: the whole
    model in a flat plan (1 = data parallel, n = ZeRO-3), its stage's share with ``pipeline_stages`` > 1 (the
    MiCS-Pipe papers' t), the pieces of its tensor rank with ``tensor_parallel_size`` > 1 (p counts tensor
    groups: FSDP2 over TP). None = one node's ranks, at most a stage's."""
    tensor_parallel_size: int = 1
    """tp: consecutive ranks inside one node that split each layer's compute (Megatron-LM's tensor
    parallelism, ``lowering.tensor_split``); the world is S * d * p * tp, tensor ranks innermost."""
    sequence_parallel: bool = False
    """With tp > 1: Megatron's sequence parallelism (Korthikanti et al., 2022): the activations between the
    tensor-parallel matmuls (norms, residuals, pointwise ops) live split along the sequence on the tensor
    ranks, and the all-reduces become reduce-scatters and all-gathers along it."""
    context_parallel_size: int = 1
    """cp: the ranks that share each sample, each holding 1/cp of its sequence in every token-wise activation
    (context parallelism, ``lowering.context_split``): cp consecutive ranks, rank r of them tokens [r s/cp, (r+1)
    s/cp). Each passes the same whole-sequence batch to ``step(...)`` and the step takes its part; attention sees
    the whole sequence through ``context_parallel_exchange``. The parameters are the same on every rank of a
    context group: the partition group shards over it too, and the gradients are summed over it as over the
    data-parallel ranks (each rank's loss the mean over its tokens). ``mc.simulate`` prices it on a trace of one
    context rank's tokens (s/cp per sample)."""
    context_parallel_exchange: Literal["ulysses"] = "ulysses"
    """How attention sees the whole sequence under context parallelism: "ulysses", an all-to-all from the split
    over the sequence to one over the heads before the attention, and back after it (cp must divide the heads).
    The ring and all-gather exchanges are priced (``cost_model.context_exchange``), not built."""
    micro_batches: int = 1
    """s: the micro-batches each rank runs per optimizer step, its global batch cut s ways per replica: the
    gradient-accumulation steps of a flat plan, the micro-batches that flow through a pipeline (the Megatron-LM
    paper's m). Global batch = d * s * micro-batch size either way."""
    pipeline_stages: int = 1
    """S: pipeline stages (MiCS-Pipe). With S > 1, ``partition_size`` is the intra-stage partition
    size t, every S*t consecutive ranks form one pipeline, and n = S * t * d."""
    pipeline_schedule: Literal["1f1b", "interleaved", "gpipe", "zb-h1", "interleaved-zb", "zb-v"] = "1f1b"
    """The pipeline schedule (S > 1): synchronous 1F1B, interleaved 1F1B, GPipe, or a zero-bubble one, each
    backward split into input and weight gradients (``passes.weight_split``): ZB-H1 (1F1B's order, 1F1B's
    peak activation memory), interleaved zero-bubble, or ZB-V (two chunks per rank in a V)."""
    pipeline_chunks: int | None = None
    """v: model chunks per pipeline rank. The interleaved schedules take any v > 1 ("interleaved",
    "interleaved-zb"; None = 2); the others fix it (1f1b, gpipe and zb-h1 one chunk, zb-v two) and None takes
    theirs (another value is refused). ``Plan.chunks`` is v either way."""
    hierarchical: Literal["auto", True, False] = "auto"
    """Hierarchical (inter-node, then intra-node) all-gathers and reduce-scatters when a partition
    group spans whole nodes: True / False force it for every bucket; "auto" lets the cost model
    pick per bucket on the cluster the Program is scheduled for (flat without one)."""
    memory_budget_bytes: int | None = None
    """Budget for gathered parameters live at once; None = no limit (device capacity)."""
    max_gathers_in_flight: int | None = None
    """Most all-gathers issued and not yet waited for at once (caps the prefetch distance); None = no cap."""
    bucket_bytes: int | None = None
    """Merge consecutive blocks into gather buckets of up to this many bytes; None = one bucket per
    block, or for a flat plan at p = 1 (nothing is gathered: a bucket is only an all-reduce) up to
    ``P1_BUCKET_BYTES``."""
    checkpoint: Literal[False, True, "selective", "attention"] = False
    """Activation checkpointing (passes.checkpoint): True recomputes in backward every forward value
    of a segment but its outputs; "selective" also keeps matmul outputs (recomputes the cheap ops);
    "attention" recomputes only the attention core's sequence x sequence values (scores, probabilities:
    Korthikanti et al.'s selective recomputation) and keeps the rest."""
    checkpoint_every: int = 1
    """Blocks per checkpointed segment (its outputs are kept, everything inside recomputed)."""
    offload_activations: bool = False
    """Checkpointed segment outputs go to host memory after their last forward use and come back
    before their backward (needs ``checkpoint``; micscompile.passes.offload)."""
    param_dtype: torch.dtype = torch.float32
    """Mixed precision: dtype of the gathered parameters and of compute (bfloat16 / float16). Each
    rank casts its fp32 shard to it as it gathers (the wire carries it); the shards, their
    gradients and the optimizer state stay fp32 (master weights). float16 trains with dynamic loss
    scaling (``loss_scaled``; micscompile.runtime.loss_scale)."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype the gradients are summed in: the reduce-scatter (or all-reduce) of every micro-step and
    the boundary all-reduce; accumulation across micro-steps is fp32."""
    grad_sync: Literal["2hop", "every_step"] = "2hop"
    """"2hop": reduce-scatter in the partition group per micro-step, all-reduce in the
    replication group at the boundary; "every_step": all-reduce over all ranks every micro-step."""
    optimizer_sharding: Literal["auto", "partition", "world"] = "auto"
    """Where the optimizer state lives. "partition": each rank steps its whole shard (1/p of the
    model), so the d replicas of a shard hold the same optimizer state. "world" (asymmetric
    partitioning, the MiCS thesis's section 5.2.1): the boundary all-reduce over the replicas becomes
    a reduce-scatter, each rank steps 1/d of its shard (1/(p*d) of the model; in a pipeline 1/(t*d) of
    its stage) and all-gathers the updated parameters over the replicas. The same bytes cross the
    wire; the optimizer state (Adam's m and v) and the optimizer's compute shrink by d. With d = 1
    it changes nothing (``ResolvedPlan.optimizer_shards`` is 1). "auto" (the default): the lowering
    (``lowering.lowered.lower``) prices both on the cluster it schedules on and takes "world" where it
    is predicted at least 5% faster or alone fits the device; "partition" without a cluster, with d = 1
    or with ``grad_sync="every_step"``. ``print(step.program)`` says which and why."""
    codegen: Literal["auto", "eager", "inductor"] = "auto"
    """How the compute between communication points runs: "eager" op by op (ops with an ``out=``
    overload write into the arena); "inductor": each region compiled by Inductor (C++ on CPU, Triton
    on GPU), identical regions compiled once (micscompile.runtime.codegen); "auto": ``mc.compile``
    picks one by the cost model on the cluster it schedules on (``runtime.codegen.choose_codegen``:
    Inductor where fusing is predicted >= 5% faster and pays for its compile; ``step.codegen_choice``
    says which and why)."""
    cuda_graph: Literal["auto", True, False] = "auto"
    """Replay the whole step (every micro-step, the boundary, the optimizer) as one CUDA graph captured over the
    static arena after two eager steps (``runtime.cuda_graph``): no host cost per op. "auto": where nothing rules
    capture out (a CUDA device, a flat plan, no host synchronization in the step, a capturable optimizer);
    True: the same, or a ``PlanError`` naming what rules it out; ``step.cuda_graph_choice`` says which and why."""

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None, optional: bool = False) -> None:
            if value is None and optional:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"Plan.{name} must be a positive int, got {value!r}")

        positive("partition_size", self.partition_size, optional=True)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("context_parallel_size", self.context_parallel_size)
        if self.context_parallel_exchange != "ulysses":
            raise PlanError(f"Plan.context_parallel_exchange={self.context_parallel_exchange!r}: the built exchange is "
                            "'ulysses' (the ring and all-gather exchanges are priced by "
                            "cost_model.context_exchange, not built)")
        if self.context_parallel_size > 1 and (self.tensor_parallel_size > 1 or self.pipeline_stages > 1):
            raise PlanError("context_parallel_size > 1 composes with partition groups and the data-parallel ranks; "
                            "with tensor_parallel_size > 1 or pipeline_stages > 1 it is not built: use "
                            "context_parallel_size=1 there")
        positive("micro_batches", self.micro_batches)
        positive("pipeline_stages", self.pipeline_stages)
        positive("pipeline_chunks", self.pipeline_chunks, optional=True)
        check_kind(self.pipeline_schedule, self.chunks)  # (the schedules' one rule, core.schedules)
        if self.pipeline_chunks == 1 and self.pipeline_schedule in CHOSEN_CHUNKS:
            raise PlanError(f"pipeline_schedule={self.pipeline_schedule!r} runs v > 1 chunks per rank, got "
                            "pipeline_chunks=1: use pipeline_schedule='1f1b' for one")
        if self.chunks > 1 and self.pipeline_stages == 1:
            raise PlanError(f"pipeline_schedule={self.pipeline_schedule!r} interleaves {self.chunks} chunks per rank "
                            "of a pipeline: set pipeline_stages > 1 (or keep the default '1f1b' for a flat plan)")
        if self.sequence_parallel not in (True, False):
            raise PlanError(f"Plan.sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise PlanError("sequence_parallel=True splits the sequence over the tensor ranks: set "
                            "tensor_parallel_size > 1")
        if self.tensor_parallel_size > 1 and self.grad_sync != "2hop":
            raise PlanError("tensor_parallel_size > 1 syncs gradients in two hops (grad_sync='2hop') for now: "
                            "every-step all-reduces over the replicas of tensor groups are not built")
        if self.pipeline_stages > 1 and self.grad_sync != "2hop":
            raise PlanError("pipeline_stages > 1 syncs gradients in two hops (grad_sync='2hop'): "
                            "reduce-scatter inside the stage, all-reduce across replicas at the boundary")
        positive("memory_budget_bytes", self.memory_budget_bytes, optional=True)
        positive("bucket_bytes", self.bucket_bytes, optional=True)
        positive("max_gathers_in_flight", self.max_gathers_in_flight, optional=True)
        if self.cuda_graph not in ("auto", True, False):
            raise PlanError(f"Plan.cuda_graph must be 'auto', True or False, got {self.cuda_graph!r}")
        if self.hierarchical not in ("auto", True, False):
            raise PlanError(f"Plan.hierarchical must be 'auto', True or False, got {self.hierarchical!r}")
        if self.checkpoint not in (False, True, "selective", "attention"):
            raise PlanError(f"Plan.checkpoint must be False, True, 'selective' or 'attention', got {self.checkpoint!r}")
        positive("checkpoint_every", self.checkpoint_every)
        if self.offload_activations and not self.checkpoint:
            raise PlanError("offload_activations=True offloads the checkpointed segment outputs: set checkpoint=True "
                            "(or 'selective', 'attention') too")
        if self.grad_sync not in ("2hop", "every_step"):
            raise PlanError(f"Plan.grad_sync must be '2hop' or 'every_step', got {self.grad_sync!r}")
        if self.optimizer_sharding not in ("auto", "partition", "world"):
            raise PlanError(f"Plan.optimizer_sharding must be 'auto', 'partition' or 'world', "
                            f"got {self.optimizer_sharding!r}")
        if self.optimizer_sharding == "world" and self.grad_sync != "2hop":
            raise PlanError("optimizer_sharding='world' turns the boundary all-reduce over the replicas into a "
                            "reduce-scatter; grad_sync='every_step' has no boundary all-reduce: use grad_sync='2hop'")
        if self.codegen not in ("auto", "eager", "inductor"):
            raise PlanError(f"Plan.codegen must be 'auto', 'eager' or 'inductor', got {self.codegen!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in PRECISIONS:
                raise PlanError(f"Plan.{name} must be one of {', '.join(map(str, PRECISIONS))}, "
                                f"got {getattr(self, name)!r}")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.resolve(torch.distributed.get_world_size(), _nodes_known=False)  # (the world alone: no node size)

    def replace(self, **changes) -> Plan:
        return dataclasses.replace(self, **changes)

    @property
    def chunks(self) -> int:
        """v: model chunks per pipeline rank, ``pipeline_chunks`` or the schedule's."""
        if self.pipeline_chunks is not None:
            return self.pipeline_chunks
        return 2 if self.pipeline_schedule in INTERLEAVED else 1

    @property
    def weight_split(self) -> bool:
        """Whether each pipeline chunk's backward is cut into B and W (a zero-bubble schedule, S > 1;
        ``passes.weight_split``): what the lowering, the Program and the pricing ask."""
        return self.pipeline_stages > 1 and self.pipeline_schedule in ZERO_BUBBLE

    @property
    def loss_scaled(self) -> bool:
        """fp16 compute needs dynamic loss scaling (its gradients underflow); bf16 and fp32 do not."""
        return self.param_dtype == torch.float16

    def resolve(self, world_size: int, gpus_per_node: int | None = None, *, _nodes_known: bool = True) -> ResolvedPlan:
        """Concrete group sizes for ``world_size`` ranks in nodes of ``gpus_per_node`` (the cluster's or the
        launch's; None = one node); raises PlanError if impossible."""
        n = world_size
        if not isinstance(n, int) or n < 1:
            raise PlanError(f"the world size must be a positive number of ranks, got {n!r}")
        if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
            raise PlanError(f"gpus_per_node must be a positive number of ranks, got {gpus_per_node!r}")
        k = gpus_per_node or n
        if k > n:
            k = n
        if n % k:
            raise PlanError(
                f"gpus_per_node={k} does not divide world size {n}; valid: {', '.join(map(str, divisors(n)))}"
            )
        tp = self.tensor_parallel_size
        if tp > 1 and k % tp:
            raise PlanError(f"tensor_parallel_size={tp} must divide the {k} ranks of a node (tensor groups stay "
                            f"inside one); valid: {', '.join(map(str, divisors(k)))}")
        S, cp = self.pipeline_stages, self.context_parallel_size
        if n % (cp * tp):
            raise PlanError(f"context_parallel_size={cp} does not divide world size {n}; valid: "
                            f"{', '.join(map(str, divisors(n)))}")
        if n % (S * tp):
            what = f"pipeline_stages={S} x tensor_parallel_size={tp}" if tp > 1 else f"pipeline_stages={S}"
            raise PlanError(f"{what} does not divide world size {n}; valid pipeline_stages: "
                            f"{', '.join(map(str, divisors(n // tp) if n % tp == 0 else []))}")
        n, k = n // tp, k // tp  # below: in tensor groups (tp = 1: ranks)
        per_stage = n // S  # t * d groups hold each stage
        p = self.partition_size if self.partition_size is not None else min(k, per_stage)
        if p > per_stage or per_stage % p:
            what = "partition_size" if S == 1 else f"partition_size (t) with pipeline_stages={S}: S * t * d = n"
            raise PlanError(
                f"{what}: {p} does not divide {per_stage} (world size {n}); "
                f"valid partition sizes: {', '.join(map(str, divisors(per_stage)))}"
            )
        if self.hierarchical is True and _nodes_known and not (p > k and p % k == 0):
            raise PlanError(
                f"hierarchical=True needs a partition group spanning whole nodes (partition_size a multiple of "
                f"gpus_per_node={k}, larger than it), got partition_size={p}; valid: "
                f"{', '.join(str(q) for q in divisors(n) if q > k and q % k == 0) or 'none on this world'}"
            )
        if S > 1 and p > k:
            raise PlanError(f"with pipeline_stages > 1 each stage's partition group stays inside a node "
                            f"(partition_size <= gpus_per_node={k}), got {p}")
        if S > 1:
            check_schedule(self.pipeline_schedule, S, self.micro_batches, self.chunks)
        return ResolvedPlan(plan=self, world_size=n * tp, gpus_per_node=k * tp, partition_size=p,
                            replicas=n // (S * p), stages=S, tensor=tp, context=cp)


P1_BUCKET_BYTES = 25 << 20
"""The default bucket of a flat plan at p = 1: DDP's ``bucket_cap_mb`` (25). Per-block buckets there would buy
overlap with many small all-reduces; on 4 gloo ranks sharing 2 cores nothing overlaps, and one
large all-reduce after the backward was ~5% faster (docs/performance.md)."""


@dataclass(frozen=True)
class ResolvedPlan:
    """A Plan with its group sizes fixed for one world."""

    plan: Plan
    world_size: int
    """n: number of ranks."""
    gpus_per_node: int
    """k: ranks per node."""
    partition_size: int
    """p: ranks per partition group."""
    replicas: int
    """d = n / (S * p): ranks per replication group."""
    stages: int = 1
    """S: pipeline stages; each rank holds one stage (v chunks of the model with interleaving)."""
    tensor: int = 1
    """tp: ranks per tensor-parallel group (consecutive, inside a node); p, d and S count such groups."""
    context: int = 1
    """cp: ranks per context-parallel group (consecutive), sharing each sample's sequence; p and d count ranks (the
    partition and replication groups run over context ranks as over data-parallel ones)."""

    @property
    def micro_batches(self) -> int:
        return self.plan.micro_batches

    @property
    def second_hop_in_backward(self) -> bool:
        """A 2-hop plan over d > 1 replicas all-reduces each bucket over the replicas in its last
        backward (a pipeline chunk's: in the chunk's last backward), as soon as the bucket is reduced."""
        return self.plan.grad_sync == "2hop" and self.replicas > 1

    @property
    def optimizer_shards(self) -> int:
        """How many ranks split each partition-group shard for the optimizer: d with
        ``optimizer_sharding="world"``, else 1 (each replica steps its whole shard; "auto" is resolved by
        the lowering, ``lowering.lowered.lower``)."""
        return self.replicas if self.plan.optimizer_sharding == "world" else 1

    @property
    def bucket_bytes(self) -> int | None:
        """``Plan.bucket_bytes``, or its default for this partition size."""
        if self.plan.bucket_bytes is None and self.partition_size == 1 and self.stages == 1:
            return P1_BUCKET_BYTES
        return self.plan.bucket_bytes

    def __str__(self) -> str:
        pipe = f" S={self.stages} {self.plan.pipeline_schedule} v={self.plan.chunks}" if self.stages > 1 else ""
        plan = self.plan
        mixed = "" if plan.param_dtype == plan.reduce_dtype == torch.float32 else \
            f" param_dtype={str(plan.param_dtype)[6:]} reduce_dtype={str(plan.reduce_dtype)[6:]}"
        opt = " optimizer_sharding=world" if self.optimizer_shards > 1 else ""
        tp = f" tp={self.tensor}" if self.tensor > 1 else ""
        tp += f" cp={self.context}" if self.context > 1 else ""
        return (f"n={self.world_size} k={self.gpus_per_node}{tp} p={self.partition_size} d={self.replicas}{pipe} "
                f"s={self.micro_batches} grad_sync={plan.grad_sync}{mixed}{opt}")

    # ---- ranks: p, d and S count tensor groups (tp consecutive ranks); a group's ranks "b" below ----
    @property
    def groups_per_node(self) -> int:
        """k / tp: the tensor groups of one node."""
        return self.gpus_per_node // self.tensor

    def _ranks(self, groups, rank: int) -> tuple[int, ...]:
        """The ranks with ``rank``'s tensor index in tensor groups ``groups``."""
        return tuple(g * self.tensor + rank % self.tensor for g in groups)

    @property
    def spans_nodes(self) -> bool:
        """The partition group spans whole nodes: hierarchical collectives apply."""
        k = self.groups_per_node
        return self.partition_size > k and self.partition_size % k == 0

    def inter_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s partition group with its local index, one per node (stage 1)."""
        b, k, p = rank // self.tensor, self.groups_per_node, self.partition_size
        first = b - b % p
        return self._ranks(range(first + b % k, first + p, k), rank)

    def intra_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s partition group on its node (stage 3)."""
        b, k = rank // self.tensor, self.groups_per_node
        return self._ranks(range(b - b % k, b - b % k + k), rank)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def partition_ranks(self, rank: int) -> tuple[int, ...]:
        """The p ranks (consecutive tensor groups, this rank's tensor index) that hold one replica."""
        b, p = rank // self.tensor, self.partition_size
        return self._ranks(range(b - b % p, b - b % p + p), rank)

    def replication_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks with the same local index in every partition group (of the same stage)."""
        span = self.stages * self.partition_size
        return self._ranks(range(rank // self.tensor % span, self.world_size // self.tensor, span), rank)

    def stage_of(self, rank: int) -> int:
        """The pipeline stage ``rank`` runs (0 without pipelining)."""
        return rank // self.tensor % (self.stages * self.partition_size) // self.partition_size

    def pipe_ranks(self, rank: int) -> tuple[int, ...]:
        """The S ranks, one per stage, that carry ``rank``'s micro-batches through the pipeline."""
        b, p = rank // self.tensor, self.partition_size
        span = self.stages * p
        first = b - b % span + b % p
        return self._ranks(range(first, first + span, p), rank)

    def context_ranks(self, rank: int) -> tuple[int, ...]:
        """The cp consecutive ranks that share ``rank``'s samples, each holding 1/cp of the sequence."""
        return tuple(range(rank - rank % self.context, rank - rank % self.context + self.context))

    def tensor_ranks(self, rank: int) -> tuple[int, ...]:
        """The tp consecutive ranks that split each layer's compute with ``rank``."""
        return tuple(range(rank - rank % self.tensor, rank - rank % self.tensor + self.tensor))

    @property
    def data_parallel_size(self) -> int:
        """The ranks' distinct batches: n / (S * tp) (the tensor ranks of a group, and the stages of a pipe,
        share one)."""
        return self.world_size // (self.stages * self.tensor)
