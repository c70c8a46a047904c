"""The plans ``mc.autotune`` searches, and the ones it can rule out before pricing.

A point of the space is a :class:`Config`: pipeline stages S, partition size p (the intra-stage
t when S > 1), micro-batch size b (the micro-batch count follows from the global batch: every
rank of a stage trains on its own samples, so s = G / (b d p) = G S / (b n), docs/design.md's
m = G / (b d t)), model chunks per pipeline rank v (interleaved 1F1B), checkpointing, offload,
hierarchical collectives and where the optimizer states live (``Plan.optimizer_sharding``). Each is
priced with every prefetch choice (``passes.context.Prefetch``) that applies to it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from micscompile.core.plan import Plan, divisors
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

    def plan(self, base: Plan) -> Plan:
        return dataclasses.replace(
            base, partition_size=self.partition, pipeline_stages=self.stages, micro_batches=self.micro_batches,
            checkpoint=self.checkpoint, offload_activations=self.offload, hierarchical=self.hierarchical,
            pipeline_chunks=self.chunks, pipeline_schedule="interleaved" if self.chunks > 1 else base.pipeline_schedule,
            optimizer_sharding=self.optimizer)

    @property
    def structure(self) -> tuple:
        """The Programs a candidate's pricing shares with others (``micscompile.tune.repricing``)."""
        return self.stages, self.chunks, self.checkpoint, self.offload, self.partition == 1, self.optimizer


def configs(world: int, gpus_per_node: int, global_batch: int, units: int, *,
            partition_sizes: Sequence[int] | None = None, pipeline_stages: Sequence[int] | None = None,
            micro_batch_sizes: Sequence[int] | None = None, checkpoint: Sequence = CHECKPOINT,
            offload: Sequence[bool] = OFFLOAD, hierarchical: Sequence = HIERARCHICAL,
            chunks: Sequence[int] = CHUNKS, optimizer_sharding: Sequence[str] = OPTIMIZER_SHARDING) -> list[Config]:
    """Every valid point: S * p divides the world, b * n / S divides the global batch (default b: every
    such size up to MAX_MICRO_BATCH), a stage's partition group inside one node, at least two of the
    ``units`` blocks per chunk, interleaving (v > 1) where m is a multiple of S, offload only with
    checkpointing, hierarchical variants only where a partition group spans whole nodes, the optimizer
    states over the world only where d > 1. Fewer
    micro-batches than stages is allowed (the pipeline never fills; its bubble prices it)."""
    stages = pipeline_stages or [s for s in divisors(world) if 2 * s <= units]
    out = []
    for S in stages:
        if world % S:
            continue
        for p in partition_sizes or divisors(world // S):
            if (world // S) % p or (S > 1 and p > gpus_per_node):  # a stage's group stays in a node
                continue
            ways = world // S  # data-parallel ranks per stage: d replicas of p
            spans = p > gpus_per_node and p % gpus_per_node == 0
            for b in micro_batch_sizes or range(1, MAX_MICRO_BATCH + 1):
                if global_batch % (b * ways):
                    continue
                s = global_batch // (b * ways)
                vs = [v for v in chunks if v == 1 or (S > 1 and s % S == 0 and 2 * S * v <= units)]
                d = ways // p
                homes = [o for o in optimizer_sharding if o == "partition" or d > 1] or ["partition"]
                for v, ck, off, opt in itertools.product(vs, checkpoint, offload, homes):
                    if off and not ck:
                        continue
                    for hier in (hierarchical if spans else hierarchical[:1]):
                        out.append(Config(S, p, b, s, ck, off, hier, v, opt, d))
    return out


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
    return num_params * (bytes_per_param - optimizer_bytes + optimizer_bytes / shards) / (cfg.stages * cfg.partition)
