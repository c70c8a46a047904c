"""The training step: one class for flat and pipeline plans (docs/design.md#data-flow).

A step holds this rank's *parts*: the flat plan's whole rewritten graph, or each of its
pipeline chunks. A part is its communicator, fp32 shards, gradient shards, buffers and
Parameters. Everything but the micro-steps is written once here:
``__call__`` checks the batch and turns a failed collective into a ``CollectiveError``
naming the step; ``_step`` splits the micro-batches, runs them inside the arena's step,
runs the boundary, then steps the optimizer. The boundary all-reduces each part's 2-hop
buckets over "replicate" and the loss (with a counted loss, and its count) over "world", sums
tied gradients (``_sum_tied``); ``_scale_grads`` then scales by 1 / (samples per step's ranks x
micro-batches) or 1 / the global count, divides out an fp16 loss scale and clips to
``max_grad_norm``, in one multiply after one all-reduce of the norm (docs/training.md). The rest
is evaluation (``evaluate``), inspection (memory and comm stats, this rank's shards) and the
state dicts.

Subclasses differ in ``_micro_steps`` and ``_build_evaluation``: ``TrainStep`` (runtime.flat) runs
the rewritten graph once per micro-batch; ``PipelineStep`` (runtime.pipeline) runs its
schedule's forwards, backwards and P2P batches.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from micscompile.core import collectives as C
from micscompile.core.collectives import Comm, CommStats, GroupInfo
from micscompile.core.errors import UsageError
from micscompile.core.optim import prefer_fused
from micscompile.core.plan import PlanError
from micscompile.core.program import Kind, Program
from micscompile.core.sharding import local_piece, local_pieces, shard_parameters
from micscompile.core.tensor_layout import assemble, full_shape
from micscompile.lowering.tensor_split import tensor_split
from micscompile.memory.arena import Arena, OutsideArena
from micscompile.memory.stats import MemoryStats
from micscompile.runtime.codegen import CodegenReport
from micscompile.runtime.loss_scale import LossScaler
from micscompile.runtime.param_groups import ShardParams
from micscompile.runtime.state_dict import Checkpointable, Home, TensorPiece
from micscompile.trace import LOSS_SCALE, TrainGraph, check_batch, context_part, split_batch, trace

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class EvalSource:
    """What ``Step.evaluate`` traces and lowers on its first call: the model and loss given to
    ``mc.compile``, one micro-batch of the example, and the training step's lowering."""

    model: nn.Module
    loss_fn: Callable
    micro_example: tuple
    num_model_inputs: int
    lowered: object
    """The training step's ``LoweredFlat`` or ``LoweredPipeline``."""


@dataclass
class Part:
    """What this rank holds of one rewritten graph (the flat plan's, or one pipeline chunk's)."""

    index: int
    """0 for a flat plan; the chunk index in a pipeline."""
    comm: Comm
    shards: list[torch.Tensor]
    grads: list[torch.Tensor]
    buffers: list[torch.Tensor]
    """The graph's buffer inputs, in its order."""
    buffer_state: dict[str, torch.Tensor]
    """The module buffers this part saves and exports, by name."""
    params: dict[str, nn.Parameter]
    update_buckets: list[int]
    """``optimizer_sharding="world"``: the buckets all-gathered over "replicate" after the optimizer."""
    optimizer_rows: list[torch.Tensor]
    """What the optimizer steps of each bucket's shard: the whole shard, or with
    ``optimizer_sharding="world"`` its row among the d replicas'."""
    step_grads: list[torch.Tensor]
    """The gradient of ``optimizer_rows`` (what is scaled and clipped)."""
    optimizer_rank: int
    """The rank of ``optimizer_rows`` in ``optimizer_layouts(comm)``: shard rank * d + this rank's index
    among the d replicas (the shard rank itself with d = 1)."""


