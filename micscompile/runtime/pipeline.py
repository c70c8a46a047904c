"""Emit for pipeline plans (MiCS-Pipe): ``PipelineStep`` runs this rank's schedule.

Topology (docs/design.md): n = S * t * d. A ("replicate", "pipe", "shard") DeviceMesh of
shape (d, S, t): every S*t consecutive ranks are one pipeline, every t consecutive
ranks inside it a stage's partition group ("shard"); "pipe" links the S ranks that
carry the same micro-batches from stage to stage, "replicate" the d ranks holding
the same shard of a stage. The ranks of one pipeline chain get the same local batch.

Each of this rank's chunks is a rewritten graph split into a forward and a backward
GraphModule (lowering.phase_split) with the MiCS collectives of its own partition group
inside. The schedule's actions run in order: F and B call those modules; each run of adjacent
P2P actions goes out as one ``batch_isend_irecv`` over the "pipe" group (``PipeSchedule.batched``,
ordered to be deadlock-free under NCCL's rules); a batch's Work is waited for right before the
first compute that reads one of its receives (on NCCL the batch is one coalesced Work, its receive
buffers valid only after it; on gloo the receives' own Works), and every batch at the end of the
step; what a forward sends is dropped once posted, and a backward gets only the values it reads.
A chunk's backward adds each bucket's reduced gradient shard into the bucket's accumulator; in the
chunk's last backward it also starts the bucket's all-reduce over "replicate" there (2-hop's second
hop, ``collectives.second_hop``), under the rest of that backward and of the schedule. AR is the
boundary: all-reduce the loss, wait for the second hops, sum a tied parameter's partial gradients
between the chunks that hold it, scale by 1 / (t * d * m) and step the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from micscompile.core import collectives as C
from micscompile.core.collectives import Comm, CommStats, GroupInfo
from micscompile.core.pipeline_schedule import Op
from micscompile.core.program import ProgramError
from micscompile.core.sharding import local_piece
from micscompile.lowering.flat import lower_evaluation
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.phase_split import Phases, split_chunk
from micscompile.lowering.pipeline import LoweredPipeline
from micscompile.lowering.pipeline_split import Transfer, split
from micscompile.memory.arena import Arena
from micscompile.runtime.codegen import CodegenReport, compile_regions
from micscompile.runtime.materialize import local_states
from micscompile.runtime.meshes import mesh_cache, pipeline_groups
from micscompile.runtime.step import Part, Step, part_fields, tensor_pieces
from micscompile.trace import TrainGraph


class _Posted:
    """One posted batch of P2P ops and its Works: one for the whole batch where the backend coalesces
    ``batch_isend_irecv`` (NCCL), else one per op (gloo); each waited for once."""

    def __init__(self, works: list, n_ops: int, receives: list[int], what: str) -> None:
        self.works, self.coalesced, self.receives, self.what = works, len(works) < n_ops, receives, what
        self.waited: set[int] = set()

    def wait(self, receives_only: bool = False) -> None:
        """Wait for the batch, or for what its receives need: on NCCL the batch's one Work (the compute
        stream then waits for the whole batch, its sends included), on gloo the receives' own Works."""
        todo = self.receives if receives_only and not self.coalesced else range(len(self.works))
        todo = [i for i in todo if i not in self.waited]
        if todo:
            with C.guarded(self.what):
                for i in todo:
                    self.works[i].wait()
                    self.waited.add(i)


@dataclass
class _Chunk(Part):
    phases: Phases
    batch_inputs: tuple[int, ...]
    n_send_act: int
    fwd_used: list[bool]
    """Which forward placeholders the forward reads (the others get None)."""
    bwd_used: list[bool]
    w_used: list[bool]
    """Which of W's placeholders W reads (a zero-bubble chunk; else empty)."""


def _used(gm: torch.fx.GraphModule) -> list[bool]:
    return [bool(n.users) for n in gm.graph.nodes if n.op == "placeholder"]


