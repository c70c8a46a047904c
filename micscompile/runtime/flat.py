"""``TrainStep``: the step of a flat plan (no pipeline stages), docs/design.md#data-flow.

Its one part is the whole rewritten graph. ``_micro_steps`` runs it once per micro-batch
(its collectives are asynchronous and waited on where the graph needs them); the graph adds
each bucket's reduced gradient shard into the part's accumulators as soon as it is reduced
and, on the last micro-step, starts the bucket's second hop there (2hop: all-reduce over the
replication group, under the rest of the backward). ``runtime.step.Step`` does the rest: the
boundary waits for the second hops, scales by 1 / (n * s) (the gradient of the global mean
loss) and steps the optimizer on the local fp32 shards.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.fx
from torch import nn

from micscompile.core.collectives import Comm, GroupInfo
from micscompile.core.program import Program, ProgramError
from micscompile.core.sharding import BucketLayout
from micscompile.lowering.flat import LoweredFlat, lower_evaluation
from micscompile.memory.arena import Arena
from micscompile.passes.manager import PassRecord
from micscompile.runtime.codegen import CodegenReport, compile_regions
from micscompile.runtime.materialize import local_states
from micscompile.runtime.meshes import flat_groups
from micscompile.runtime.step import OptimizerFactory, Part, Step, part_fields, tensor_pieces
from micscompile.trace import TrainGraph


class TrainStep(Step):
    """One optimizer step of a compiled flat plan; call it with this rank's local batch."""

    def __init__(
        self, *, gm: torch.fx.GraphModule, program: Program, comm: Comm, groups: dict[str, GroupInfo],
        graph: TrainGraph, model: nn.Module, init_fn, optimizer_factory: OptimizerFactory, state_keys: list[str],
        pass_records: list[PassRecord], device: torch.device, step_buffers=(),
        timeout: datetime.timedelta | None = None, codegen: CodegenReport | None = None,
    ) -> None:
        shard_rank = groups["shard"].rank
        [state] = local_states(model, [comm.layouts], shard_rank, device, init_fn, tensor_pieces(graph, groups))
        part = Part(0, **part_fields(comm, program, graph, state, shard_rank, device, graph.unused_params,
                                     own_buffers=False))
        plan = program.plan
        super().__init__(program=program, graph=graph, parts=[part], groups=groups, stats=comm.stats, arena=comm.arena,
                         optimizer_factory=optimizer_factory, state_keys=state_keys, device=device,
                         step_buffers=step_buffers, scale=1.0 / (plan.data_parallel_size * plan.micro_batches),
                         timeout=timeout, codegen=codegen)
        self.gm = gm
        self.pass_records = pass_records
        self._comm = comm

    @staticmethod
    def prepare(lowered: LoweredFlat, graph: TrainGraph, device: torch.device) -> dict:
        """Rank-local, before the first collective: the rewritten graph as a module, its regions
        compiled with ``Plan.codegen="inductor"``."""
        gm = torch.fx.GraphModule(graph.gm, lowered.graph)
        codegen = CodegenReport(compile_regions(gm, device)) if lowered.plan.plan.codegen == "inductor" else None
        return {"gm": gm, "codegen": codegen}

    @classmethod
    def build(cls, lowered: LoweredFlat, prepared: dict, *, device: torch.device, arena_offsets, **kwargs) -> TrainStep:
        """After the ranks agreed: the DeviceMesh's groups, the communicator and its arena, the step."""
        groups = flat_groups(lowered.plan, lowered.rank, device)
        comm = Comm(lowered.ctx.layouts, groups["shard"], groups["replicate"], groups["world"], groups.get("inter"),
                    groups.get("intra"), tensor=groups.get("tensor"), context=groups.get("context"),
                    arena=None if arena_offsets is None else Arena(*arena_offsets, device),
                    optimizer_shards=lowered.plan.optimizer_shards)
        return cls(gm=prepared["gm"], program=dataclasses.replace(lowered.program, groups=groups), comm=comm,
                   groups=groups, pass_records=lowered.records, device=device, codegen=prepared["codegen"], **kwargs)

    @property
    def layouts(self) -> tuple[BucketLayout, ...]:
        return self._comm.layouts

    def _build_evaluation(self, etg: TrainGraph, lowered: LoweredFlat):
        graph, self.eval_program = lower_evaluation(etg, self.program.plan, lowered, self._groups, lowered.rank,
                                                    device=self.device)
        gm = torch.fx.GraphModule(etg.gm, graph)
        g = self._groups
        comm = Comm(self.layouts, g["shard"], g["replicate"], g["world"], g.get("inter"), g.get("intra"),
                    tensor=g.get("tensor"), context=g.get("context"), stats=self.eval_stats)
        part = self._parts[0]
        buffers = [part.buffer_state[n] for n in etg.buffer_names]  # by name: no loss-scale input here

        def run(micro: list, loss_sum: torch.Tensor) -> None:
            for _, outputs in _each_micro_step(gm, comm, micro, part.shards, buffers):
                loss_sum += outputs[0].float()
        return run

    def _micro_steps(self, micro: list, loss_sum: torch.Tensor) -> None:
        part = self._parts[0]
        for _, (loss,) in _each_micro_step(self.gm, self._comm, micro, part.shards, part.buffers):
            loss_sum += loss.float()


def _each_micro_step(gm: torch.fx.GraphModule, comm: Comm, micro: list, shards: list, buffers: list):
    """Run the rewritten graph once per micro-batch, telling ``comm`` which one it is (the Program's
    carried gathers depend on it); yields (index, outputs). No gather may be carried past the last."""
    comm.carried.clear()
    comm.micro_steps = len(micro)
    for j, mb in enumerate(micro):
        comm.micro_step = j
        yield j, gm(comm, *shards, *buffers, *mb)
    if comm.carried:
        raise ProgramError(f"{len(comm.carried)} gathers carried past the last micro-step")
