"""``Lowered``: what one rank of a plan runs, flat or pipeline, behind one interface
(docs/design.md#data-flow). ``lower`` is the one place that tells the two apart; callers
(``mc.compile``, ``mc.simulate``, the CLI, the memory estimate) use the interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from micscompile.core.collectives import CommStats
from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Prefetch, Program
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.context_split import context_split
from micscompile.lowering.flat import LoweredFlat, lower_flat
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.pipeline import LoweredPipeline, lower_pipeline
from micscompile.lowering.tensor_split import tensor_split
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

    def rewrite_for_runtime(self, arena: bool) -> list[Buffer]:
        """Run the runtime's passes on this rank's graphs (transposes of transposes folded; with an
        arena, ops writing into it), then return the step's buffers as the runtime runs them."""


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
    trace = tensor_split(trace, rp.tensor, rp.plan.sequence_parallel)  # (a trace split for it: as it is)
    trace = context_split(trace, rp.context)  # (a trace of one context rank's tokens; split for it: as it is)
    if rp.plan.optimizer_sharding == "auto":
        return _choose_optimizer_home(trace, rp, cluster, groups, rank, device=device, prefetch=prefetch, costs=costs,
                                      need_graph=need_graph, disable=disable, log=log)
    if rp.stages > 1:
        return lower_pipeline(trace, rp, cluster, groups, rank, device=device, prefetch=prefetch, costs=costs,
                              disable=disable, log=log)
    return lower_flat(trace, rp, cluster, groups, rank, device=device, prefetch=prefetch, costs=costs,
                      need_graph=need_graph, disable=disable, log=log)


OPTIMIZER_WORLD_MIN_GAIN = 0.05
"""``Plan.optimizer_sharding="auto"`` takes "world" where it is predicted at least this much faster than
"partition" (the threshold of ``runtime.codegen``'s Inductor rule; the two homes are priced by the same
model on the same trace, so their ratio is surer than either step time: this machine's cost model is
within 6-13% median, the presets' held-out rows 8-15%), or where only "world" fits the device."""


def _choose_optimizer_home(trace: TrainGraph, rp: ResolvedPlan, cluster: Cluster | None, groups: dict, rank: int,
                           **kw) -> LoweredFlat | LoweredPipeline:
    """``Plan.optimizer_sharding="auto"``: "partition" unless the plan has a boundary reduction over
    d > 1 replicas and a cluster to price on; then both priced as ``mc.simulate`` prices a plan (rank
    0's Programs, so that every rank chooses alike), "world" taken by ``OPTIMIZER_WORLD_MIN_GAIN``
    where it fits or where only it fits, and only the choice lowered for ``rank``. The choice and
    its prediction join the ``choice`` line of this rank's Programs."""
    def plan_of(home: str) -> ResolvedPlan:
        return dataclasses.replace(rp, plan=rp.plan.replace(optimizer_sharding=home))

    if rp.replicas == 1 or rp.plan.grad_sync != "2hop" or cluster is None:
        return lower(trace, plan_of("partition"), cluster, groups, rank, **kw)
    costs = kw.get("costs") or {}
    t_part, t_world = (lower(trace, plan_of(home), cluster, prefetch=kw.get("prefetch"), costs=costs,
                             need_graph=False).predict(cluster, **costs) for home in ("partition", "world"))
    world_fits, part_fits = t_world.fits(cluster), t_part.fits(cluster)
    gain = t_part.step_time_s / t_world.step_time_s
    only_world_fits = world_fits and not part_fits
    home = "world" if only_world_fits or (gain >= 1 + OPTIMIZER_WORLD_MIN_GAIN and (world_fits or not part_fits)) \
        else "partition"
    why = ("only it fits" if only_world_fits else
           f"{gain:.2f}x faster than over the partition group ({t_part.step_time_s * 1e3:.3f} ms)" if home == "world"
           else f"over the world {gain:.2f}x faster ({t_world.step_time_s * 1e3:.3f} ms), under "
                f"{1 + OPTIMIZER_WORLD_MIN_GAIN:.2f}x")
    chosen = lower(trace, plan_of(home), cluster, groups, rank, **kw)
    line = (f"optimizer states over the {'world' if home == 'world' else 'partition group'} (auto, priced on "
            f"{cluster.name}): {why}")
    for program in chosen.programs().values():
        program.note_choice(line)
    return chosen