def _pick(args: Sequence, used: list[bool]) -> list:
    return [a if u else None for a, u in zip(args, used)]


def split_chunks(pp: LoweredPipeline, device: torch.device) -> tuple[dict[int, Phases], CodegenReport | None]:
    """This rank's chunks as forward and backward GraphModules (``lowering.phase_split``; after
    ``Lowered.rewrite_for_runtime`` rewrote their graphs for the arena); with
    ``Plan.codegen="inductor"`` their compute regions compiled, identical ones once across chunks."""
    phases, regions, cache = {}, [], {}
    for c in pp.my_chunks():
        st, sched = pp.split.stages[c], pp.chunks[c]
        phases[c] = split_chunk(torch.fx.GraphModule(st.graph.gm, sched.graph), len(st.send_act),
                                weight=pp.schedule.split_backward)
        if pp.plan.plan.codegen == "inductor":
            modules = [(f"chunk {c} forward", phases[c].forward), (f"chunk {c} backward", phases[c].backward)]
            modules += [(f"chunk {c} weight", phases[c].weight)] if phases[c].weight is not None else []
            for name, gm in modules:
                regions += compile_regions(gm, device, graph_name=name, cache=cache, first_index=len(regions))
    return phases, (CodegenReport(regions) if pp.plan.plan.codegen == "inductor" else None)


def _tied_groups(pp: LoweredPipeline, rank: int, cache: dict) -> dict[str, GroupInfo]:
    """Tied parameter -> the group of this chain's ranks whose chunks hold it (every rank creates
    every chain's group, in the same order, as ``new_group`` requires)."""
    rp, sched = pp.plan, pp.schedule
    out = {}
    for name, chunks in sorted(pp.split.tied.items()):
        positions = tuple(sorted({sched.rank_of(c) for c in chunks}))
        if len(positions) < 2:
            continue  # all on this rank: summed locally
        key = ("tied", rp.world_size, rp.stages, rp.partition_size, positions)
        if key not in cache:
            chains = [r for r in range(rp.world_size) if rp.stage_of(r) == 0]
            cache[key] = {}
            for first in chains:
                ranks = [rp.pipe_ranks(first)[s] for s in positions]
                pg = dist.new_group(ranks)
                for r in ranks:
                    cache[key][r] = pg
        if rank in cache[key]:
            pg = cache[key][rank]
            ranks = tuple(dist.get_process_group_ranks(pg))
            out[name] = GroupInfo("tied", pg, ranks, ranks.index(rank), False)
    return out


