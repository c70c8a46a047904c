"""The whole step as one CUDA graph (``Plan.cuda_graph``).

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
* ``optimizer_blockers``, before any collective on a probe of the factory (``probe_optimizer_blockers``) and
  again on the step's own optimizer: one that keeps its step count on the host
  (``capturable=False``; turned on where micscompile chose the fused kernel), or, with ``max_grad_norm``, one
  that cannot skip a non-finite step on the device (``device_skip``: torch's fused kernels take ``found_inf``;
  a captured step skips there, ``Step._device_skip``).
* ``HostSyncProbe`` counts the ops of a step that make the host wait for the device (``.item()``, ``bool()``
  of a tensor, data-dependent shapes): the tests run a CPU step under it, so a synchronization added to the
  step path without a blocker that names it fails there.
* once the step has run (``host_state``): optimizer state left on the host (a Python step count, a CPU tensor),
  which a replay would not advance: the step runs eagerly ("auto") or raises (True).
* at each call: what the graph bakes in, ``max_grad_norm`` and the optimizer's hyperparameters (a float learning
  rate; a device tensor is read in place): a change recaptures, up to ``MAX_CAPTURES``. The batch's shapes are
  fixed already (``check_batch``: a step runs the shape it was compiled for).
* "auto" keeps a step over several ranks eager: a replayed collective is outside NCCL's watchdog, so a dead rank
  would hang the others with no timeout (``SEVERAL_RANKS``); True captures it anyway, and
  ``TORCH_NCCL_BLOCKING_WAIT=1`` (a wait that polls from the host) rules it out.
* what none of these foresaw: a capture that fails (CUDA refuses an op under capture) leaves the step's bookkeeping
  as before the call (nothing ran) and keeps no graph; "auto" warns and runs the step eagerly from then on, True
  raises from the failure.

The capture runs on the warm-up's side stream (not the one stream torch gives every capture without one) in
``capture_error_mode="thread_local"``: another thread's CUDA call, a DataLoader pinning memory, does not end it.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from micscompile.core.optim import prefer_fused
from micscompile.core.plan import PlanError
from micscompile.runtime.param_groups import probe_params

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


def static_blockers(device: torch.device, plan, blocking_wait: bool = False) -> list[str]:
    """What rules capture out for a step of ``plan`` (a ``ResolvedPlan`` as lowered) on ``device``, known before
    any collective; each names the cause and what would lift it. ``blocking_wait``: NCCL's Work.wait() polls
    its event from the host (``TORCH_NCCL_BLOCKING_WAIT=1``), which a capture forbids."""
    out = []
    if device.type != "cuda":
        out.append(f"the step runs on {device.type}: CUDA graphs need a CUDA device")
    if blocking_wait and plan.world_size > 1:
        out.append("TORCH_NCCL_BLOCKING_WAIT=1: each collective's wait polls from the host, which a capture forbids")
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


def probe_optimizer_blockers(factory, device: torch.device, clipped: bool) -> list[str]:
    """``optimizer_blockers`` of what ``factory`` builds, on a one-parameter probe on ``device`` (as
    ``optim_check`` probes it): known before any collective, where the step's own optimizer is not."""
    probe = factory(probe_params(torch.nn.Parameter(torch.zeros(4, device=device)), (4,)))
    return optimizer_blockers(probe, prefer_fused(probe), clipped)


SEVERAL_RANKS = ("several ranks: a replayed collective is outside NCCL's watchdog, so a dead or hung rank would leave "
                 "the others waiting with no timeout; cuda_graph=True captures anyway")
"""Why "auto" does not capture a step over several ranks (True does, and says so in docs/gpu.md)."""


def resolve(setting, blockers: list[str], world_size: int = 1) -> GraphChoice:
    """``Plan.cuda_graph`` against what rules capture out: True with a blocker is a ``PlanError``; "auto" also
    keeps a step over several ranks eager (``SEVERAL_RANKS``)."""
    if setting is False:
        return GraphChoice(False, "Plan.cuda_graph=False")
    if blockers:
        if setting is True:
            raise PlanError("Plan.cuda_graph=True cannot capture this step: " + "; ".join(blockers))
        return GraphChoice(False, "auto: " + "; ".join(blockers))
    if setting == "auto" and world_size > 1:
        return GraphChoice(False, "auto: " + SEVERAL_RANKS)
    return GraphChoice(True, "auto: nothing rules capture out" if setting == "auto" else "Plan.cuda_graph=True")


def choose(setting, device: torch.device, plan, probe: Callable[[], list[str]],
           blocking_wait: bool = False) -> GraphChoice:
    """``resolve`` of a step of ``plan`` on ``device``: its ``static_blockers``, then, where they leave capture on,
    ``probe()``'s (``probe_optimizer_blockers`` of the step's optimizer factory). Before any collective."""
    choice = resolve(setting, static_blockers(device, plan, blocking_wait), plan.world_size)
    return resolve(setting, probe(), plan.world_size) if choice.captured else choice


def expected(setting, device: torch.device, plan, probe: Callable[[], list[str]],
             blocking_wait: bool = False) -> bool:
    """Whether a step of ``plan`` (resolved, not yet lowered) will be captured, as far as ``choose`` tells before
    lowering: what ``Plan.codegen="auto"`` prices (an error ``choose`` would raise is raised where the lowered
    plan is checked)."""
    try:
        return choose(setting, device, plan, probe, blocking_wait).captured
    except PlanError:
        return False


