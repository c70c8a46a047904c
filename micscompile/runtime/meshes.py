"""The ProcessGroups of a step, built from DeviceMeshes and checked against the planned groups
(``lowering.groups.planned_groups``): a flat plan's (d, p) or (d, p/k, k) mesh, a pipeline's
(d, S, t) mesh, each with a last "tensor" dimension of tp under tensor parallelism. Built once per
process and default group, reused by later compiles."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from micscompile.core.collectives import GroupInfo
from micscompile.core.errors import InternalError
from micscompile.core.plan import ResolvedPlan
from micscompile.lowering.groups import planned_groups

_MESHES: dict[tuple, dict] = {}
"""Process groups already built in this process from DeviceMeshes, by (device type, d, p, k when
the partition group spans nodes), for the default group in ``_MESHES_WORLD``: compiling several
plans (tests, benchmarks, measured autotuning) reuses them instead of creating new ones (and their
communication threads) every time."""
_MESHES_WORLD: list = [None]


def mesh_cache() -> dict:
    if _MESHES_WORLD[0] is not dist.group.WORLD:  # a new default group: the old meshes are dead
        _MESHES.clear()
        _MESHES_WORLD[0] = dist.group.WORLD
    return _MESHES


def _process_groups(device_type: str, rp: ResolvedPlan) -> dict:
    """Group name -> ProcessGroup: ("replicate", "shard") from a (d, p) DeviceMesh; when the partition
    group spans nodes, a (d, p/k, k) mesh ("replicate", "inter", "intra") whose last two dimensions,
    flattened, are "shard"; with tensor parallelism a last dimension of tp, "tensor" (k counting the
    node's tensor groups)."""
    mesh_cache()
    d, p, k, tp = rp.replicas, rp.partition_size, rp.groups_per_node, rp.tensor
    key = (device_type, d, p, k if rp.spans_nodes else None, tp)
    if key not in _MESHES:
        extra, names = ((tp,), ("tensor",)) if tp > 1 else ((), ())
        if rp.spans_nodes:
            mesh = init_device_mesh(device_type, (d, p // k, k, *extra), mesh_dim_names=("replicate", "inter", "intra",
                                                                                         *names))
            shard = mesh["inter", "intra"]._flatten("shard")
            _MESHES[key] = {name: mesh.get_group(name) for name in ("replicate", "inter", "intra", *names)}
            _MESHES[key]["shard"] = shard.get_group()
        else:
            mesh = init_device_mesh(device_type, (d, p, *extra), mesh_dim_names=("replicate", "shard", *names))
            _MESHES[key] = {name: mesh.get_group(name) for name in ("replicate", "shard", *names)}
    return _MESHES[key]


def _context_groups(device_type: str, rp: ResolvedPlan) -> dict:
    """"context" -> the ProcessGroup of this rank's cp consecutive ranks, from an (n / cp, cp) DeviceMesh."""
    mesh_cache()
    key = ("context", device_type, rp.world_size, rp.context)
    if key not in _MESHES:
        mesh = init_device_mesh(device_type, (rp.world_size // rp.context, rp.context),
                                mesh_dim_names=("samples", "context"))
        _MESHES[key] = {"context": mesh.get_group("context")}
    return _MESHES[key]


def flat_groups(rp: ResolvedPlan, rank: int, device: torch.device) -> dict[str, GroupInfo]:
    """The planned groups, with their ProcessGroups from DeviceMeshes (checked against the plan)."""
    groups = planned_groups(rp, rank)
    found = dict(_process_groups(device.type, rp))
    if rp.context > 1:
        found.update(_context_groups(device.type, rp))
    for name, pg in found.items():
        actual = tuple(dist.get_process_group_ranks(pg))
        if actual != groups[name].ranks:
            raise InternalError(f"DeviceMesh {name} group is {actual}, expected {groups[name].ranks}")
        groups[name] = dataclasses.replace(groups[name], group=pg)
    return groups


def pipeline_groups(rp: ResolvedPlan, device_type: str, groups: dict[str, GroupInfo], cache: dict) -> None:
    """Attach ProcessGroups from a (d, S, t) DeviceMesh to the planned groups (in place)."""
    key = ("pipe", device_type, rp.replicas, rp.stages, rp.partition_size, rp.tensor)  # never a flat plan's key
    if key not in cache:
        extra, names = ((rp.tensor,), ("tensor",)) if rp.tensor > 1 else ((), ())
        mesh = init_device_mesh(device_type, (rp.replicas, rp.stages, rp.partition_size, *extra),
                                mesh_dim_names=("replicate", "pipe", "shard", *names))
        cache[key] = {name: mesh.get_group(name) for name in ("replicate", "pipe", "shard", *names)}
    for name, pg in cache[key].items():
        actual = tuple(dist.get_process_group_ranks(pg))
        if actual != groups[name].ranks:
            raise InternalError(f"DeviceMesh {name} group is {actual}, expected {groups[name].ranks}")
        groups[name] = GroupInfo(name, pg, actual, groups[name].rank, groups[name].spans_nodes)