def part_fields(comm: Comm, program: Program, graph: TrainGraph, state: tuple[list[torch.Tensor], dict],
                shard_rank: int, device: torch.device, unused: set[str], own_buffers: bool) -> dict:
    """A Part's fields from ``state``, this rank's shards and buffers of the part
    (``materialize.local_states``; ``own_buffers``: save and export only the graph's buffers, not all of the model's)."""
    shards, buffers = state
    if LOSS_SCALE in graph.buffer_names:  # fp16: the step writes its loss scale here before each step
        buffers[LOSS_SCALE] = torch.ones((), dtype=torch.float32, device=device)
    grads = [torch.zeros_like(s) for s in shards]
    comm.grads = grads  # the graph accumulates into them (collectives.accumulate)
    inputs = [buffers[n] for n in graph.buffer_names]
    # optimizer_sharding="world": the optimizer steps row q (this rank's among the d replicas) of each shard
    d = comm.optimizer_shards
    q = comm.replicate.rank if d > 1 else 0
    rows, row_grads = [s.view(d, -1)[q] for s in shards], [g.view(d, -1)[q] for g in grads]
    params = shard_parameters(optimizer_layouts(comm), rows, row_grads, shard_rank * d + q, set(graph.trainable), unused)
    return dict(
        comm=comm, shards=shards, grads=grads, buffers=inputs,
        buffer_state=dict(zip(graph.buffer_names, inputs)) if own_buffers else buffers,
        params=dict(params), optimizer_rows=rows, step_grads=row_grads, optimizer_rank=shard_rank * d + q,
        update_buckets=[a.bucket for a in program.boundary if a.kind is Kind.UPDATE_GATHER],
    )


def tensor_pieces(graph: TrainGraph, groups: dict[str, GroupInfo]) -> tuple[dict, int, int] | None:
    """(parameter -> placement, this tensor rank, tp) of a tensor-parallel graph; None without."""
    if graph.tensor_parallel == 1:
        return None
    return graph.tensor_placements, groups["tensor"].rank, graph.tensor_parallel


def optimizer_layouts(comm: Comm) -> list:
    """The layouts of what a part's optimizer steps (``BucketLayout.optimizer_layout``)."""
    return [lay.optimizer_layout(comm.optimizer_shards) for lay in comm.layouts]


