"""What every pass may read: the resolved plan, the trace's bookkeeping, the layouts."""

from __future__ import annotations

from dataclasses import dataclass

from micscompile.plan import ResolvedPlan
from micscompile.sharding import BucketLayout
from micscompile.trace import TrainGraph


@dataclass(frozen=True)
class PassContext:
    """Read-only inputs shared by the passes of one compilation."""

    plan: ResolvedPlan
    graph: TrainGraph
    """The trace (its ``gm`` is the pre-pass graph; passes get their own copy)."""
    layouts: tuple[BucketLayout, ...]
    block_bucket: dict[str, int]
    """Block FQN -> bucket index."""
