"""``mc.compile`` -> a ``Step`` (``TrainStep`` or ``PipelineStep``) that runs one optimizer step.

Order of work in ``compile`` (everything that can fail on bad input fails before the
first collective): resolve the Plan against the world, split the example batch,
trace one micro-batch on meta, plan buckets and layouts, run the passes, lower to a
Program, check the memory budget, probe the optimizer (``optim_check``); then the first
collective: the ranks exchange fingerprints of the Plan, the trace, the Program (and its
collective order) and the starting weights, and all refuse if any differ, naming the ranks
on each side; then the step class of the lowering (``STEP_OF``) builds the DeviceMeshes
and this rank's shards (``Step.build``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from micscompile.core import collectives as C
from micscompile.core.errors import CompileError, InputTypeError, UsageError
from micscompile.core.launch import local_world_size, step_device
from micscompile.core.plan import Plan, PlanError
from micscompile.core.program import Prefetch
from micscompile.cost_model.specs import Cluster, default_cluster
from micscompile.lowering.context_split import context_split
from micscompile.lowering.flat import LoweredFlat
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.lowered import lower
from micscompile.lowering.pipeline import LoweredPipeline
from micscompile.lowering.tensor_split import tensor_split
from micscompile.memory.lifetimes import arena_offsets
from micscompile.runtime import cuda_graph
from micscompile.runtime.codegen import choose_codegen
from micscompile.runtime.flat import TrainStep
from micscompile.runtime.materialize import check_initializable, fingerprint
from micscompile.runtime.optim_check import check_elementwise
from micscompile.runtime.pipeline import PipelineStep
from micscompile.runtime.step import EvalSource, OptimizerFactory, Step
from micscompile.trace import META_FQN, TrainGraph, context_part, split_batch, trace

_device = step_device

STEP_OF: dict[type, type[Step]] = {LoweredFlat: TrainStep, LoweredPipeline: PipelineStep}
"""The step class that runs each kind of ``Lowered``."""


AGREEMENT_HINTS = {
    "plan": "ranks were given different Plans",
    "trace": "ranks traced different graphs (model code, parameter shapes, or batch shapes and dtypes differ)",
    "collectives": "ranks would issue different collectives (model, plan or batch differ), a deadlock",
    "program": "ranks compiled different programs (model, plan or batch differ)",
    "weights": "ranks start from different weights (seed every rank the same, e.g. torch.manual_seed, "
               "or load the same checkpoint)",
}


def _plan_fingerprint(plan: Plan) -> tuple:
    """The Plan's fields as (name, repr) pairs: compared across ranks, the differing fields are named."""
    return tuple((f.name, repr(getattr(plan, f.name))) for f in dataclasses.fields(plan))


def _trace_fingerprint(tg: TrainGraph) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in (tg.gm.code, repr(tg.input_specs), repr(sorted(tg.param_shapes.items())), repr(tg.compute_dtype)):
        h.update(part.encode())
    return h.hexdigest()


def _plan_difference(by_value: dict) -> str:
    """"; micro_batches: 1 on ranks [0, 2, 3], 2 on ranks [1]" for the fields that differ."""
    fields = [name for name, _ in next(iter(by_value))]
    parts = []
    for i, name in enumerate(fields):
        by_field: dict[str, list[int]] = {}
        for value, ranks in by_value.items():
            by_field.setdefault(value[i][1], []).extend(ranks)
        if len(by_field) > 1:
            parts.append(f"{name}: " + ", ".join(f"{v} on ranks {sorted(rs)}" for v, rs in by_field.items()))
    return "; " + "; ".join(parts)


def _first_difference(order: list[str], world: int) -> str:
    """Where the ranks' collective orders part (a second exchange, on the error path only)."""
    orders: list = [None] * world
    dist.all_gather_object(orders, order)
    i = next(i for i in range(max(map(len, orders)) + 1) if len({tuple(o[i:i + 1]) for o in orders}) > 1)
    by_item: dict[str, list[int]] = {}
    for r, o in enumerate(orders):
        by_item.setdefault(o[i] if i < len(o) else "(none: the step has ended)", []).append(r)
    return f"; first difference at collective #{i}: " + ", ".join(f"ranks {rs} {c}" for c, rs in by_item.items())