class PipelineStep(Step):
    """One optimizer step of a pipeline plan; call it with this rank's local batch (the same on
    every rank of one pipeline chain)."""

    _whose_batch = "this pipeline chain's"

    def __init__(self, *, pp: LoweredPipeline, graph: TrainGraph, model: nn.Module, groups: dict[str, GroupInfo],
                 optimizer_factory, state_keys: list[str], device: torch.device, init_fn, cache: dict,
                 chunk_phases: dict[int, Phases], step_buffers: list, arena_offsets=None, timeout=None,
                 codegen: CodegenReport | None = None) -> None:
        rp = pp.plan
        stats = CommStats()
        planned_arena = None if arena_offsets is None else Arena(*arena_offsets, device)
        chunks = []
        shard_rank = groups["shard"].rank
        # every chunk this rank holds materialised in one pass over the model (a meta model initialised once)
        states = local_states(model, [pp.chunks[c].ctx.layouts for c in pp.my_chunks()], shard_rank, device, init_fn,
                              tensor_pieces(graph, groups))
        for c, state in zip(pp.my_chunks(), states):
            st, sched = pp.split.stages[c], pp.chunks[c]
            comm = Comm(sched.ctx.layouts, groups["shard"], groups["replicate"], groups["world"], stats=stats,
                        tensor=groups.get("tensor"),
                        arena=planned_arena, optimizer_shards=rp.optimizer_shards, micro_steps=rp.micro_batches)
            phases = chunk_phases[c]
            chunks.append(_Chunk(c, **part_fields(comm, sched.program, st.graph, state, shard_rank, device,
                                                  graph.unused_params, own_buffers=True),
                                 phases=phases, batch_inputs=st.batch_inputs, n_send_act=len(st.send_act),
                                 fwd_used=_used(phases.forward), bwd_used=_used(phases.backward),
                                 w_used=_used(phases.weight) if phases.weight is not None else []))
        self._tied = _tied_groups(pp, pp.rank, cache)
        super().__init__(program=pp, graph=graph, parts=chunks, groups=groups, stats=stats, arena=planned_arena,
                         optimizer_factory=optimizer_factory, state_keys=state_keys, device=device,
                         step_buffers=step_buffers, scale=1.0 / (rp.data_parallel_size * rp.micro_batches),
                         timeout=timeout, codegen=codegen, timeout_groups=self._tied.values())
        self._rp = rp
        self._stage = rp.stage_of(pp.rank)
        self._pipe = groups["pipe"]
        self._chunks: dict[int, _Chunk] = {ch.index: ch for ch in chunks}

    @staticmethod
    def prepare(lowered: LoweredPipeline, graph: TrainGraph, device: torch.device) -> dict:
        """Rank-local, before the first collective: this rank's chunks split into forward and
        backward modules, their regions compiled with ``Plan.codegen="inductor"``."""
        chunk_phases, codegen = split_chunks(lowered, device)
        return {"chunk_phases": chunk_phases, "codegen": codegen}

    @classmethod
    def build(cls, lowered: LoweredPipeline, prepared: dict, *, device: torch.device, **kwargs) -> PipelineStep:
        """After the ranks agreed: the (d, S, t) DeviceMesh's groups, then the step."""
        groups = planned_groups(lowered.plan, lowered.rank)
        pipeline_groups(lowered.plan, device.type, groups, mesh_cache())
        return cls(pp=lowered, groups=groups, device=device, cache=mesh_cache(), **prepared, **kwargs)

    # ---- tied parameters -----------------------------------------------------------------
    def _tied_pieces(self, name: str) -> list[torch.Tensor]:
        """This rank's piece of a tied parameter's gradient in each of its chunks holding it."""
        rank = self._groups["shard"].rank
        out = []
        for ch in self._chunks.values():
            for lay in ch.comm.layouts:
                for slot in lay.slots:
                    if slot.name == name:
                        out.append(local_piece(lay, slot, ch.grads[lay.index], rank))
        return out

    # ---- the step ------------------------------------------------------------------------
    def _peer(self, chunk: int) -> int:
        return self._pipe.ranks[self.program.schedule.rank_of(chunk)]

    def _here(self, chunk: int) -> bool:
        """Whether ``chunk`` (possibly out of range) is one of this rank's: a value for it is handed over, not sent."""
        return chunk in self._chunks

    def _tag(self, mb: int, chunk: int, backward: bool, i: int) -> int:
        return ((mb * len(self.program.chunks) + chunk) * 2 + backward) * 256 + i

    def _post(self, batch, outbox: dict, inbox: dict, posted: list) -> None:
        """Post one batch of adjacent P2P actions as one ``batch_isend_irecv``. Its Work is waited for
        right before the first compute that reads one of its receives (``_received``), and at the end
        of the step: on NCCL the batch is one coalesced Work, and its buffers are valid only after it."""
        stages = self.program.split.stages
        k = self._rp.gpus_per_node
        node = self.program.rank // k
        ops, received, receives = [], [], []
        for a in batch:
            backward = a.op in (Op.SEND_GRAD, Op.RECV_GRAD)
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                peer = self._peer(a.chunk + (-1 if backward else 1))
                specs = stages[a.chunk].send_grad if backward else stages[a.chunk].send_act
                for i, (t, tr) in enumerate(zip(outbox.pop((a.op, a.mb, a.chunk)), specs)):
                    piece = self._piece(t.contiguous(), tr)
                    ops.append(dist.P2POp(dist.isend, piece, peer, self._pipe.group,
                                          self._tag(a.mb, a.chunk, backward, i)))
                    self._stats.record_send(self._pipe, piece.numel() * piece.element_size(),
                                            inter_node=peer // k != node)
            else:
                src = a.chunk + (1 if backward else -1)
                specs = stages[a.chunk].recv_grad if backward else stages[a.chunk].recv_act
                bufs = [self._recv_buffer(f"{a.op.value}{a.chunk}", t) for t in specs]
                received.append(((a.op, a.mb, a.chunk), bufs, specs))
                for i, (t, tr) in enumerate(zip(bufs, specs)):
                    receives.append(len(ops))
                    ops.append(dist.P2POp(dist.irecv, self._piece(t, tr), self._peer(src), self._pipe.group,
                                          self._tag(a.mb, src, backward, i)))
        what = f"pipeline P2P over {self._pipe.label()} ({' '.join(map(str, batch))})"
        with C.guarded(what):
            work = _Posted(dist.batch_isend_irecv(ops) if ops else [], len(ops), receives, what)
        posted.append(work)
        for key, bufs, specs in received:
            inbox[key] = (bufs, work, specs)

    def _received(self, inbox: dict, key) -> list[torch.Tensor]:
        """A receive's buffers, after waiting for the batch that brings them (none: a local input), each
        scattered one made whole over the tensor group."""
        if key not in inbox:
            return []
        bufs, work, specs = inbox.pop(key)
        if work is not None:  # (None: handed over by this rank's previous chunk, ZB-V's turn)
            work.wait(receives_only=True)
        self._gather_pieces(bufs, specs, self._stats)
        return bufs

    def _piece(self, t: torch.Tensor, tr: Transfer) -> torch.Tensor:
        """What this rank sends or receives of a transfer's buffer ``t``: all of it, or for a scattered one
        (``Transfer.pieces``) this tensor rank's piece of it flattened, in place in ``t``."""
        if tr.pieces == 1:
            return t
        flat = t.view(-1)
        n = flat.numel() // tr.pieces
        return flat.narrow(0, self._groups["tensor"].rank * n, n)

    def _gather_pieces(self, bufs: list[torch.Tensor], specs, stats: CommStats) -> None:
        """Megatron's gather: each scattered receive all-gathered in place over the tensor group (inside
        the node), on the compute's path (its forward or backward reads it next)."""
        tensor = self._groups.get("tensor")
        for t, tr in zip(bufs, specs):
            if tr.pieces > 1:
                with C.guarded(f"all_gather of a pipeline receive over {tensor.label()}"):
                    dist.all_gather_single(t.view(-1), self._piece(t, tr), group=tensor.group)
                stats.record(C.ALL_GATHER, tensor, t.numel() * t.element_size())

    def _recv_buffer(self, name: str, spec) -> torch.Tensor:
        if self._arena is None:
            return torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        return self._arena.take(name, torch.Size(spec.shape).numel(), spec.dtype, tuple(spec.shape))

    def _micro_steps(self, micro: list, loss_sum: torch.Tensor) -> None:
        pp = self.program
        outbox: dict = {}
        inbox: dict = {}  # receive -> (its buffers, its batch's _Posted)
        saved: dict = {}
        posted: list[_Posted] = []
        backwards = dict.fromkeys(self._chunks, 0)  # per chunk: its backwards run so far this step
        weights = dict.fromkeys(self._chunks, 0)  # (a zero-bubble schedule's W's)
        later: dict = {}  # (mb, chunk) -> W's arguments, between its B and its W
        for a in pp.schedule.batched(self._stage):
            if isinstance(a, tuple):
                self._post(a, outbox, inbox, posted)
            elif a.op is Op.FORWARD:
                ch = self._chunks[a.chunk]
                acts = self._received(inbox, (Op.RECV_ACT, a.mb, a.chunk))
                inputs = [micro[a.mb][k] for k in ch.batch_inputs]
                n_grad = len(pp.split.stages[a.chunk].recv_grad)
                args = [ch.comm, *ch.shards, *ch.buffers, *inputs, *acts, *([None] * n_grad)]
                out = ch.phases.forward(*_pick(args, ch.fwd_used))
                if out[0] is not None:
                    loss_sum += out[0].float()
                if ch.n_send_act and self._here(a.chunk + 1):  # (ZB-V's turn: the next chunk is this rank's)
                    inbox[(Op.RECV_ACT, a.mb, a.chunk + 1)] = (list(out[1 : 1 + ch.n_send_act]), None, ())
                elif ch.n_send_act:
                    outbox[(Op.SEND_ACT, a.mb, a.chunk)] = out[1 : 1 + ch.n_send_act]
                saved[(a.mb, a.chunk)] = (inputs, acts, out[1 + ch.n_send_act :])
                del out, args, acts
            elif a.op is Op.BACKWARD:
                ch = self._chunks[a.chunk]
                inputs, acts, kept = saved.pop((a.mb, a.chunk))
                grads_in = self._received(inbox, (Op.RECV_GRAD, a.mb, a.chunk))
                every = [ch.comm, *ch.shards, *ch.buffers, *inputs, *acts, *grads_in, *kept]
                args = _pick(every, ch.bwd_used)
                if ch.phases.weight is not None:  # what W reads of them, held until W (the rest dies in B)
                    later[(a.mb, a.chunk)] = _pick(every, ch.w_used)
                del acts, kept, grads_in, every
                ch.comm.micro_step = backwards[a.chunk]  # the first copies into the accumulators, the last
                backwards[a.chunk] += 1                  # starts the second hops (collectives.accumulate)
                out = ch.phases.backward(args)  # boxed: it empties args, so saved values die at their last use
                if ch.phases.weight is not None:  # B's values W reads come last, after the forward's
                    mine, n = later[(a.mb, a.chunk)], len(out) - ch.phases.carried
                    mine += _pick(out[n:], ch.w_used[len(mine):])
                    out = out[:n]
                if out and self._here(a.chunk - 1):
                    inbox[(Op.RECV_GRAD, a.mb, a.chunk - 1)] = (list(out), None, ())
                elif out:
                    outbox[(Op.SEND_GRAD, a.mb, a.chunk)] = out
                del out
            elif a.op is Op.WEIGHT:  # a zero-bubble schedule's weight gradients, deferred
                ch = self._chunks[a.chunk]
                ch.comm.micro_step = weights[a.chunk]  # (W accumulates and starts the second hops: its count)
                weights[a.chunk] += 1
                ch.phases.weight(later.pop((a.mb, a.chunk)))
            elif a.op is not Op.ALL_REDUCE:  # AR, every rank's last action: the boundary, below
                raise ProgramError(f"unknown pipeline action {a}")
        for work in posted:  # the sends (and any receive nothing read)
            work.wait()

    # ---- evaluation -----------------------------------------------------------------------
    def _build_evaluation(self, etg: TrainGraph, lowered: LoweredPipeline):
        """Forward only through the stages: the forward-and-loss graph split at the training step's cut
        points, each of this rank's chunks lowered with its training layouts; run micro-batch by
        micro-batch, chunk by chunk in order, each chunk's activations sent to the next one's rank
        (blocking, one at a time: deadlock-free under NCCL's rules, no overlap between stages)."""
        rp, g = self.program.plan, self._groups
        sp = split(etg, rp, starts=lowered.split.starts)
        runs, programs = {}, {}
        for c in lowered.my_chunks():
            st = sp.stages[c]
            graph, programs[c] = lower_evaluation(st.graph, rp, lowered.chunks[c], g, lowered.rank, device=self.device)
            comm = Comm(lowered.chunks[c].ctx.layouts, g["shard"], g["replicate"], g["world"], stats=self.eval_stats,
                        tensor=g.get("tensor"))
            ch = self._chunks[c]
            buffers = [ch.buffer_state[n] for n in st.graph.buffer_names]
            runs[c] = (torch.fx.GraphModule(st.graph.gm, graph), comm, st, buffers)
        self.eval_program = programs
        chunks = len(sp.stages)

        def run(micro: list, loss_sum: torch.Tensor) -> None:
            for _, comm, _, _ in runs.values():
                comm.carried.clear()
                comm.micro_steps = len(micro)
            handed: dict[int, list] = {}  # chunk -> its inputs from this rank's previous chunk (ZB-V's turn)
            for mb in range(len(micro)):
                for c in range(chunks):
                    if c not in runs:
                        continue
                    gm, comm, st, buffers = runs[c]
                    ch = self._chunks[c]
                    if c in handed:
                        acts = handed.pop(c)
                    else:
                        acts = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in st.recv_act]
                        with C.guarded(f"evaluate: activations of chunk {c - 1} over {self._pipe.label()}"):
                            for i, (t, tr) in enumerate(zip(acts, st.recv_act)):
                                dist.recv(self._piece(t, tr), self._peer(c - 1), group=self._pipe.group,
                                          tag=self._tag(mb, c - 1, False, i))
                        self._gather_pieces(acts, st.recv_act, self.eval_stats)
                    comm.micro_step = mb
                    out = gm(comm, *ch.shards, *buffers, *[micro[mb][k] for k in st.batch_inputs], *acts)
                    if out[0] is not None:
                        loss_sum += out[0].float()
                    if st.send_act and self._here(c + 1):
                        handed[c + 1] = list(out[len(out) - len(st.send_act):])
                        continue
                    with C.guarded(f"evaluate: activations of chunk {c} over {self._pipe.label()}"):
                        # the last outputs: (loss or None, one per bucket (no gradient here), *activations)
                        for i, (t, tr) in enumerate(zip(out[len(out) - len(st.send_act):], st.send_act)):
                            dist.send(self._piece(t.contiguous(), tr), self._peer(c + 1), group=self._pipe.group,
                                      tag=self._tag(mb, c, False, i))
        return run

    def _tied_parts(self) -> dict[str, list[int]]:
        return self.program.split.tied

    def _sum_tied(self) -> None:
        for name in sorted(self.program.split.tied):
            pieces = self._tied_pieces(name)
            if not pieces:
                continue
            total = torch.stack(pieces).sum(0) if len(pieces) > 1 else pieces[0].clone()
            if name in self._tied:
                tied = self._tied[name]
                with C.guarded(f"all_reduce of tied {name} over {tied.label()}"):
                    dist.all_reduce(total, group=tied.group)
                self._stats.record(C.ALL_REDUCE, tied, total.numel() * total.element_size())
            for piece in pieces:
                piece.copy_(total)

    # ---- export -------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters and buffers on CPU, keyed like ``model.state_dict()``; every rank
        must call it. Each stage gathers its chunks over its partition group; then each tensor is
        broadcast from the one rank that holds it (the first replica's shard rank 0 of its stage) on
        the step's device, one at a time: only names and shapes travel as objects."""
        mine = self._gathered()
        if self._groups["shard"].rank or self._groups["replicate"].rank:
            mine = {}
        specs: list = [None] * self._rp.world_size
        dist.all_gather_object(specs, {k: (tuple(v.shape), v.dtype) for k, v in mine.items() if k in self._state_keys})
        owner = {}
        for r, part in enumerate(specs):
            for k, spec in part.items():
                owner.setdefault(k, (r, spec))
        rank, full = dist.get_rank(), {}
        for k in self._state_keys:
            src, (shape, dtype) = owner[k]
            t = mine[k].to(self.device) if rank == src else torch.empty(shape, dtype=dtype, device=self.device)
            with C.guarded(f"broadcast of {k} from rank {src}"):
                dist.broadcast(t, src=src)
            full[k] = mine[k] if rank == src else t.cpu()
        return full