def host_state(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """What of ``optimizer``'s state lives on the host after a step (a Python number, a CPU tensor: a step
    count a replay would not advance), or None."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.device != device:
                where = "a Python number" if not isinstance(value, torch.Tensor) else f"on {value.device}"
                return f"the optimizer ({type(optimizer).__name__}) keeps {key!r} {where}: a replay would not update it"
    return None


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


def _baked_in(step) -> list:
    """The values a captured step bakes in: ``max_grad_norm`` and every entry of every optimizer group but a
    device tensor's (``lr=torch.tensor(..., device="cuda")`` is read in place by the graph; a CPU tensor is read
    on the host when captured, so by its value)."""
    def value(v):
        return v.tolist() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v

    return [step.max_grad_norm] + [{k: value(v) for k, v in g.items() if k != "params"
                                    and not (isinstance(v, torch.Tensor) and v.device.type != "cpu")}
                                   for g in step.optimizer.param_groups]


MAX_CAPTURES = 4
"""Captures a step may take (the first and three after a change baked into the graph) before it runs eagerly: a
schedule that changes a float learning rate every step would otherwise capture every step."""


class GraphedStep:
    """Runs a ``Step``'s work as one CUDA graph after ``WARMUP_STEPS`` eager steps (see the module docstring)."""

    def __init__(self, step, forced: bool) -> None:
        self.step = step
        self.forced = forced
        """Plan.cuda_graph=True: what rules capture out once the step runs is an error (else it runs eagerly)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.out: torch.Tensor | None = None
        self.calls = 0
        self.captures = 0
        """How many times the step was captured (more than once: something baked into the graph changed)."""
        self.eager_reason: str | None = None
        """Why the step runs eagerly from now on (None: it replays)."""
        self._baked: list | None = None
        self._grad_norm: torch.Tensor | None = None
        self._per_replay: dict = {}
        self._side = torch.cuda.Stream(step.device)
        # a counter the graph adds to in place must exist before the capture
        step._skipped_on_device = torch.zeros((), dtype=torch.float32, device=step.device)

    def __call__(self, batch) -> torch.Tensor:
        step = self.step
        if step.max_grad_norm is not None and not step._device_skip:  # (set after mc.compile)
            self._go_eager("step.max_grad_norm was set after mc.compile, and this optimizer can only skip a "
                           "non-finite step from the host")
        if step.track_memory or self.eager_reason is not None:
            return step._step(batch)  # the memory probe counts eager ops
        self.calls += 1
        if self.calls <= WARMUP_STEPS:
            return self._on_side_stream(batch)
        if self.graph is None or _baked_in(step) != self._baked:
            if self.captures >= MAX_CAPTURES:
                self._go_eager(f"captured {self.captures} times: what the graph bakes in (max_grad_norm, a float "
                               "learning rate) keeps changing; lr=torch.tensor(..., device='cuda') is read in place")
                return step._step(batch)
            if self.graph is None and (why := host_state(step.optimizer, step.device)):
                self._go_eager(why)
                return step._step(batch)
            try:
                self._capture(batch)  # (its collectives counted as the capture queued them)
            except Exception as exc:  # noqa: BLE001 - "auto" runs the step eagerly; True raises (in _go_eager)
                self._go_eager(f"the capture failed ({type(exc).__name__}: {exc})", cause=exc)
                return step._step(batch)
        else:
            step._stats.add(self._per_replay)  # (the host no longer calls the replay's collectives)
        for s, x in zip(self.static, batch):
            s.copy_(x, non_blocking=True)
        self.graph.replay()
        step.steps += 1
        # copies: the graph's own output and norm are overwritten by the next replay (an eager step's are new tensors)
        step.grad_norm = None if self._grad_norm is None else self._grad_norm.clone()
        return self.out.clone()

    def _go_eager(self, why: str, cause: BaseException | None = None) -> None:
        if self.forced:
            raise PlanError(f"Plan.cuda_graph=True: {why}") from cause
        if self.eager_reason is None:
            warnings.warn(f"cuda_graph: {why}; the step runs eagerly from now on", stacklevel=4)
            self.eager_reason = why
            self.step.cuda_graph_choice = GraphChoice(False, f"auto, after {self.calls} steps: {why}")

    def _on_side_stream(self, batch) -> torch.Tensor:
        current = torch.cuda.current_stream(self.step.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            out = self.step._step(batch)
        current.wait_stream(self._side)
        return out

    def _capture(self, batch) -> None:
        step = self.step
        if self.graph is not None:
            warnings.warn("cuda_graph: max_grad_norm or the optimizer's hyperparameters changed since the capture (a "
                          "float learning rate is baked into the graph): recapturing; lr=torch.tensor(..., "
                          "device='cuda') is read in place", stacklevel=4)
        self.static = [x.to(step.device).clone() for x in batch]
        graph, before, steps = torch.cuda.CUDAGraph(), step._stats.counts(), step.steps
        try:
            # on the warm-up's stream (not torch's one stream for every capture); "thread_local": another thread's
            # CUDA call (a DataLoader pinning memory) does not end this capture
            with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
                self.out = step._step(self.static)
        except BaseException:  # nothing ran: the step's host bookkeeping as before the call, no graph
            step._stats.restore(before)
            step.steps, self.graph = steps, None
            raise
        self.graph = graph
        step.steps = steps  # the capture queued the work, it did not run it
        self._per_replay = step._stats.since(before)
        self._grad_norm = step.grad_norm
        self._baked = _baked_in(step)
        self.captures += 1
