"""The process groups a rank belongs to under a resolved plan, as the runtime's DeviceMeshes will
build them (names, ranks, node spans; no ProcessGroup): docs/design.md#glossary-and-formulas."""

from __future__ import annotations

from micscompile.core.collectives import GroupInfo
from micscompile.core.plan import ResolvedPlan


def planned_groups(rp: ResolvedPlan, rank: int = 0) -> dict[str, GroupInfo]:
    """The groups ``rank`` belongs to under ``rp``, with node spans from gpus_per_node."""
    k = rp.gpus_per_node

    def info(name: str, ranks: tuple[int, ...]) -> GroupInfo:
        return GroupInfo(name, None, ranks, ranks.index(rank), len({r // k for r in ranks}) > 1)

    groups = {
        "shard": info("shard", rp.partition_ranks(rank)),
        "replicate": info("replicate", rp.replication_ranks(rank)),
        "world": info("world", tuple(range(rp.world_size))),
    }
    if rp.stages > 1:  # the ranks that carry this rank's micro-batches through the pipeline
        groups["pipe"] = info("pipe", rp.pipe_ranks(rank))
    if rp.spans_nodes:  # the two stages of hierarchical collectives
        groups["inter"] = info("inter", rp.inter_ranks(rank))
        groups["intra"] = info("intra", rp.intra_ranks(rank))
    if rp.tensor > 1:  # the ranks that split each layer's compute with this one
        groups["tensor"] = info("tensor", rp.tensor_ranks(rank))
    if rp.context > 1:  # the ranks that share this one's samples, each a piece of the sequence
        groups["context"] = info("context", rp.context_ranks(rank))
    return groups
