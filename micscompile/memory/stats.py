"""What ``step.memory_stats()`` reports: the arena, what stays outside it, and the comparison.

Three views of one step's buffers (``lifetimes``) on one rank:

* the arena: the collectives' buffers at planned offsets (``arena_bytes`` against its
  lower bound L);
* outside it: the buffers the ops allocate themselves (activations, temporaries), as
  planned from the lifetimes and as measured (``TrainStep.track_memory``);
* every step buffer planned in one arena (``step_plan``) against PyTorch's caching
  allocator replaying the same allocation trace (``caching_allocator``): what planning
  saves over what PyTorch would have reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

from micscompile.core.collectives import fmt_bytes
from micscompile.cost_model.caching_allocator import AllocatorStats, replay_buffers
from micscompile.memory.lifetimes import in_arena, on_device
from micscompile.memory.planner import Buffer, MemoryPlan, lower_bound_bytes, plan_memory


def live_peak_bytes(buffers: list[Buffer]) -> int:
    """Most bytes live at once (unaligned)."""
    return lower_bound_bytes(buffers, alignment=1)


@dataclass(frozen=True)
class MemoryStats:
    arena_bytes: int
    """The arena this rank allocated once (0: no arena)."""
    arena_lower_bound_bytes: int
    arena_buffers: int
    """Planned buffers the arena serves per step."""
    outside_planned_peak_bytes: int
    """Most bytes the buffers not in the arena (all of them without one) hold at once, from the lifetimes."""
    outside_measured_peak_bytes: int | None
    """Most bytes ops allocated outside the arena at once, over the steps run with ``track_memory``."""
    step_plan: MemoryPlan
    """Every step buffer in device memory (the arena's and the ops') planned in one arena."""
    caching_allocator: AllocatorStats
    """The same buffers replayed through a simulation of PyTorch's CUDA caching allocator."""
    evaluate_measured_peak_bytes: int | None = None
    """Most bytes ``Step.evaluate`` allocated at once (its gathered parameters included: it has no
    arena), over the calls made with ``track_memory``."""

    @classmethod
    def of(cls, buffers: list[Buffer], arena: MemoryPlan | None, measured: int | None = None,
           evaluate: int | None = None) -> MemoryStats:
        """``buffers``: the step's (``lifetimes``); ``arena``: the plan of arena's ones (``lifetimes.in_arena``)
        (None: no arena)."""
        outside = [b for b in buffers if arena is None or not in_arena(b)]
        return cls(
            arena_bytes=arena.arena_bytes if arena is not None else 0,
            arena_lower_bound_bytes=arena.lower_bound_bytes if arena is not None else 0,
            arena_buffers=len(buffers) - len(outside) if arena is not None else 0,
            outside_planned_peak_bytes=live_peak_bytes(outside),
            outside_measured_peak_bytes=measured,
            step_plan=plan_memory(on_device(buffers)),
            caching_allocator=replay_buffers(on_device(buffers)),
            evaluate_measured_peak_bytes=evaluate,
        )

    def __str__(self) -> str:
        sp, ca = self.step_plan, self.caching_allocator
        measured = "not measured (step.track_memory = True counts the ops run eagerly; Inductor's kernels " \
            "allocate unseen)" if self.outside_measured_peak_bytes is None \
            else fmt_bytes(self.outside_measured_peak_bytes)
        return "\n".join([
            f"arena            {fmt_bytes(self.arena_bytes)} for {self.arena_buffers} buffers per step "
            f"(lower bound {fmt_bytes(self.arena_lower_bound_bytes)})",
            f"outside arena    planned peak {fmt_bytes(self.outside_planned_peak_bytes)}, measured peak {measured}",
            f"all step buffers planned {fmt_bytes(sp.arena_bytes)} = {sp.arena_bytes / max(sp.lower_bound_bytes, 1):.3f} x "
            f"L ({fmt_bytes(sp.lower_bound_bytes)}); PyTorch caching allocator would reserve "
            f"{fmt_bytes(ca.peak_reserved_bytes)} ({ca.peak_reserved_bytes / max(sp.arena_bytes, 1):.2f} x the plan)",
            *([] if self.evaluate_measured_peak_bytes is None else
              [f"evaluate         measured peak {fmt_bytes(self.evaluate_measured_peak_bytes)} (no arena)"]),
        ])
