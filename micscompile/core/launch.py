"""A rank's device and its default process group, chosen in one place.

``init_distributed`` is how the demo and ``micscompile calibrate`` start under torchrun, and
``local_device`` is the rule the runtime follows too: the GPU is chosen and made current before
the process group exists (NCCL then builds its communicator on it, not on cuda:0), and every
rank gets its own GPU, never cuda:0 for all.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from micscompile.core.errors import UsageError

CUDA_BACKEND = "cpu:gloo,cuda:nccl"
"""CUDA tensors go over NCCL, host tensors (counts, timings) over gloo."""


def local_world_size() -> int | None:
    """Ranks per node as torchrun starts them (``LOCAL_WORLD_SIZE``); None outside torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None


def local_device() -> torch.device:
    """This rank's device: the CPU without CUDA; else the GPU the default group is bound to
    (``init_process_group(device_id=...)``), else cuda:LOCAL_RANK (torchrun sets it), else
    cuda:(rank % visible GPUs). One visible GPU is the rank's own (CUDA_VISIBLE_DEVICES per rank)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and getattr(dist.group.WORLD, "bound_device_id", None) is not None:
        return dist.group.WORLD.bound_device_id
    count = torch.cuda.device_count()
    if "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"])
        if index >= count > 1:
            raise UsageError(f"LOCAL_RANK={index}, but this machine shows {count} GPUs: start at most "
                               f"{count} ranks per node (torchrun --nproc-per-node)")
        return torch.device("cuda", index if count > 1 else 0)
    if dist.is_initialized():
        return torch.device("cuda", dist.get_rank() % count)
    if "RANK" in os.environ:
        return torch.device("cuda", int(os.environ["RANK"]) % count)
    raise UsageError("cannot tell which GPU this rank owns: set LOCAL_RANK (torchrun does), or RANK")


def step_device() -> torch.device:
    """The device a step of this rank runs on: its GPU, made current (``local_device``: never cuda:0
    for every rank), where the default group serves NCCL; else the CPU."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        device = local_device()
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """Where a small host-side collective on ``group`` (default: the world), a count or a time, must
    put its tensor: the current GPU where the group's backend serves CUDA only (plain "nccl"), else
    the CPU ("gloo", or "cpu:gloo,cuda:nccl" as ``launch.init_distributed`` makes it)."""
    parts = str(dist.get_backend(group)).split(",")
    if any(p.startswith("cpu:") or (":" not in p and p != "nccl") for p in parts):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def init_distributed(timeout: datetime.timedelta, **init) -> torch.device:
    """Start the default process group of this rank (torchrun's environment) and return its device.

    On CUDA: the rank's GPU (``local_device``) is made current first, then the group is created
    bound to it (``device_id``) with backend "cpu:gloo,cuda:nccl". Without CUDA: "gloo". ``init``:
    more arguments of ``init_process_group`` (e.g. ``init_method``, ``rank``, ``world_size``)."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(CUDA_BACKEND, timeout=timeout, device_id=device, **init)
    else:
        dist.init_process_group("gloo", timeout=timeout, **init)
    return device


def usable_cores() -> int:
    """The cores this process may run on (Linux: its affinity); 1 where forking workers is not the norm."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
