"""micscompile: a graph compiler for MiCS-style partitioned data-parallel training.

    plan = mc.Plan(partition_size=2, micro_batches=4)
    step = mc.compile(model, plan, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps),
                      example_inputs=(x, y))
    loss = step(x, y)
"""

from micscompile.core.collectives import CollectiveError, CommStats
from micscompile.core.errors import Error
from micscompile.core.plan import Plan, PlanError, ResolvedPlan
from micscompile.core.program import Action, Kind, Prefetch, Program
from micscompile.cost_model.simulator import Prediction
from micscompile.cost_model.specs import Cluster, ClusterError, GpuSpec, Link
from micscompile.dynamo import CaptureError, GraphBreakError, MiCSBackend, backend
from micscompile.lowering.predict import (
    activation_bytes_per_layer,
    model_flops_per_token,
    simulate,
    step_memory,
    transformer_flops,
)
from micscompile.memory.planner import Buffer, MemoryPlan, MemoryPlanError, plan_memory
from micscompile.memory.stats import MemoryStats
from micscompile.runtime.codegen import CodegenError, CodegenReport
from micscompile.runtime.compile import compile  # noqa: A004 - mc.compile is the public name (runtime.compile)
from micscompile.runtime.flat import TrainStep
from micscompile.runtime.param_groups import ShardParams, decay_groups
from micscompile.trace import TraceError, TrainGraph, trace
from micscompile.tune.autotune import Candidate, autotune

__all__ = [
    "Action", "Buffer", "Error", "CaptureError", "Candidate", "CodegenError", "CodegenReport", "GraphBreakError",
    "MiCSBackend", "autotune", "backend", "Cluster", "ClusterError", "CollectiveError", "CommStats", "GpuSpec", "Kind",
    "Link", "MemoryPlan", "MemoryPlanError",
    "MemoryStats", "Plan", "PlanError", "Prediction", "Prefetch", "Program", "ResolvedPlan", "ShardParams", "TraceError",
    "TrainGraph", "TrainStep", "activation_bytes_per_layer", "compile",
    "decay_groups", "plan_memory", "simulate", "step_memory", "trace",
    "transformer_flops", "model_flops_per_token",
]
