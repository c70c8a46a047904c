"""``Lowered``: what one rank of a plan runs, flat or pipeline, behind one interface
(docs/design.md#data-flow). ``lower`` is the one place that tells the two apart; callers
(``mc.compile``, ``mc.simulate``, the CLI, the memory estimate) use the interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from micscompile.core.collectives import CommStats
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Prefetch, Program
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import LoweredFlat, lower_flat
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.pipeline import LoweredPipeline, lower_pipeline
from micscompile.memory.planner import Buffer
from micscompile.passes.context import CPU
from micscompile.trace import TrainGraph


class Lowered(Protocol):
    """One rank's lowering of a plan: ``LoweredFlat`` or ``LoweredPipeline``."""

    plan: ResolvedPlan
    rank: int

    def programs(self) -> dict[int, Program]:
        """This rank's Programs by part: the flat plan's one (0), or each chunk this rank runs."""

    def collective_order(self) -> list[str]:
        """What every rank must agree on before the first collective."""

    def fingerprint(self) -> str: ...

    def collective_fingerprint(self) -> str: ...

    @property
    def peak_gathered_bytes(self) -> int: ...

    def comm_stats(self, stats: CommStats | None = None) -> CommStats:
        """One step's predicted collectives on this rank (calls and wire bytes per collective and group)."""

    def wire_bytes(self) -> dict[tuple[str, str], int]: ...

    def predict(self, cluster: Cluster | None = None, *, buffer_bytes: int = 0, flops_per_step: float | None = None,
                scaling: bool = False, **costs) -> Prediction:
        """One optimizer step simulated on ``cluster`` (default: the one it was lowered for)."""

    def rewrite_for_arena(self, arena: bool) -> list[Buffer]:
        """Rewrite this rank's graphs so that ops write into the arena (with one), then return the
        step's buffers as the runtime runs them."""


def lower(
    trace: TrainGraph, rp: ResolvedPlan, cluster: Cluster | None = None, groups: dict | None = None, rank: int = 0,
    *, device: torch.device = CPU, prefetch: Sequence[Prefetch | int] | None = None, costs: dict | None = None,
    need_graph: bool = True, disable=(), log=None,
) -> LoweredFlat | LoweredPipeline:
    """Lower ``trace`` under ``rp`` for ``rank`` (no process group needed; ``groups`` default to the
    planned ones). A plan with pipeline stages is split and every chunk lowered
    (``lower_pipeline``); otherwise the prefetch search picks the flat Program (``lower_flat``).
    ``need_graph=False``: a flat plan's Program alone (a pipeline always rewrites its rank's chunks)."""
    groups = planned_groups(rp, rank) if groups is None else groups
    if rp.stages > 1:
        return lower_pipeline(trace, rp, cluster, groups, rank, device=device, prefetch=prefetch, costs=costs,
                              disable=disable, log=log)
    return lower_flat(trace, rp, cluster, groups, rank, device=device, prefetch=prefetch, costs=costs,
                      need_graph=need_graph, disable=disable, log=log)
