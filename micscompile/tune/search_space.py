"""The plans ``mc.autotune`` searches, and the ones it can rule out before pricing.

A point of the space is a :class:`Config`: pipeline stages S, tensor groups of t ranks (sequence
parallelism or not), partition size p (over the data-parallel ranks of a stage; a stage's p * t ranks
inside a node when S > 1), micro-batch size b (the micro-batch count follows from the global batch:
every data-parallel rank of a stage trains on its own samples, so s = G / (b d p) = G S t / (b n),
docs/design.md's m = G / (b d t)), model chunks per pipeline rank v (interleaved 1F1B), checkpointing,
offload, hierarchical collectives and where the optimizer states live (``Plan.optimizer_sharding``).
Each is priced with every prefetch choice (``passes.context.Prefetch``) that applies to it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from micscompile.core.plan import Plan, PlanError, divisors
from micscompile.core.program import Prefetch
from micscompile.cost_model.simulator import OPTIMIZER_STATE_BYTES_PER_PARAM

MAX_MICRO_BATCH = 32
CHECKPOINT = (False, True, "selective")
OFFLOAD = (False, True)
HIERARCHICAL = ("auto", False)
FLAT_PREFETCH = (Prefetch(distance=1), Prefetch(distance=2), Prefetch(distance=1, across_micro_steps=True),
                 Prefetch(distance=1, keep_live=2))
"""FSDP's one-ahead, deeper, across micro-steps, keeping the last forward buckets live."""
PIPELINE_PREFETCH = (Prefetch(distance=1), Prefetch(distance=2))
"""Inside a pipeline chunk gathers are neither kept live nor issued across micro-steps."""
OPTIMIZER_SHARDING = ("partition", "world")
"""Over the partition group, or over all p * d ranks (only where d > 1: with one replica they are the same)."""
CHUNKS = (1, 2)
"""v: plain 1F1B, or interleaved with two chunks per rank where m is a multiple of S."""
ZERO_BUBBLE = (False, True)
"""A pipeline's backward whole (1F1B, interleaved 1F1B) or split into B and W (ZB-H1, interleaved zero-bubble)."""


def tensor_choices(sizes: Sequence[int], sequence_parallel: bool = True) -> tuple[tuple[int, bool], ...]:
    """The (t, sequence parallelism) pairs of tensor group sizes ``sizes``: each t > 1 with and without sequence
    parallelism (only without where ``sequence_parallel`` is False)."""
    return tuple((t, sp) for t in sizes for sp in ((False, True) if t > 1 and sequence_parallel else (False,)))


TENSOR_SIZES = (1, 2, 4, 8)
"""Megatron's tensor group sizes: each that divides a node (8 GPUs at most)."""
TENSOR = tensor_choices(TENSOR_SIZES)
"""The (t, sequence parallelism) pairs ``mc.autotune`` searches by default."""


def family(stages: int, tensor: int) -> str:
    """Which of the seeds' systems a plan is: "MiCS" (sharding alone), "MiCS-Pipe" (stages of sharded ranks),
    "PTD-P" (tensor groups, with stages or not, sharded over p or not)."""
    return "PTD-P" if tensor > 1 else "MiCS-Pipe" if stages > 1 else "MiCS"


