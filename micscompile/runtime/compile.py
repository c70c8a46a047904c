"""Emit: ``mc.compile`` -> ``TrainStep``, a callable that runs one optimizer step.

Order of work in ``compile`` (everything that can fail on bad input fails before the
first collective): resolve the Plan against the world, split the example batch,
trace one micro-batch on meta, plan buckets and layouts, run the passes, lower to a
Program, check the memory budget, probe the optimizer (``optim_check``); then the first
collective: the ranks exchange fingerprints of the Plan, the trace, the Program (and its
collective order) and the starting weights, and all refuse if any differ, naming the ranks
on each side; then the DeviceMesh ("replicate", "shard") and
this rank's shards.

``TrainStep.__call__`` runs the rewritten graph once per micro-batch (its
collectives are asynchronous and waited on where the graph needs them), accumulates
the gradient shards, runs the boundary sync (2hop: all-reduce over the replication
group), scales by 1 / (n * s) (the gradient of the global mean loss) and steps the
optimizer on the local fp32 shards.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from micscompile.core import collectives as C
from micscompile.core.collectives import Comm, GroupInfo
from micscompile.core.launch import step_device
from micscompile.core.plan import Plan, PlanError, ResolvedPlan
from micscompile.core.program import Prefetch
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import schedule
from micscompile.lowering.pipeline import lower_pipeline
from micscompile.lowering.predict import planned_groups
from micscompile.memory.arena import Arena
from micscompile.memory.lifetimes import arena_plan, buffers_as_run
from micscompile.runtime.codegen import CodegenReport, compile_regions
from micscompile.runtime.flat import TrainStep
from micscompile.runtime.materialize import check_initializable, fingerprint
from micscompile.runtime.optim_check import check_elementwise
from micscompile.runtime.pipeline import PipelineStep, pipeline_groups, split_chunks
from micscompile.runtime.step import OptimizerFactory
from micscompile.trace import TrainGraph, split_batch, trace

_device = step_device


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
        raise RuntimeError("compile failed on other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in failed))
    for key, hint in AGREEMENT_HINTS.items():
        by_value: dict[str, list[int]] = {}
        for r, (p, _) in enumerate(everyone):
            by_value.setdefault(p[key], []).append(r)
        if len(by_value) > 1:
            sides = " vs ".join(f"ranks {rs}" for rs in by_value.values())
            where = (_first_difference(order, world) if key == "collectives" else
                     _plan_difference(by_value) if key == "plan" else "")
            raise RuntimeError(f"{hint}: {sides}{where}")


_MESHES: dict[tuple, dict] = {}
"""Process groups already built in this process from DeviceMeshes, by (device type, d, p, k when
the partition group spans nodes), for the default group in ``_MESHES_WORLD``: compiling several
plans (tests, benchmarks, measured autotuning) reuses them instead of creating new ones (and their
communication threads) every time."""
_MESHES_WORLD: list = [None]


def _mesh_cache() -> dict:
    if _MESHES_WORLD[0] is not dist.group.WORLD:  # a new default group: the old meshes are dead
        _MESHES.clear()
        _MESHES_WORLD[0] = dist.group.WORLD
    return _MESHES


def _process_groups(device_type: str, rp: ResolvedPlan) -> dict:
    """Group name -> ProcessGroup: ("replicate", "shard") from a (d, p) DeviceMesh; when the partition
    group spans nodes, a (d, p/k, k) mesh ("replicate", "inter", "intra") whose last two dimensions,
    flattened, are "shard"."""
    _mesh_cache()
    d, p, k = rp.replicas, rp.partition_size, rp.gpus_per_node
    key = (device_type, d, p, k if rp.spans_nodes else None)
    if key not in _MESHES:
        if rp.spans_nodes:
            mesh = init_device_mesh(device_type, (d, p // k, k), mesh_dim_names=("replicate", "inter", "intra"))
            shard = mesh["inter", "intra"]._flatten("shard")
            _MESHES[key] = {name: mesh.get_group(name) for name in ("replicate", "inter", "intra")}
            _MESHES[key]["shard"] = shard.get_group()
        else:
            mesh = init_device_mesh(device_type, (d, p), mesh_dim_names=("replicate", "shard"))
            _MESHES[key] = {name: mesh.get_group(name) for name in ("replicate", "shard")}
    return _MESHES[key]


def _groups(rp: ResolvedPlan, rank: int, device: torch.device) -> dict[str, GroupInfo]:
    """The planned groups, with their ProcessGroups from DeviceMeshes (checked against the plan)."""
    groups = planned_groups(rp, rank)
    for name, pg in _process_groups(device.type, rp).items():
        actual = tuple(dist.get_process_group_ranks(pg))
        if actual != groups[name].ranks:
            raise RuntimeError(f"DeviceMesh {name} group is {actual}, expected {groups[name].ranks}")
        groups[name] = dataclasses.replace(groups[name], group=pg)
    return groups


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
) -> TrainStep:
    """Compile ``model`` + ``loss_fn`` into a distributed TrainStep for ``plan``.

    ``example_inputs`` is one local batch as ``step`` will receive it: the model gets
    the first ``num_model_inputs``, ``loss_fn(output, *rest)`` must return the mean
    loss of the batch. ``optimizer`` is called with this rank's fp32 parameter shards
    (elementwise optimizers such as SGD and AdamW give the unsharded result). A model
    on the meta device is initialised module by module with ``init_fn`` (default:
    each module's ``reset_parameters()``). Needs torch.distributed initialized.

    Where the gathers go (``passes.schedule``: prefetch distance, gathers issued across
    micro-steps, buckets kept live from forward into backward) is chosen under
    ``plan.memory_budget_bytes`` by simulating candidates on ``cluster`` (e.g.
    ``Cluster.preset("local")`` after calibrating); without a cluster, one use interval
    ahead where the budget allows. ``prefetch`` lists the candidates instead (``Prefetch``
    objects or distances).

    ``arena``: the collectives' buffers (gathered parameters, gradient buckets and shards)
    live at offsets planned from the Program in one arena allocated once (``memory_plan``);
    False allocates them per use like eager PyTorch.

    ``plan.codegen="inductor"``: the compute between communication points is compiled by Inductor
    here, before the first collective (a region it cannot compile raises ``CodegenError``);
    ``step.codegen`` lists the regions and their compile times (``micscompile.runtime.codegen``).

    ``timeout`` (seconds or a timedelta; default: the default process group's): how long any
    collective of the step may take. It is set on every process group the step uses (the
    DeviceMesh's subgroups would otherwise get the backend's default, 30 min on gloo). When a rank
    dies or hangs mid-step, the others raise ``CollectiveError`` naming the collective within
    it instead of waiting forever. On NCCL only with TORCH_NCCL_BLOCKING_WAIT=1 set before
    ``init_process_group`` (each wait then blocks the host); without it a ``timeout`` given here
    warns, and a failure kills the process through NCCL's watchdog (docs/gpu.md).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("mc.compile needs torch.distributed initialized (launch with torchrun and call "
                           "dist.init_process_group); mc.trace and mc.simulate do not")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a micscompile.Plan, got {type(plan).__name__}")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _device()
    if timeout is None:
        timeout = C.default_timeout()
    else:
        C.check_nccl_timeout(str(dist.get_backend()), device)
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
    prints, error, order = None, None, None
    try:  # everything that can fail on bad input, rank-local: no collective yet
        rp = plan.resolve(world, int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
        not_fp32 = [(n, str(p.dtype)) for n, p in model.named_parameters() if p.dtype != torch.float32]
        if not_fp32:
            raise PlanError(f"parameters must be float32 (the fp32 master weights; compute in low precision "
                            f"with Plan.param_dtype), got {not_fp32[:3]}")
        micro_example = split_batch(tuple(example_inputs), plan.micro_batches)[0]
        tg = trace(model, micro_example, loss_fn, num_model_inputs=num_model_inputs, param_dtype=plan.param_dtype,
                   device=device)
        check_initializable(model, init_fn)
        check_elementwise(optimizer, device)
        state_keys = list(model.state_dict(keep_vars=True).keys())
        if rp.stages > 1:
            program = lower_pipeline(tg, rp, cluster, planned_groups(rp, rank), rank, device=device,
                                     prefetch=prefetch, disable=disable_passes, log=log)
            buffers = buffers_as_run(program, arena)
            chunk_phases, codegen = split_chunks(program, device)
        else:
            sched = schedule(tg, rp, cluster, planned_groups(rp, rank), rank, device=device,
                             prefetch=prefetch, disable=disable_passes, log=log)
            ctx, graph, records, program = sched.ctx, sched.graph, sched.records, sched.program
            buffers = buffers_as_run(sched, arena)
            owned, planned = arena_plan(buffers) if arena else ([], None)
            gm = torch.fx.GraphModule(tg.gm, graph)
            codegen = CodegenReport(compile_regions(gm, device)) if plan.codegen == "inductor" else None
        order = program.collective_order()
        prints = {"plan": _plan_fingerprint(plan), "trace": _trace_fingerprint(tg),
                  "collectives": program.collective_fingerprint(), "program": program.fingerprint(),
                  "weights": fingerprint(model)}
    except Exception as exc:  # noqa: BLE001 - re-raised on this rank by _check_agreement
        error = exc
    _check_agreement(prints, error, world, order)
    if rp.stages > 1:
        groups = planned_groups(rp, rank)
        pipeline_groups(rp, device.type, groups, _mesh_cache())
        return PipelineStep(pp=program, graph=tg, model=model, groups=groups, optimizer_factory=optimizer,
                            state_keys=state_keys, device=device, init_fn=init_fn, cache=_mesh_cache(), arena=arena,
                            timeout=timeout, chunk_phases=chunk_phases, step_buffers=buffers, codegen=codegen)
    groups = _groups(rp, rank, device)
    program = dataclasses.replace(program, groups=groups)
    comm = Comm(ctx.layouts, groups["shard"], groups["replicate"], groups["world"], groups.get("inter"),
                groups.get("intra"), arena=None if planned is None else Arena(owned, planned, device))
    return TrainStep(
        gm=gm, program=program, comm=comm, groups=groups, graph=tg, model=model, init_fn=init_fn,
        optimizer_factory=optimizer, state_keys=state_keys, pass_records=records, device=device,
        step_buffers=buffers, timeout=timeout, codegen=codegen,
    )