class Step(Checkpointable):
    """One optimizer step of a compiled plan; call it with this rank's local batch. ``print(step)`` shows the
    resolved plan and every decision made for it (``decisions``)."""

    _whose_batch = "this rank's"

    @property
    def decisions(self) -> list[str]:
        """Every choice made for this step where the Plan left one open ("auto" fields, defaults), one line each
        with its reason: the partition size, the schedule and the optimizer states' home as the cost model
        priced them (``Program.choice``), the codegen, the CUDA graph."""
        programs = self.program.programs() if hasattr(self.program, "programs") else {0: self.program}
        first = next(iter(programs.values()), None)
        priced = [line for line in (first.choice.splitlines() if first is not None else []) if line]
        return [*self.plan_choices, *priced, *(str(c) for c in (self.codegen_choice, self.cuda_graph_choice)
                                               if c is not None)]

    def __str__(self) -> str:
        plan = getattr(self.program, "plan", None)
        return "\n".join([f"{type(self).__name__} ({plan})" if plan is not None else type(self).__name__,
                          *(f"  {line}" for line in self.decisions)])

    def __init__(
        self, *, program, graph: TrainGraph, parts: list[Part], groups: dict[str, GroupInfo], stats: CommStats,
        arena: Arena | None, optimizer_factory: OptimizerFactory, state_keys: list[str], device: torch.device,
        step_buffers, scale: float, timeout: datetime.timedelta | None, codegen: CodegenReport | None,
        timeout_groups=(),
    ) -> None:
        self.program = program
        """What this rank runs: a ``Program`` (flat) or a ``LoweredPipeline`` (print it)."""
        self.codegen = codegen
        """With ``Plan.codegen="inductor"``: the compiled regions and their compile times (print it)."""
        self.codegen_choice = None
        """With ``Plan.codegen="auto"``: what the cost model chose and why (``runtime.codegen.CodegenChoice``)."""
        self.cuda_graph_choice = None
        """Whether the step replays as one CUDA graph and why (``runtime.cuda_graph.GraphChoice``)."""
        self.plan_choices: list[str] = []
        """What ``mc.compile`` resolved of the Plan before lowering (a default partition size, a model's own
        checkpointing), one line each; ``decisions`` lists them with the rest."""
        self._graphed = None
        self.graph = graph
        self.device = device
        self._parts = parts
        self._groups = groups
        self._stats = stats
        self._arena = arena
        self._state_keys = state_keys
        self._step_buffers = list(step_buffers)
        self._scale = scale
        self.params: dict[str, nn.Parameter] = {}
        trained, names = [], []
        for part in parts:
            for name, p in part.params.items():
                self.params.setdefault(name, p)  # a tied parameter twice on this rank: both train, one is named
                trained.append(p)
                names.append(name)
        self.optimizer = optimizer_factory(ShardParams(trained, names, graph.param_shapes))
        self.fused_optimizer = prefer_fused(self.optimizer)
        """Whether the optimizer steps with torch's fused kernel because its factory left the choice to
        torch (``core.optim.prefer_fused``)."""
        self.steps = 0
        self.track_memory = False
        """When True, each step counts the bytes ops allocate outside the arena (``memory_stats``). It sees the
        ops run eagerly: the kernels of ``Plan.codegen="inductor"`` allocate below the dispatcher, unseen (their
        regions' output bytes are in ``codegen``)."""
        self._outside_peak_bytes: int | None = None
        self.timeout = timeout
        """How long any collective of the step may take (None: the process groups' own)."""
        self.max_grad_norm: float | None = None
        """Clip the gradient's global L2 norm to this before the optimizer step, as
        ``torch.nn.utils.clip_grad_norm_`` does (``float("inf")``: measure it, never clip); None: neither.
        Set by ``mc.compile(max_grad_norm=...)`` (checked equal on every rank); changed between steps, it
        must change on every rank."""
        self.grad_norm: torch.Tensor | None = None
        """The last step's global gradient norm before clipping (with ``max_grad_norm`` set, or fp16)."""
        self._skipped = 0
        self._skipped_on_device: torch.Tensor | None = None
        self._device_skip = False
        """Skip a step whose gradient norm is not finite on the device (the fused optimizer's ``found_inf``) rather
        than from the host: no host synchronization, as a captured step needs (``runtime.cuda_graph``)."""
        self._scale_inputs = [part.buffer_state[LOSS_SCALE] for part in parts if LOSS_SCALE in part.buffer_state]
        # a plan-wide choice: a pipeline's first stages have no loss (no scale input) but scaled gradients
        self.loss_scaler: LossScaler | None = LossScaler() if program.plan.plan.loss_scaled else None
        """fp16 (``Plan.param_dtype=torch.float16``): the dynamic loss scale (``runtime.loss_scale``);
        None for bf16 and fp32, which need none. Saved in ``state_dict()`` under "loss_scale"."""
        self.eval_stats = CommStats()
        """Calls and bytes of ``evaluate``'s collectives (``comm_stats`` counts the training steps')."""
        self.eval_source: EvalSource | None = None
        """Set by ``mc.compile``: what ``evaluate`` traces on its first call."""
        self.eval_program = None
        """The forward-only Program(s) ``evaluate`` runs (after its first call; print it)."""
        self._eval_run = None
        self._eval_peak_bytes: int | None = None
        if timeout is not None:
            C.set_timeout([*groups.values(), *timeout_groups], timeout)

    # ---- the step ------------------------------------------------------------------------
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this rank's local batch; returns the global mean loss.

        Raises ``CollectiveError`` (naming the collective, its group and this rank) when a collective
        fails or times out: another rank died, hung or left the step."""
        if self.program.plan.context > 1:  # every context rank passes the whole sequences: its part of them
            batch = context_part(batch, self.program.plan.context, self._parts[0].comm.context.rank)
        check_batch(batch, self.graph.input_specs, self.program.plan.micro_batches, self._whose_batch)
        try:
            return self._step(batch) if self._graphed is None else self._graphed(batch)
        except C.CollectiveError as exc:
            raise C.step_failure(exc, dist.get_rank(), self.steps + 1, self.timeout) from exc

    def _step(self, batch) -> torch.Tensor:
        micro = split_batch([x.to(self.device, non_blocking=True) for x in batch], self.program.plan.micro_batches)
        probe = OutsideArena() if self.track_memory else contextlib.nullcontext()
        loss_sum = self._loss_accumulator()
        if self.program.plan.partition_size == 1:  # the graph reads the shards: nothing gathers them
            self._settle()
        with torch.no_grad(), probe:
            if self._arena is not None:
                self._arena.begin_step()
            for t in self._scale_inputs:
                t.fill_(self.loss_scaler.scale)
            with record_function("mc.micro_steps"):  # the phases, as torch.profiler shows them
                self._micro_steps(micro, loss_sum)
            if self._arena is not None:
                self._arena.end_step()
            with record_function("mc.boundary"):
                loss_buf = self._boundary(loss_sum)
            scale = self._mean_scale(loss_buf)
            with record_function("mc.scale_grads"):
                finite = self._scale_grads(scale)
        if self.track_memory:
            self._outside_peak_bytes = max(self._outside_peak_bytes or 0, probe.peak_bytes)
        self._drop_provisional_state()
        if finite:
            with record_function("mc.optimizer"):
                self.optimizer.step()
            self._update_gather()
        self.steps += 1
        return (loss_buf[0] * scale).detach()

    def _scale_grads(self, scale: float | torch.Tensor) -> bool:
        """Turn the summed gradients into the gradient of the global mean loss (times ``scale``),
        unscale them (fp16) and clip them with ``max_grad_norm``; False when their norm is not finite:
        the step is skipped (and an fp16 loss scale backs off)."""
        scaler = self.loss_scaler
        if self._device_skip:  # (set below again where this step skips; the fused kernel reads it)
            self.optimizer.found_inf = None
        if scaler is not None:
            scale = scale / scaler.scale
        factor = scale
        measured = self.max_grad_norm is not None or scaler is not None
        if measured:
            self.grad_norm = norm = self._global_grad_norm() * scale
            if self.max_grad_norm is not None:  # clip_grad_norm_'s rule: max_norm / (norm + 1e-6), never above 1
                factor = scale * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        for part in self._parts:
            if part.step_grads:
                torch._foreach_mul_(part.step_grads, factor)
        if not measured:
            return True
        if self._device_skip and scaler is None:  # the fused kernel leaves every piece as it was where found_inf
            bad = (~torch.isfinite(self.grad_norm)).to(torch.float32)
            self.optimizer.found_inf, self.optimizer.grad_scale = bad, None
            if self._skipped_on_device is None:
                self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=self.device)
            self._skipped_on_device.add_(bad)  # (in place: a captured step adds to it at every replay)
            return True
        finite = bool(torch.isfinite(self.grad_norm))  # one host sync, clipping or fp16 only
        if scaler is not None:
            scaler.update(finite)
        if finite:
            return True
        self._skipped += 1
        if self._skipped == 1 and scaler is None:  # fp16 overflows are routine: the scale backs off
            warnings.warn(f"step {self.steps + 1}: the gradient norm is {float(self.grad_norm)}; the optimizer "
                          "step is skipped on every rank (step.skipped_steps counts them)", stacklevel=4)
        return False

    @property
    def skipped_steps(self) -> int:
        """Steps whose gradient norm was not finite: the optimizer did not step (on any rank). Skipped on the
        device (a captured step), they are counted there: reading this waits for the device."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device)
        return self._skipped + on_device

    def _global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole (summed) gradient, every element once: this rank's pieces without
        padding, a tied parameter in its lowest part only, one replica of each shard (the replication
        group's rank 0; with ``optimizer_sharding="world"`` each rank's own row), summed over the world
        (every partition group and pipeline stage)."""
        pieces = []
        if self._groups["replicate"].rank == 0 or self.program.plan.optimizer_shards > 1:
            tied = self._tied_parts()
            tensor = self._groups.get("tensor")
            split = self.graph.tensor_placements  # (a replicated parameter: every tensor rank holds it, count one)
            pieces = [p.grad for part in self._parts for name, p in part.params.items()
                      if p.grad is not None and p.grad.numel() and part.index == min(tied.get(name, [part.index]))
                      and (tensor is None or tensor.rank == 0 or name in split)]
        squares = torch.zeros(1, dtype=torch.float32, device=self.device)
        if pieces:
            norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
            squares += torch.stack(norms).square().sum()
        C.collective_wait(None, C.all_reduce_start(self._stats, self._groups["world"], squares, torch.float32))
        return squares[0].sqrt()

    def _micro_steps(self, micro: list, loss_sum: torch.Tensor) -> None:
        """Run every micro-batch: accumulate each part's gradient shards, add the losses to ``loss_sum``."""
        raise NotImplementedError

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, *batch: torch.Tensor) -> torch.Tensor:
        """The global mean loss of this rank's local batch (shaped as the step's), forward only: the
        model as in ``eval()`` (dropout off), the parameters gathered and released as the step gathers
        them, no gradient, no reduce-scatter, no optimizer step, no activation kept for a backward.
        Collective: every rank calls it with its own batch. A counted loss (``(loss_sum, count)``) gives
        the global token mean. The first call traces and lowers the forward (rank-local, no collective)."""
        if self.program.plan.context > 1:
            raise UsageError("evaluate under context parallelism is not built: evaluate with a step of "
                             "context_parallel_size=1 (the same parameters load into it: step.state_dict())")
        check_batch(batch, self.graph.input_specs, self.program.plan.micro_batches, self._whose_batch)
        run = self._evaluation()  # before any collective: a plan it cannot evaluate raises on every rank
        self._settle()
        micro = split_batch([x.to(self.device, non_blocking=True) for x in batch], self.program.plan.micro_batches)
        loss_sum = self._loss_accumulator()
        probe = OutsideArena() if self.track_memory else contextlib.nullcontext()
        try:
            with torch.no_grad(), probe:
                run(micro, loss_sum)
                loss_buf = self._one_per_tensor_group(loss_sum.reshape(-1))
                C.collective_wait(None, C.all_reduce_start(self.eval_stats, self._groups["world"], loss_buf,
                                                           torch.float32))
        except C.CollectiveError as exc:
            raise C.step_failure(exc, dist.get_rank(), self.steps + 1, self.timeout) from exc
        if self.track_memory:
            self._eval_peak_bytes = max(self._eval_peak_bytes or 0, probe.peak_bytes)
        return (loss_buf[0] * self._mean_scale(loss_buf)).detach()

    def _one_per_tensor_group(self, loss_buf: torch.Tensor) -> torch.Tensor:
        """The tensor ranks of a group computed the same loss: only the first adds it to the world's sum."""
        tensor = self._groups.get("tensor")
        if tensor is not None and tensor.rank != 0:
            loss_buf.zero_()
        return loss_buf

    def _loss_accumulator(self) -> torch.Tensor:
        """The runtime's (not the graph's) sum of the micro-batches' losses: the loss, or
        ``[loss_sum, count]`` with a counted loss."""
        return torch.zeros((2,) if self.graph.counted_loss else (), dtype=torch.float32, device=self.device)

    def _mean_scale(self, loss_buf: torch.Tensor) -> float | torch.Tensor:
        """What turns the world-summed loss (and gradients) into the global mean: 1 / the global count
        with a counted loss, else 1 / (samples per step's ranks x micro-batches)."""
        return 1.0 / loss_buf[1] if self.graph.counted_loss else self._scale

    def _evaluation(self) -> Callable[[list, torch.Tensor], None]:
        """What ``evaluate`` runs per local batch: (micro-batches, loss accumulator) -> None. Built on
        the first call, rank-local: the forward and loss traced alone in ``eval()`` mode, lowered with
        the training step's layouts (``_build_evaluation``)."""
        if self._eval_run is None:
            src = self.eval_source
            if src is None:
                raise PlanError("evaluate() needs the step mc.compile built (it keeps the model and loss to trace)")
            etg = trace(src.model, src.micro_example, src.loss_fn, num_model_inputs=src.num_model_inputs,
                        param_dtype=self.program.plan.plan.param_dtype, device=self.device, forward_only=True)
            # the training graph's pieces, split alike
            etg = tensor_split(etg, self.graph.tensor_parallel, self.graph.sequence_parallel)
            if etg.tensor_placements != self.graph.tensor_placements:
                raise PlanError("evaluate(): the forward alone splits the parameters otherwise than the training "
                                "step (tensor parallelism): a micscompile bug, please report it")
            self._eval_run = self._build_evaluation(etg, src.lowered)
            self.eval_source = None  # the model and the training lowering are no longer needed
        return self._eval_run

    def _build_evaluation(self, etg: TrainGraph, lowered) -> Callable[[list, torch.Tensor], None]:
        raise NotImplementedError

    def _boundary(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss (and its count) summed over "world", the waits for the 2-hop all-reduces of the
        gradients over "replicate" (each started in its part's last backward, ``collectives.second_hop``),
        tied gradients summed: every gradient is then the sum over the global batch."""
        self._settle()  # (a bucket the micro-steps never gathered) before the optimizer writes its rows
        works = [w for part in self._parts for w in part.comm.second_hops]
        for part in self._parts:
            part.comm.second_hops.clear()
        loss_buf = self._one_per_tensor_group(loss_sum.reshape(-1))
        works.append(C.all_reduce_start(self._stats, self._groups["world"], loss_buf, torch.float32))
        for w in works:
            C.collective_wait(None, w)
        self._sum_tied()
        return loss_buf

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters held by several parts (pipeline chunks); none in a flat plan."""

    def _update_gather(self) -> None:
        """``optimizer_sharding="world"``: start all-gathering each bucket's updated rows over the replicas.
        Each is waited for just before the bucket's next gather (``collectives.settle``), so it runs under
        the next step's forward; at p = 1 (the graph reads the shards, nothing is gathered) at the next
        step's start, and before anything else reads or writes the shards (``_settle``)."""
        replicate = self._groups["replicate"]
        for part in self._parts:
            for b in part.update_buckets:
                dtype = part.comm.layouts[b].gather_dtype
                part.comm.updates[b] = C.update_gather_start(self._stats, replicate, part.shards[b], b, dtype)
                self._inexact = self._inexact or dtype != part.shards[b].dtype

    _inexact = False
    """Update gathers in a low precision left other replicas' rows rounded in the shards (``_settle(exact=True)``)."""

    def _settle(self, exact: bool = False) -> None:
        """Wait for every update gather still in flight (``_update_gather``); ``exact``: then, if they ran
        in a low precision, all-gather the fp32 master rows (a collective over the replicas)."""
        for part in self._parts:
            C.settle(part.comm)
        if exact and self._inexact:
            for part in self._parts:
                for b in part.update_buckets:
                    C.exact_rows(self._groups["replicate"], part.shards[b])
            self._inexact = False

    # ---- inspection and export -------------------------------------------------------------
    def memory_stats(self) -> MemoryStats:
        """The step's memory: the arena (planned buffers of the collectives), what the ops allocate
        outside it (planned from the lifetimes; measured over the steps run with ``track_memory``),
        and the plan of every step buffer against PyTorch's caching allocator on the same trace."""
        return MemoryStats.of(self._step_buffers, self._arena and self._arena.plan,
                              None if self.codegen else self._outside_peak_bytes, self._eval_peak_bytes)

    def comm_stats(self) -> CommStats:
        """Calls and bytes per collective kind and group since compile (or the last reset)."""
        return self._stats

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter it holds (1-D, possibly empty), by canonical name (with
        ``optimizer_sharding="world"`` and low-precision gathers, collective over the replicas)."""
        self._settle(exact=True)
        rank = self._groups["shard"].rank
        return {k: v for part in self._parts for k, v in local_pieces(part.comm.layouts, part.shards, rank).items()}

    def _tied_parts(self) -> dict[str, list[int]]:
        """Parameter -> the parts holding it, where more than one does."""
        return {}

    def _homes(self, optimizer: bool = False) -> list[Home]:
        """Where this rank's piece of each parameter lives (``optimizer``: the piece the optimizer steps,
        a row of it with ``optimizer_sharding="world"``). A parameter held by several parts is saved from
        the lowest one and loaded into every one."""
        r, tied = self._groups["shard"].rank, self._tied_parts()
        whole = self.program.plan.optimizer_shards == 1  # the optimizer steps the whole shard
        split, tensor = self.graph.tensor_placements, self._groups.get("tensor")
        out = []
        for part in self._parts:
            layouts, shards, rank = part.comm.layouts, part.shards, r
            if optimizer:
                layouts, shards, rank = optimizer_layouts(part.comm), part.optimizer_rows, part.optimizer_rank
            for lay, shard in zip(layouts, shards):
                for slot in lay.slots:
                    param = part.params.get(slot.name) if optimizer or whole else None
                    piece = TensorPiece(split[slot.name], tensor.rank, tensor.size) if slot.name in split else None
                    out.append(Home(slot.name, full_shape(slot.shape, piece.placement, piece.tp) if piece else slot.shape,
                                    lay.local_range(slot, rank)[0], local_piece(lay, slot, shard, rank), param,
                                    part.index == min(tied.get(slot.name, [part.index])), piece))
        return out

    def _state_buffers(self) -> dict[str, torch.Tensor]:
        return {n: b for part in self._parts for n, b in part.buffer_state.items() if n in self._state_keys}

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's parts hold, unsharded over the partition group, and their
        buffers, on CPU (collective over the partition group)."""
        self._settle(exact=True)
        out: dict[str, torch.Tensor] = {}
        for part in self._parts:
            out.update(C.gather_full(part.comm.layouts, part.shards, self._groups["shard"], self.graph.param_aliases))
            out.update({n: b.detach().cpu().clone() for n, b in part.buffer_state.items()})
        tensor = self._groups.get("tensor")
        for name, placement in self.graph.tensor_placements.items():  # every tensor rank's piece, assembled
            if name in out:
                pieces = [torch.empty_like(out[name]) for _ in range(tensor.size)]
                dist.all_gather(pieces, out[name], group=tensor.group)
                for alias in self.graph.param_aliases[name]:
                    out[alias] = assemble(pieces, placement)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters and persistent buffers on CPU, keyed like ``model.state_dict()``.

        Collective over the partition group: every rank must call it.
        """
        full = self._gathered()
        return {k: full[k] for k in self._state_keys}