def _check_agreement(
    prints: dict[str, str] | None, error: BaseException | None, world: int, order: list[str] | None = None,
) -> None:
    """The first collective: every rank shares its fingerprints, or the error it hit compiling.

    Any rank's error makes every rank raise (nobody is left waiting in a collective); so
    does any disagreement, naming the ranks on each side (and, for collective orders, the
    first collective where they part).
    """
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (prints, f"{type(error).__name__}: {error}" if error else None))
    if error is not None:
        raise error
    failed = [(r, msg) for r, (_, msg) in enumerate(everyone) if msg]
    if failed:
        raise CompileError("compile failed on other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in failed))
    for key, hint in AGREEMENT_HINTS.items():
        by_value: dict[str, list[int]] = {}
        for r, (p, _) in enumerate(everyone):
            by_value.setdefault(p[key], []).append(r)
        if len(by_value) > 1:
            sides = " vs ".join(f"ranks {rs}" for rs in by_value.values())
            where = (_first_difference(order, world) if key == "collectives" else
                     _plan_difference(by_value) if key == "plan" else "")
            raise CompileError(f"{hint}: {sides}{where}")


def compile(  # noqa: A001 - the public name is part of the contract (mc.compile)
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: OptimizerFactory,
    example_inputs: Sequence[torch.Tensor],
    init_fn: Callable[[nn.Module], None] | None = None,
    num_model_inputs: int = 1,
    cluster: Cluster | None = None,
    prefetch: Sequence[Prefetch | int] | None = None,
    disable_passes: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
    arena: bool = True,
    timeout: float | datetime.timedelta | None = None,
    max_grad_norm: float | None = None,
) -> Step:
    """Compile ``model`` + ``loss_fn`` into a distributed TrainStep for ``plan``.

    ``example_inputs`` is one local batch as ``step`` will receive it: the model gets
    the first ``num_model_inputs``, ``loss_fn(output, *rest)`` must return the mean
    loss of the batch, or ``(loss_sum, count)``: then the step divides the sum over every
    micro-batch and rank by the global count (the whole-batch token mean with padding or
    ``ignore_index``, however unevenly spread) and returns that mean. ``optimizer`` is called with
    this rank's fp32 parameter shards, a ``ShardParams`` list that also knows their names and full
    shapes (``mc.decay_groups``; elementwise optimizers such as SGD and AdamW give the unsharded
    result). A model
    on the meta device is initialised module by module with ``init_fn`` (default:
    each module's ``reset_parameters()``). Needs torch.distributed initialized.

    Where the gathers go (``lowering.flat``: prefetch distance, gathers issued across
    micro-steps, buckets kept live from forward into backward) and which buckets gather
    hierarchically are chosen under ``plan.memory_budget_bytes`` by simulating candidates on
    ``cluster``; without one, on this device's (``cost_model.specs.default_cluster``: the preset of
    the machines a known GPU comes in; on CPU this machine's calibration, ``micscompile calibrate``,
    else a built-in estimate; an unknown GPU: one use interval ahead, unpriced). ``print(step.program)``
    shows the cluster, the choice and its predicted gain. ``prefetch`` lists the candidates instead
    (``Prefetch`` objects or distances). The nodes are ``cluster``'s (``Cluster.gpus_per_node`` ranks each:
    where partition groups and hierarchical collectives cross nodes), else torchrun's (``LOCAL_WORLD_SIZE``).

    ``arena``: the collectives' buffers (gathered parameters, gradient buckets and shards)
    live at offsets planned from the Program in one arena allocated once (``memory.planner``);
    False allocates them per use like eager PyTorch.

    ``plan.codegen="inductor"``: the compute between communication points is compiled by Inductor
    here, before the first collective (a region it cannot compile raises ``CodegenError``);
    ``step.codegen`` lists the regions and their compile times (``micscompile.runtime.codegen``).
    ``"auto"`` (the default) picks eager or Inductor by the cost model on the same cluster as the
    schedule; ``step.codegen_choice`` says which and why.

    ``timeout`` (seconds or a timedelta; default: the default process group's): how long any
    collective of the step may take. It is set on every process group the step uses (the
    DeviceMesh's subgroups would otherwise get the backend's default, 30 min on gloo). When a rank
    dies or hangs mid-step, the others raise ``CollectiveError`` naming the collective within
    it instead of waiting forever. On NCCL only with TORCH_NCCL_BLOCKING_WAIT=1 set before
    ``init_process_group`` (each wait then blocks the host); without it a ``timeout`` given here
    warns, and a failure kills the process through NCCL's watchdog (docs/gpu.md).

    A model that checkpoints itself (``torch.utils.checkpoint``: Hugging Face's
    ``gradient_checkpointing_enable()``, torchtitan's, ``checkpoint_wrapper``) is traced without its
    own recomputation and compiled with ``Plan(checkpoint=True)``: every block recomputed in
    backward where its gather serves it (``step.program.plan`` shows it; the numbers are eager's).

    ``max_grad_norm``: clip the global L2 norm of the gradient (every element once, after the
    boundary reduction) to it before each optimizer step, as ``torch.nn.utils.clip_grad_norm_``
    does; ``step.grad_norm`` holds the norm before clipping (``float("inf")``: measure, never clip).
    A step whose norm is not finite is skipped on every rank (``step.skipped_steps``). Costs one
    all-reduce of a scalar and one host sync per step (``docs/training.md``); a step replayed as a CUDA graph
    (``Plan.cuda_graph``) skips on the device instead, through the fused optimizer's ``found_inf``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("mc.compile needs torch.distributed initialized (launch with torchrun and call "
                           "dist.init_process_group); mc.trace and mc.simulate do not")
    if not isinstance(plan, Plan):
        raise InputTypeError(f"plan must be a micscompile.Plan, got {type(plan).__name__}")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _device()
    if timeout is None:
        timeout = C.default_timeout()
    else:
        C.check_nccl_timeout(str(dist.get_backend()), device)
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
    prints, error, order, graph_choice = None, None, None, None
    try:  # everything that can fail on bad input, rank-local: no collective yet
        _check_max_grad_norm(max_grad_norm)
        launched = local_world_size()  # the node size: the cluster's where one is given, else the launch's
        rp = plan.resolve(world, cluster.gpus_per_node if cluster is not None else launched)
        plan_choices = [] if plan.partition_size is not None else [
            f"partition_size: {rp.partition_size} (the default: one node's {rp.gpus_per_node // rp.tensor} "
            f"{'tensor groups' if rp.tensor > 1 else 'ranks'}, at most a stage's)"]
        if cluster is not None and launched is not None and min(launched, world) != rp.gpus_per_node:
            plan_choices.append(f"gpus_per_node: {rp.gpus_per_node} (the cluster's, planned for; the launch runs "
                                f"{launched} ranks per node)")
        if plan.optimizer_sharding == "world" and rp.replicas == 1:
            warnings.warn(f"optimizer_sharding='world' changes nothing with d = 1 replica ({rp}): the partition "
                          "group already holds one copy of the optimizer state", stacklevel=2)
        not_fp32 = [(n, str(p.dtype)) for n, p in model.named_parameters() if p.dtype != torch.float32]
        if not_fp32:
            raise PlanError(f"parameters must be float32 (the fp32 master weights; compute in low precision "
                            f"with Plan.param_dtype), got {not_fp32[:3]}")
        micro_example = context_part(split_batch(tuple(example_inputs), plan.micro_batches)[0], rp.context, 0)
        tg = trace(model, micro_example, loss_fn, num_model_inputs=num_model_inputs, param_dtype=plan.param_dtype,
                   device=device, loss_scale=plan.loss_scaled, source_lines=rp.tensor > 1)  # (a refusal's line)
        if tg.self_checkpoints and not plan.checkpoint:  # the model checkpoints itself: the Plan recomputes
            rp = plan.replace(checkpoint=True).resolve(world, rp.gpus_per_node)
            plan_choices.append("checkpoint: True (the model checkpoints itself: recomputed by the plan)")
        tg = tensor_split(tg, rp.tensor, rp.plan.sequence_parallel)  # what a tensor rank runs (tp = 1: the trace)
        tg = context_split(tg, rp.context)  # what a context rank runs (cp = 1: as it is)
        check_kernels(tg, device)
        check_initializable(model, init_fn)
        check_elementwise(optimizer, device)
        state_keys = list(model.state_dict(keep_vars=True).keys())
        if cluster is None:  # price the schedule on this device's cluster (None: an unknown GPU)
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            cluster = default_cluster(device.type, name, world, rp.gpus_per_node)
        if cluster is not None and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            cluster = cluster.with_tf32()  # this process's fp32 matmuls run in TF32: priced so, everywhere below
        # the optimizer's capture conditions, on a probe of the factory (no collective yet), probed once
        probe = functools.cache(functools.partial(cuda_graph.probe_optimizer_blockers, optimizer, device,
                                                  max_grad_norm is not None))
        blocking_wait = C.nccl_blocking_wait()
        codegen_choice = None
        if rp.plan.codegen == "auto":  # eager or Inductor, priced on the same cluster, replayed if it will be
            captured = cuda_graph.expected(plan.cuda_graph, device, rp, probe, blocking_wait)
            codegen_choice = choose_codegen(tg, rp, cluster, captured=captured)
            rp = dataclasses.replace(rp, plan=rp.plan.replace(codegen=codegen_choice.codegen))
        lowered = lower(tg, rp, cluster, planned_groups(rp, rank), rank, device=device, prefetch=prefetch,
                        disable=disable_passes, log=log)
        if isinstance(lowered, LoweredFlat):  # the boundary as the step will run it
            lowered = dataclasses.replace(lowered, program=lowered.program.with_step_reductions(
                tg.counted_loss, max_grad_norm is not None or plan.loss_scaled))
        lowered_plan = lowered.program.plan if isinstance(lowered, LoweredFlat) else rp
        graph_choice = cuda_graph.choose(plan.cuda_graph, device, lowered_plan, probe, blocking_wait)
        kind = STEP_OF[type(lowered)]
        buffers = lowered.rewrite_for_runtime(arena)
        offsets = arena_offsets(buffers) if arena else None
        prepared = kind.prepare(lowered, tg, device)
        order = lowered.collective_order()
        prints = {"plan": (*_plan_fingerprint(plan), ("max_grad_norm", repr(max_grad_norm))), "trace": _trace_fingerprint(tg),
                  "collectives": lowered.collective_fingerprint(), "program": lowered.fingerprint(),
                  "weights": fingerprint(model)}
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank by _check_agreement
        error = exc
    _check_agreement(prints, error, world, order)
    step = kind.build(lowered, prepared, graph=tg, model=model, init_fn=init_fn, optimizer_factory=optimizer,
                      state_keys=state_keys, device=device, step_buffers=buffers, arena_offsets=offsets, timeout=timeout)
    step.codegen_choice = codegen_choice
    step.plan_choices = plan_choices
    step.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
    if graph_choice.captured:  # the step's optimizer as its probe was (capturable turned on where the probe's was)
        graph_choice = cuda_graph.resolve(plan.cuda_graph, cuda_graph.optimizer_blockers(
            step.optimizer, step.fused_optimizer, clipped=max_grad_norm is not None), rp.world_size)
    step.cuda_graph_choice = graph_choice
    if graph_choice.captured:
        step._device_skip = cuda_graph.device_skip(step.optimizer)
        step._graphed = cuda_graph.GraphedStep(step, forced=plan.cuda_graph is True)
    step.eval_source = EvalSource(model, loss_fn, micro_example, num_model_inputs, lowered)
    return step


def check_kernels(tg: TrainGraph, device: torch.device) -> None:
    """Refuse, before any collective, a graph with an op the device has no kernel for. Known case:
    ``histc`` on integers, which only CUDA implements; model code that branches on ``device.type``
    (transformers' MoE routing) takes its non-CPU branch when traced on the meta device."""
    if device.type != "cpu":
        return
    for n in tg.gm.graph.nodes:
        if n.target is torch.ops.aten.histc.default:
            arg = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            if arg is not None and not arg.dtype.is_floating_point:
                where = n.meta.get(META_FQN) or "<root>"
                raise PlanError(f"module '{where}' computes histc on {arg.dtype}, which the CPU has no kernel for: "
                                "model code that picks a path by device.type (e.g. transformers' MoE routing) took "
                                "its GPU path when traced on the meta device; run it on CUDA")


def _check_max_grad_norm(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"max_grad_norm must be a positive number (float('inf') to measure the norm without "
                        f"clipping) or None, got {value!r}")
