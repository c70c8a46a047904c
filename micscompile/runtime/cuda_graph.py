"""The whole step as one CUDA graph (``Plan.cuda_graph``, issue 57).

The static memory plan gives a step what CUDA graphs need: every planned buffer's address fixed when the step is
built, the shards, gradients and optimizer state allocated once. ``GraphedStep`` runs the step's first
``WARMUP_STEPS`` eagerly on a side stream (the optimizer's state, NCCL's communicators, cuBLAS's workspaces and
Inductor's autotuning are made then), captures the third call whole (every micro-step, the boundary, the
optimizer step) over static copies of the batch, and replays it from then on: the host queues one graph instead
of every op. (On one H100, ``benchmarks/gpu/capture_probe.py``: a host-bound small step 4-6x faster replayed, the
303M GPT's 1-8%; docs/gpu.md.)

What rules capture out is found before the step runs, every part of it checkable on a CPU:

* ``static_blockers``, before any collective: a device other than CUDA; a pipeline (its point-to-point sends
  are posted from the host's schedule); activation offload (host copies); ``optimizer_sharding="world"`` (its
  update all-gathers stay in flight from one step into the next); fp16's loss scale (the host decides whether
  to back off and skip).
* ``optimizer_blockers``, when the optimizer exists: one that keeps its step count on the host
  (``capturable=False``; turned on where micscompile chose the fused kernel), or, with ``max_grad_norm``, one
  that cannot skip a non-finite step on the device (``device_skip``: torch's fused kernels take ``found_inf``;
  a captured step skips there, ``Step._device_skip``).
* ``HostSyncProbe`` counts the ops of a step that make the host wait for the device (``.item()``, ``bool()``
  of a tensor, data-dependent shapes): the tests run a CPU step under it, so a synchronization added to the
  step path without a blocker that names it fails there.
* at each call: the batch's shapes and dtypes (a graph replays fixed ones), and the optimizer's hyperparameters
  (a float learning rate is baked into the graph: a change recaptures, a tensor one is read in place).
"""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from micscompile.core.plan import PlanError

aten = torch.ops.aten

WARMUP_STEPS = 2
"""Eager steps before the capture: the first makes the optimizer's state, the second runs every path once more
as the graph will (lazily created communicators and workspaces exist by then)."""

HOST_SYNC_OPS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
                           aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
                           aten.repeat_interleave.Tensor})
"""Ops whose result the host must wait for: a scalar read (``.item()``, ``bool()``, ``float()`` of a tensor) or an
output whose shape depends on the data. A CUDA graph can hold none of them."""


@dataclass(frozen=True)
class GraphChoice:
    """What ``Plan.cuda_graph`` resolved to and why (``step.cuda_graph_choice``)."""

    captured: bool
    reason: str

    def __str__(self) -> str:
        return f"cuda_graph: {'captured' if self.captured else 'off'} ({self.reason})"


def static_blockers(device: torch.device, plan) -> list[str]:
    """What rules capture out for a step of ``plan`` (a ``ResolvedPlan`` as lowered) on ``device``, known before
    any collective; each names the cause and what would lift it."""
    out = []
    if device.type != "cuda":
        out.append(f"the step runs on {device.type}: CUDA graphs need a CUDA device")
    if plan.stages > 1:
        out.append("a pipeline (pipeline_stages > 1) posts its point-to-point sends from the host's schedule: "
                   "not captured yet")
    if plan.plan.offload_activations:
        out.append("offload_activations copies segment outputs to and from host memory: not captured")
    if plan.optimizer_shards > 1:
        out.append("optimizer_sharding='world' leaves its update all-gathers in flight into the next step, and a "
                   "graph ends with its work: optimizer_sharding='partition' captures")
    if plan.plan.loss_scaled:
        out.append("a host synchronization: fp16's loss scale reads on the host whether the gradient norm is finite, "
                   "to back off and skip the step; bf16 captures")
    return out


def device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device: torch's fused kernels take ``found_inf`` and leave
    every piece and its state as they were where it is nonzero (what ``max_grad_norm``'s finite check needs
    without the host)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups)


def optimizer_blockers(optimizer: torch.optim.Optimizer, fused_by_us: bool, clipped: bool) -> list[str]:
    """What in ``optimizer`` rules capture out, once capture is otherwise decided. Adam's and AdamW's (and
    others') step count lives on the host unless ``capturable=True``: where micscompile chose the fused kernel
    (``fused_by_us``) it turns ``capturable`` on, which the fused kernel computes the same with. With
    ``max_grad_norm`` (``clipped``), a non-finite step is skipped on the device, which needs a fused kernel
    (``device_skip``)."""
    out = []
    name = type(optimizer).__name__
    groups = [g for g in optimizer.param_groups if "capturable" in g and not g["capturable"]]
    if groups and fused_by_us and not optimizer.state:
        for g in optimizer.param_groups:
            g["capturable"] = True
        optimizer.defaults["capturable"] = True
    elif groups:
        out.append(f"the optimizer ({name}) keeps its step count on the host: construct it with capturable=True")
    if clipped and not device_skip(optimizer):
        out.append(f"a host synchronization: with max_grad_norm the step reads whether the gradient norm is finite, "
                   f"to skip a non-finite step, and {name} cannot skip on the device (torch's fused Adam and AdamW "
                   "can: fused=True, or leave the choice to micscompile)")
    return out


