"""The training step: one class for flat and pipeline plans (docs/design.md#data-flow).

A step holds this rank's *parts*: the flat plan's whole rewritten graph, or each of its
pipeline chunks. A part is its communicator, fp32 shards, gradient shards, buffers and
Parameters. Everything but the micro-steps is written once here:
``__call__`` checks the batch and turns a failed collective into a ``CollectiveError``
naming the step; ``_step`` splits the micro-batches, runs them inside the arena's step,
runs the boundary, then steps the optimizer. The boundary all-reduces each part's 2-hop
buckets over "replicate" and the loss over "world", sums tied gradients
(``_sum_tied``), then scales by 1 / (samples per step's ranks x micro-batches). The rest
is inspection (memory and comm stats, this rank's shards) and the state dicts.

Subclasses differ only in ``_micro_steps``: ``TrainStep`` (runtime.flat) runs the
rewritten graph once per micro-batch; ``PipelineStep`` (runtime.pipeline) runs its
schedule's forwards, backwards and P2P batches.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from micscompile.core import collectives as C
from micscompile.core.collectives import Comm, CommStats, GroupInfo
from micscompile.core.program import Kind, Program
from micscompile.core.sharding import local_piece, local_pieces, shard_parameters
from micscompile.memory.arena import Arena, OutsideArena
from micscompile.memory.stats import MemoryStats
from micscompile.runtime.codegen import CodegenReport
from micscompile.runtime.materialize import local_state
from micscompile.runtime.state_dict import Checkpointable, Home
from micscompile.trace import TrainGraph, check_batch, split_batch

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


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
    boundary_buckets: list[int]
    """The buckets the boundary all-reduces over "replicate" (the Program's 2-hop ALL_REDUCEs)."""


def part_fields(comm: Comm, program: Program, graph: TrainGraph, model: nn.Module, shard_rank: int,
                device: torch.device, init_fn, unused: set[str], own_buffers: bool) -> dict:
    """A Part's fields, this rank's shards and buffers materialized from ``model``
    (``own_buffers``: save and export only the graph's buffers, not all of the model's)."""
    shards, buffers = local_state(model, comm.layouts, shard_rank, device, init_fn)
    grads = [torch.zeros_like(s) for s in shards]
    inputs = [buffers[n] for n in graph.buffer_names]
    return dict(
        comm=comm, shards=shards, grads=grads, buffers=inputs,
        buffer_state=dict(zip(graph.buffer_names, inputs)) if own_buffers else buffers,
        params=dict(shard_parameters(comm.layouts, shards, grads, shard_rank, set(graph.trainable), unused)),
        boundary_buckets=[a.bucket for a in program.boundary if a.kind is Kind.ALL_REDUCE],
    )


class Step(Checkpointable):
    """One optimizer step of a compiled plan; call it with this rank's local batch."""

    _whose_batch = "this rank's"

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
        trained = []
        for part in parts:
            for name, p in part.params.items():
                self.params.setdefault(name, p)  # a tied parameter twice on this rank: both train, one is named
                trained.append(p)
        self.optimizer = optimizer_factory(trained)
        self.steps = 0
        self.track_memory = False
        """When True, each step counts the bytes ops allocate outside the arena (``memory_stats``). It sees the
        ops run eagerly: the kernels of ``Plan.codegen="inductor"`` allocate below the dispatcher, unseen (their
        regions' output bytes are in ``codegen``)."""
        self._outside_peak_bytes: int | None = None
        self.timeout = timeout
        """How long any collective of the step may take (None: the process groups' own)."""
        if timeout is not None:
            C.set_timeout([*groups.values(), *timeout_groups], timeout)

    # ---- the step ------------------------------------------------------------------------
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this rank's local batch; returns the global mean loss.

        Raises ``CollectiveError`` (naming the collective, its group and this rank) when a collective
        fails or times out: another rank died, hung or left the step."""
        check_batch(batch, self.graph.input_specs, self.program.plan.micro_batches, self._whose_batch)
        try:
            return self._step(batch)
        except C.CollectiveError as exc:
            raise C.step_failure(exc, dist.get_rank(), self.steps + 1, self.timeout) from exc

    def _step(self, batch) -> torch.Tensor:
        micro = split_batch([x.to(self.device, non_blocking=True) for x in batch], self.program.plan.micro_batches)
        probe = OutsideArena() if self.track_memory else contextlib.nullcontext()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)  # the runtime's, not the graph's
        with torch.no_grad(), probe:
            if self._arena is not None:
                self._arena.begin_step()
            self._micro_steps(micro, loss_sum)
            if self._arena is not None:
                self._arena.end_step()
            loss_buf = self._boundary(loss_sum)
        if self.track_memory:
            self._outside_peak_bytes = max(self._outside_peak_bytes or 0, probe.peak_bytes)
        self._drop_provisional_state()
        self.optimizer.step()
        self.steps += 1
        return (loss_buf[0] * self._scale).detach()

    def _micro_steps(self, micro: list, loss_sum: torch.Tensor) -> None:
        """Run every micro-batch: accumulate each part's gradient shards, add the losses to ``loss_sum``."""
        raise NotImplementedError

    def _boundary(self, loss_sum: torch.Tensor) -> torch.Tensor:
        reduce_dtype = self.program.plan.plan.reduce_dtype
        works = [C.all_reduce_start(self._stats, self._groups["replicate"], part.grads[b], reduce_dtype)
                 for part in self._parts for b in part.boundary_buckets]
        loss_buf = loss_sum.reshape(1)
        works.append(C.all_reduce_start(self._stats, self._groups["world"], loss_buf, torch.float32))
        for w in works:
            C.collective_wait(None, w)
        self._sum_tied()
        for part in self._parts:
            for g in part.grads:
                g.mul_(self._scale)
        return loss_buf

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters held by several parts (pipeline chunks); none in a flat plan."""

    # ---- inspection and export -------------------------------------------------------------
    def memory_stats(self) -> MemoryStats:
        """The step's memory: the arena (planned buffers of the collectives), what the ops allocate
        outside it (planned from the lifetimes; measured over the steps run with ``track_memory``),
        and the plan of every step buffer against PyTorch's caching allocator on the same trace."""
        return MemoryStats.of(self._step_buffers, self._arena and self._arena.plan,
                              None if self.codegen else self._outside_peak_bytes)

    def comm_stats(self) -> CommStats:
        """Calls and bytes per collective kind and group since compile (or the last reset)."""
        return self._stats

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter it holds (1-D, possibly empty), by canonical name."""
        rank = self._groups["shard"].rank
        return {k: v for part in self._parts for k, v in local_pieces(part.comm.layouts, part.shards, rank).items()}

    def _tied_parts(self) -> dict[str, list[int]]:
        """Parameter -> the parts holding it, where more than one does."""
        return {}

    def _homes(self) -> list[Home]:
        """A parameter held by several parts is saved from the lowest one and loaded into every one."""
        r, tied = self._groups["shard"].rank, self._tied_parts()
        return [Home(slot.name, slot.shape, lay.local_range(slot, r)[0], local_piece(lay, slot, shard, r),
                     part.params.get(slot.name), part.index == min(tied.get(slot.name, [part.index])))
                for part in self._parts for lay, shard in zip(part.comm.layouts, part.shards) for slot in lay.slots]

    def _state_buffers(self) -> dict[str, torch.Tensor]:
        return {n: b for part in self._parts for n, b in part.buffer_state.items() if n in self._state_keys}

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's parts hold, unsharded over the partition group, and their
        buffers, on CPU (collective over the partition group)."""
        out: dict[str, torch.Tensor] = {}
        for part in self._parts:
            out.update(C.gather_full(part.comm.layouts, part.shards, self._groups["shard"], self.graph.param_aliases))
            out.update({n: b.detach().cpu().clone() for n, b in part.buffer_state.items()})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters and persistent buffers on CPU, keyed like ``model.state_dict()``.

        Collective over the partition group: every rank must call it.
        """
        full = self._gathered()
        return {k: full[k] for k in self._state_keys}