@dataclass(frozen=True)
class Config:
    stages: int
    partition: int
    micro_batch: int
    micro_batches: int
    checkpoint: bool | str
    offload: bool
    hierarchical: bool | str
    chunks: int = 1
    optimizer: str = "partition"
    """``Plan.optimizer_sharding``."""
    replicas: int = 1
    """d: ranks holding the same shard."""
    tensor: int = 1
    """t: ranks of a tensor group (``Plan.tensor_parallel_size``)."""
    sequence: bool = False
    """``Plan.sequence_parallel``."""
    zero_bubble: bool = False
    """A pipeline's zero-bubble schedule: ZB-H1 (v = 1) or interleaved zero-bubble (v > 1)."""

    @property
    def schedule(self) -> str | None:
        """``Plan.pipeline_schedule`` (None: the base plan's, v = 1 without zero bubble)."""
        if self.chunks > 1:
            return "interleaved-zb" if self.zero_bubble else "interleaved"
        return "zb-h1" if self.zero_bubble else None

    def plan(self, base: Plan) -> Plan:
        return dataclasses.replace(
            base, partition_size=self.partition, pipeline_stages=self.stages, micro_batches=self.micro_batches,
            tensor_parallel_size=self.tensor, sequence_parallel=self.sequence,
            checkpoint=self.checkpoint, offload_activations=self.offload, hierarchical=self.hierarchical,
            pipeline_chunks=self.chunks if self.chunks > 1 else None, pipeline_schedule=self.schedule or base.pipeline_schedule,
            optimizer_sharding=self.optimizer)

    @property
    def structure(self) -> tuple:
        """The Programs a candidate's pricing shares with others (``micscompile.tune.repricing``)."""
        return (self.tensor, self.sequence, self.stages, self.chunks, self.checkpoint, self.offload, self.partition == 1,
                self.optimizer, self.zero_bubble)

    @property
    def family(self) -> str:
        return family(self.stages, self.tensor)


