"""micscompile: a graph compiler for MiCS-style partitioned data-parallel training.

    plan = mc.Plan(partition_size=2, micro_batches=4)
    step = mc.compile(model, plan, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps),
                      example_inputs=(x, y))
    loss = step(x, y)
"""

from micscompile.collectives import CommStats
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster, GpuSpec, Link
from micscompile.passes.context import Prefetch
from micscompile.plan import Plan, PlanError, ResolvedPlan
from micscompile.predict import simulate, transformer_flops
from micscompile.program import Action, Kind, Program
from micscompile.runtime import TrainStep, compile
from micscompile.trace import TraceError, TrainGraph, trace

__all__ = [
    "Action", "Cluster", "CommStats", "GpuSpec", "Kind", "Link", "Plan", "PlanError", "Prediction", "Prefetch",
    "Program",
    "ResolvedPlan", "TraceError", "TrainGraph", "TrainStep", "compile", "simulate", "trace", "transformer_flops",
]
