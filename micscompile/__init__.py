"""micscompile: a graph compiler for MiCS-style partitioned data-parallel training.

    plan = mc.Plan(partition_size=2, micro_batches=4)
    step = mc.compile(model, plan, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps),
                      example_inputs=(x, y))
    loss = step(x, y)
"""

from micscompile.collectives import CommStats
from micscompile.plan import Plan, PlanError, ResolvedPlan
from micscompile.program import Action, Kind, Program
from micscompile.runtime import TrainStep, compile
from micscompile.trace import TraceError, TrainGraph, trace

__all__ = [
    "Action", "CommStats", "Kind", "Plan", "PlanError", "Program", "ResolvedPlan", "TraceError",
    "TrainGraph", "TrainStep", "compile", "trace",
]