def resolve(setting, blockers: list[str]) -> GraphChoice:
    """``Plan.cuda_graph`` against what rules capture out: True with a blocker is a ``PlanError``."""
    if setting is False:
        return GraphChoice(False, "Plan.cuda_graph=False")
    if blockers:
        if setting is True:
            raise PlanError("Plan.cuda_graph=True cannot capture this step: " + "; ".join(blockers))
        return GraphChoice(False, "auto: " + "; ".join(blockers))
    return GraphChoice(True, "auto: nothing rules capture out" if setting == "auto" else "Plan.cuda_graph=True")


class HostSyncProbe(TorchDispatchMode):
    """Records, while active, each op that makes the host wait for the device (``HOST_SYNC_OPS``: a scalar read,
    a data-dependent shape) and each copy from a device to the host, with the lines that called it. On a CPU
    step nothing waits, but the ops are the ones that would on CUDA: the tests run steps under it."""

    def __init__(self, host_scalars: set[int] = frozenset()) -> None:
        super().__init__()
        self.host_scalars = host_scalars
        """ids of tensors that live on the host on every device (torch.optim's step counts without
        ``capturable``): reading them waits for nothing."""
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func in (aten._to_copy.default, aten.copy_.default) and _to_host(func, args, kwargs)
        if (func in HOST_SYNC_OPS and id(args[0]) not in self.host_scalars) or to_host:
            where = " | ".join(line.strip().splitlines()[0] for line in traceback.format_stack(limit=8)[:-2])
            self.seen.append(f"{func}: {where}")
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    src = args[0] if func is aten._to_copy.default else args[1]
    dst = kwargs.get("device") if func is aten._to_copy.default else args[0].device
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
        and torch.device(dst).type == "cpu"


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The values a captured optimizer step bakes in: every non-tensor entry of every group (a tensor one, such as
    ``lr=torch.tensor(...)``, is read in place by the graph)."""
    return [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
            for g in optimizer.param_groups]


class GraphedStep:
    """Runs a ``Step``'s work as one CUDA graph after ``WARMUP_STEPS`` eager steps (see the module docstring)."""

    def __init__(self, step, forced: bool) -> None:
        self.step = step
        self.forced = forced
        """Plan.cuda_graph=True: a batch the graph cannot take is an error (else it runs eagerly)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.out: torch.Tensor | None = None
        self.calls = 0
        self.captures = 0
        """How many times the step was captured (more than once: the optimizer's hyperparameters changed)."""
        self._hyper: list[dict] | None = None
        self._per_replay: dict = {}
        self._warned = False

    def __call__(self, batch) -> torch.Tensor:
        step = self.step
        clipped_on_host = step.max_grad_norm is not None and not step._device_skip  # (max_grad_norm set later)
        if step.track_memory or clipped_on_host:
            if self.forced and clipped_on_host:
                raise PlanError("Plan.cuda_graph=True: step.max_grad_norm was set after mc.compile, and this "
                                "optimizer can only skip a non-finite step from the host")
            return step._step(batch)  # eagerly: the memory probe counts eager ops; the finite check syncs
        self.calls += 1
        if self.calls <= WARMUP_STEPS:
            return self._on_side_stream(batch)
        if self.graph is not None and not self._fits(batch):
            return step._step(batch)
        if self.graph is None or _hyperparameters(step.optimizer) != self._hyper:
            self._capture(batch)  # (its collectives counted as the capture queued them)
        else:
            self._count()
        for s, x in zip(self.static, batch):
            s.copy_(x, non_blocking=True)
        self.graph.replay()
        step.steps += 1
        return self.out.clone()  # (the graph's output is overwritten by the next replay)

    def _on_side_stream(self, batch) -> torch.Tensor:
        side = torch.cuda.Stream(self.step.device)
        side.wait_stream(torch.cuda.current_stream(self.step.device))
        with torch.cuda.stream(side):
            out = self.step._step(batch)
        torch.cuda.current_stream(self.step.device).wait_stream(side)
        return out

    def _fits(self, batch) -> bool:
        same = all(s.shape == x.shape and s.dtype == x.dtype for s, x in zip(self.static, batch))
        if same:
            return True
        what = (f"the batch's shapes {[tuple(x.shape) for x in batch]} differ from the captured "
                f"{[tuple(s.shape) for s in self.static]}")
        if self.forced:
            raise PlanError(f"Plan.cuda_graph=True: {what}; a graph replays fixed shapes (pad the batch, or "
                            "cuda_graph='auto' to run such a step eagerly)")
        if not self._warned:
            warnings.warn(f"cuda_graph: {what}: this step runs eagerly (as does any other such step)", stacklevel=4)
            self._warned = True
        return False

    def _capture(self, batch) -> None:
        step = self.step
        if self.graph is not None and not self._warned:
            warnings.warn("cuda_graph: the optimizer's hyperparameters changed since the capture (a float learning "
                          "rate is baked into the graph): recapturing; a tensor learning rate (lr=torch.tensor(...)) "
                          "is read in place", stacklevel=4)
            self._warned = True
        self.static = [x.to(step.device).clone() for x in batch]
        self.graph = torch.cuda.CUDAGraph()
        before = {k: vars(r).copy() for k, r in step._stats.rows.items()}
        with torch.cuda.graph(self.graph):
            self.out = step._step(self.static)
        step.steps -= 1  # the capture queued the work, it did not run it
        self._per_replay = {k: {f: v - before.get(k, {}).get(f, 0) for f, v in vars(r).items()}
                            for k, r in step._stats.rows.items()}
        self._hyper = _hyperparameters(step.optimizer)
        self.captures += 1

    def _count(self) -> None:
        """Add one replay's collectives to the step's ``comm_stats`` (the host no longer calls them)."""
        rows = self.step._stats.rows
        for key, delta in self._per_replay.items():
            row = rows[key]
            for f, v in delta.items():
                setattr(row, f, getattr(row, f) + v)
