"""micscompile: a graph compiler for MiCS-style partitioned data-parallel training.

    plan = mc.Plan(partition_size=2, micro_batches=4)
    step = mc.compile(model, plan, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps),
                      example_inputs=(x, y))
    loss = step(x, y)

These are the names a user trains, plans and prices with (docs/design.md "Public API"); the IR and the
memory planner are ``micscompile.ir``'s.
"""

from micscompile import ir
from micscompile.core.collectives import CollectiveError, CommStats
from micscompile.core.errors import Error
from micscompile.core.plan import Plan, PlanError
from micscompile.core.program import Prefetch
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
from micscompile.memory.stats import MemoryStats
from micscompile.runtime.codegen import CodegenError, CodegenReport
from micscompile.runtime.compile import compile  # noqa: A004 - mc.compile is the public name (runtime.compile)
from micscompile.runtime.flat import TrainStep
from micscompile.runtime.param_groups import ShardParams, decay_groups
from micscompile.runtime.pipeline import PipelineStep
from micscompile.runtime.step import Step
from micscompile.trace import TraceError, TrainGraph, trace
from micscompile.tune.autotune import Candidate, autotune

__all__ = [
    # train: compile a step, run it
    "compile", "Plan", "Prefetch", "Step", "TrainStep", "PipelineStep", "ShardParams", "decay_groups",
    "CommStats", "MemoryStats", "CodegenReport", "backend", "MiCSBackend",
    # plan and price without the cluster
    "trace", "TrainGraph", "simulate", "Prediction", "step_memory", "autotune", "Candidate",
    "Cluster", "GpuSpec", "Link",
    # the formulas behind the figures (MFU, activation memory)
    "transformer_flops", "model_flops_per_token", "activation_bytes_per_layer",
    # errors: every one a micscompile.Error
    "Error", "PlanError", "TraceError", "ClusterError", "CollectiveError", "CodegenError", "CaptureError",
    "GraphBreakError",
    "ir",
]