def configs(world: int, gpus_per_node: int, global_batch: int, units: int, *,
            partition_sizes: Sequence[int] | None = None, pipeline_stages: Sequence[int] | None = None,
            micro_batch_sizes: Sequence[int] | None = None, checkpoint: Sequence = CHECKPOINT,
            offload: Sequence[bool] = OFFLOAD, hierarchical: Sequence = HIERARCHICAL,
            chunks: Sequence[int] = CHUNKS, optimizer_sharding: Sequence[str] = OPTIMIZER_SHARDING,
            tensor: Sequence[tuple[int, bool]] = ((1, False),), zero_bubble: Sequence[bool] = (False,)) -> list[Config]:
    """Every valid point: S * p divides the world, b * n / S divides the global batch (default b: every
    such size up to MAX_MICRO_BATCH), a stage's partition group inside one node, at least two of the
    ``units`` blocks per chunk, interleaving (v > 1) where m is a multiple of S, offload only with
    checkpointing, hierarchical variants only where a partition group spans whole nodes, the optimizer
    states over the world only where d > 1, and a pipeline fed at least as many micro-batches as it has
    stages: with fewer it never fills, its bubble ((S - 1) / m of its work) exceeds its work, and the
    same batch leaves most of the ranks idle most of the step (7 samples on 16 ranks would rank
    16-stage pipelines idle 13 times as long as they compute). So every plan needs a global
    batch of at least n * b: one sample per rank, in each stage's data-parallel ranks (``smallest_batch``).
    ``tensor``: the (t, sequence parallelism) pairs; a t must divide the node, and a pipeline stage's p * t
    ranks stay inside one node. ``zero_bubble``: a pipeline's schedule with its backward whole and/or split
    (``Config.schedule``)."""
    stages = pipeline_stages or default_stages(world, units)
    out = []
    for (t, sp), S in itertools.product(tensor, stages):
        if world % (S * t) or gpus_per_node % t or (sp and t == 1):
            continue
        for p in partition_sizes or divisors(world // (S * t)):
            if (world // (S * t)) % p or (S > 1 and p * t > gpus_per_node):  # a stage's group stays in a node
                continue
            ways = world // (S * t)  # data-parallel ranks per stage: d replicas of p
            spans = p * t > gpus_per_node and p * t % gpus_per_node == 0
            for b in micro_batch_sizes or range(1, MAX_MICRO_BATCH + 1):
                if global_batch % (b * ways):
                    continue
                s = global_batch // (b * ways)
                if s < S:  # the pipeline would never fill
                    continue
                vs = [v for v in chunks if v == 1 or (S > 1 and s % S == 0 and 2 * S * v <= units)]
                d = ways // p
                homes = [o for o in optimizer_sharding if o == "partition" or d > 1] or ["partition"]
                zbs = zero_bubble if S > 1 else (False,)
                for v, ck, off, opt, zb in itertools.product(vs, checkpoint, offload, homes, zbs):
                    if off and not ck:
                        continue
                    for hier in (hierarchical if spans else hierarchical[:1]):
                        out.append(Config(S, p, b, s, ck, off, hier, v, opt, d, t, sp, zb))
    return out


def check_global_batch(world: int, global_batch: int, tensor: Sequence[tuple[int, bool]] = ((1, False),),
                       gpus_per_node: int = 1) -> None:
    """Refuse, before anything is traced, a global batch no plan can split: every plan needs one sample per
    tensor group at least (``configs``: b * n / t <= batch; t the largest of ``tensor``'s sizes that divides the
    node and the world), and ``world`` samples always work (flat, b = 1, t = 1)."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise PlanError(f"global_batch_size must be a positive number of samples, got {global_batch!r}")
    t = max((t for t, _ in tensor if gpus_per_node % t == 0 and world % t == 0), default=1)
    least = world // t
    if global_batch < least:
        groups = f"tensor group of {t} ranks" if t > 1 else "rank"
        raise PlanError(f"a global batch of {global_batch} cannot keep {world} ranks busy: every plan trains at least "
                        f"one sample per {groups} (a pipeline of S stages at least S micro-batches); the smallest "
                        f"that works is {least}, or use fewer ranks")


def default_stages(world: int, units: int) -> list[int]:
    """The pipeline depths searched by default: every S dividing the world with at least two blocks a stage."""
    return [s for s in divisors(world) if 2 * s <= units]


def smallest_batch(world: int, global_batch: int, units: int, *, pipeline_stages: Sequence[int] | None = None,
                   micro_batch_sizes: Sequence[int] | None = None, **narrowed) -> int | None:
    """The smallest global batch of at least ``global_batch`` that some point of ``configs``' space (the same
    arguments) splits over ``world`` ranks, or None if none does: of the batches divisible by b * n / S and at
    least b * n, for each (S, b) the space allows, the first that some point takes."""
    stages, sizes = pipeline_stages or default_stages(world, units), micro_batch_sizes or range(1, MAX_MICRO_BATCH + 1)
    tried = sorted({max(global_batch, b * world) + (-max(global_batch, b * world)) % (b * world // S)
                    for S in stages if world % S == 0 for b in sizes})
    return next((g for g in tried if configs(world, global_batch=g, units=units, pipeline_stages=stages,
                                              micro_batch_sizes=sizes, **narrowed)), None)


def prefetches(cfg: Config) -> tuple[Prefetch, ...]:
    """The prefetch choices priced for ``cfg`` (none to choose with p = 1: nothing is gathered)."""
    if cfg.partition == 1:
        return (Prefetch(distance=0),)
    if cfg.stages > 1:
        return PIPELINE_PREFETCH
    return tuple(pf for pf in FLAT_PREFETCH if cfg.micro_batches > 1 or not pf.across_micro_steps)


def state_floor_bytes(num_params: int, cfg: Config, bytes_per_param: int = 16,
                      optimizer_bytes: int = OPTIMIZER_STATE_BYTES_PER_PARAM) -> float:
    """A lower bound of any rank's model-state bytes: its stage's share of the fp32 weights,
    gradients and Adam state (``optimizer_bytes`` of the ``bytes_per_param``: over d times more ranks
    with the optimizer states over the world), evenly split (the busiest stage holds at least the average)."""
    shards = cfg.replicas if cfg.optimizer == "world" else 1
    return num_params * (bytes_per_param - optimizer_bytes + optimizer_bytes / shards) / (
        cfg.stages * cfg.partition * cfg.tensor)
