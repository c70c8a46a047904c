"""pipeline_split: cut the traced training graph into pipeline chunks (MiCS-Pipe stages).

The units are the model's blocks (passes.buckets) in forward order; ``stage_balance``
cuts them into S * v contiguous chunks, balanced by the cost model's predicted time
of each block (forward + backward), with each chunk's memory as a constraint.
Chunk c runs on pipeline rank c % S.

Every node of the joint graph then gets a chunk:

* forward: its block's chunk (the loss: the last chunk), never earlier than the
  chunks of its inputs (a root-level op joins the latest chunk it reads from);
* backward: its forward op's chunk (``seq_nr`` → block, as the trace recorded),
  never later than the chunks of the backward values it reads;
* nodes computed from parameters, buffers, batch inputs or constants alone (views,
  ``arange``) have no chunk: each chunk that reads one recomputes it.

A parameter read by several chunks (tied input/output embeddings) is held by each:
its gradient, a sum over its uses, is split into one partial sum per chunk, and the
runtime all-reduces the partial sums between the chunks that hold it at the
boundary (instead of sending a vocabulary-sized gradient through the pipeline).

Values crossing a cut: a forward value produced in chunk a and read in chunk b > a
travels with the activations through every cut in between (each chunk relays it);
a value read by the backward of an earlier chunk travels back with the gradients.
Each chunk becomes a ``TrainGraph`` of its own, so the MiCS rewrite, the schedule and
the Program lowering apply to it unchanged. Its placeholders are its parameters,
buffers, the batch inputs it reads, the activations it receives, then the gradients
it receives; its output is ``(loss or None, *grads, *activations sent, *gradients sent)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx

from micscompile.core.pipeline_schedule import make_schedule
from micscompile.core.plan import PlanError, ResolvedPlan
from micscompile.core.program import Action, Kind
from micscompile.core.tensor_layout import R
from micscompile.cost_model.node_cost import NodeWork, node_work
from micscompile.cost_model.simulator import compute_time_s
from micscompile.cost_model.specs import A100_40GB, GpuSpec
from micscompile.lowering.phase_split import flat_module, placeholder_like
from micscompile.lowering.stage_balance import balance
from micscompile.passes.buckets import block_of
from micscompile.trace import (
    LOSS_FQN,
    META_BYTES,
    META_DTYPE,
    META_FQN,
    META_PLACEMENT,
    META_REGION,
    META_SHAPE,
    REGION_BWD,
    REGION_FWD,
    TrainGraph,
    copy_node,
)

_ADD = torch.ops.aten.add.Tensor


@dataclass(frozen=True)
class Transfer:
    """A value crossing a cut: its name in the traced graph, shape and dtype. ``pieces``: with tensor
    groups, a value whole on every tensor rank crosses as Megatron's scatter/gather does (Narayanan et al.,
    SC'21, section 4.1): each of the ``pieces`` tensor ranks sends its 1/pieces of it (flattened) to its
    peer, and the receiving tensor group all-gathers it whole; 1: each rank sends all of it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # (an array over micro-batch sizes: mc.autotune)

    @property
    def sent_nbytes(self) -> int:
        """What one rank sends of it."""
        return self.nbytes // self.pieces


def scattered(node: torch.fx.Node, tp: int) -> int:
    """``Transfer.pieces`` of a value crossing a cut: ``tp`` where it is whole on every tensor rank and its
    elements divide into tp pieces (at every micro-batch size ``mc.autotune`` evaluates the shape at), else 1."""
    shape = node.meta[META_SHAPE]
    if tp == 1 or node.meta.get(META_PLACEMENT) != R or (np.asarray(math.prod(shape)) % tp).any():
        return 1
    return tp


@dataclass(frozen=True)
class StageGraph:
    """One pipeline chunk as a TrainGraph of its own (see the module docstring)."""

    chunk: int
    graph: TrainGraph
    blocks: tuple[str, ...]
    batch_inputs: tuple[int, ...]
    """Which inputs of the micro-batch it reads (its placeholders after the buffers)."""
    recv_act: tuple[Transfer, ...]
    """From chunk - 1, in forward (placeholders after the batch inputs)."""
    recv_grad: tuple[Transfer, ...]
    """From chunk + 1, in backward (the last placeholders)."""
    send_act: tuple[Transfer, ...]
    """To chunk + 1 (outputs after the gradients)."""
    send_grad: tuple[Transfer, ...]
    """To chunk - 1 (the last outputs)."""
    has_loss: bool


@dataclass(frozen=True)
class PipelineSplit:
    stages: tuple[StageGraph, ...]
    units: tuple[str, ...]
    """The blocks in forward order."""
    starts: tuple[int, ...]
    """Index in ``units`` where each chunk starts."""
    unit_time_s: tuple[float, ...]
    """Predicted forward + backward time of each unit (what the split balances)."""
    tied: dict[str, tuple[int, ...]]
    """Parameter -> the chunks holding it, for parameters held by more than one."""

    def chunk_time_s(self) -> list[float]:
        ends = (*self.starts[1:], len(self.units))
        return [sum(self.unit_time_s[a:b]) for a, b in zip(self.starts, ends)]


def _placeholders(tg: TrainGraph) -> tuple[list, list, list]:
    ph = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    nb = len(tg.buffer_names)
    return ph[: tg.num_params], ph[tg.num_params : tg.num_params + nb], ph[tg.num_params + nb :]


def node_block(node: torch.fx.Node, blocks: list[str]) -> str | None:
    fqn = node.meta.get(META_FQN, "")
    if fqn == LOSS_FQN:
        return LOSS_FQN
    block = block_of(fqn, blocks)
    return block or None


def forward_units(tg: TrainGraph) -> list[str]:
    """Blocks in the order the forward first runs them (the chain the pipeline is cut along)."""
    seen: dict[str, None] = {}
    for n in tg.gm.graph.nodes:
        if n.op == "call_function" and n.meta.get(META_REGION) == REGION_FWD:
            b = node_block(n, tg.blocks)
            if b is not None and b != LOSS_FQN:
                seen.setdefault(b)
    return list(seen)


def unit_costs(tg: TrainGraph, units: list[str], gpu: GpuSpec, t: int) -> tuple[list[float], list[float], list[float]]:
    """(predicted forward + backward seconds, model-state bytes, saved-activation bytes) per unit."""
    index = {u: i for i, u in enumerate(units)}
    work = [NodeWork() for _ in units]
    saved = [0] * len(units)
    for n in tg.gm.graph.nodes:
        i = index.get(node_block(n, tg.blocks))
        if i is None:
            continue
        work[i] += node_work(n)
        if n.meta.get(META_REGION) == REGION_FWD and any(u.meta.get(META_REGION) == REGION_BWD for u in n.users):
            saved[i] += n.meta.get(META_BYTES, 0)
    seconds = [compute_time_s(Action(Kind.COMPUTE, ops=w.ops, matmul_flops=w.matmul_flops, mem_bytes=w.mem_bytes), gpu)
               for w in work]
    return seconds, unit_state(tg, units, t), saved


def unit_params(tg: TrainGraph, units: list[str]) -> list[bool]:
    """Whether each unit's forward reads a trainable parameter (a tied one counts for every unit that
    reads it: each chunk that does holds it)."""
    index = {u: i for i, u in enumerate(units)}
    params = {n for n, name in zip(tg.gm.graph.find_nodes(op="placeholder"), tg.param_names) if name in tg.trainable}
    reads = [False] * len(units)
    for n in tg.gm.graph.nodes:
        i = index.get(node_block(n, tg.blocks))
        if i is not None and n.meta.get(META_REGION) == REGION_FWD and any(a in params for a in n.all_input_nodes):
            reads[i] = True
    return reads


def param_units(tg: TrainGraph, units: Sequence[str]) -> dict[str, int]:
    """The unit each parameter's block is (a tied parameter: its own block's only); parameters outside every unit
    are absent."""
    index = {u: i for i, u in enumerate(units)}
    out = {name: index.get(block_of(name.rpartition(".")[0], tg.blocks)) for name in tg.param_names}
    return {name: i for name, i in out.items() if i is not None}


def unit_state(tg: TrainGraph, units: list[str], t: int) -> list[float]:
    """Model-state bytes per unit on one of ``t`` ranks: fp32 weights, gradients, Adam m and v, sharded."""
    state = [0.0] * len(units)
    for name, i in param_units(tg, units).items():
        state[i] += 16 * tg.param_bytes(name) / 4 / t
    return state


def in_flight(rp: ResolvedPlan) -> int:
    """How many micro-batches' activations each chunk of ``rp`` is cut to keep (``cut_points``): its rank's most in
    flight on ``rp``'s schedule, shared by its v chunks."""
    plan = rp.plan
    return _in_flight(plan.pipeline_schedule, rp.stages, rp.micro_batches, plan.chunks)


@functools.lru_cache(maxsize=4096)
def _in_flight(kind: str, stages: int, micro_batches: int, chunks: int) -> int:
    sched = make_schedule(kind, stages, micro_batches, chunks, nccl=False)
    return -(-max(sched.max_in_flight()) // chunks)


def cut_points(rp: ResolvedPlan, seconds: list[float], state: list[float], saved: list[float],
               gpu: GpuSpec | None, params: list[bool], flight: int | None = None) -> tuple[int, ...]:
    """Where the S * v chunks start: time balanced among the cuts whose chunks fit the device (each
    keeps its model states and the activations of ``flight`` micro-batches, default ``in_flight(rp)``) and read
    a parameter each (``params``: per unit, ``unit_params``). Nothing else of ``rp`` than S * v is read."""
    chunks = rp.stages * rp.plan.chunks
    kept = in_flight(rp) if flight is None else flight
    memory = [s + a * kept for s, a in zip(state, saved)]
    capacity = (gpu or A100_40GB).memory_bytes
    # every chunk must hold parameters (its rank's optimizer steps them): a block without any (a
    # normalisation held in buffers) is cut together with the next block that has some
    firsts = [0] + [i + 1 for i, b in enumerate(params[:-1]) if b and any(params[i + 1:])]
    if chunks > len(firsts):
        raise PlanError(f"cannot cut the model into {chunks} pipeline chunks (stages x chunks per rank): only "
                        f"{len(firsts)} of its {len(params)} blocks read parameters, and a chunk without any would "
                        f"have nothing to train; use at most {len(firsts)}")
    bounds = list(zip(firsts, firsts[1:] + [len(params)]))

    def merged(values):
        return [sum(values[a:b]) for a, b in bounds]
    try:
        starts = balance(merged(seconds), chunks, merged(memory), lambda c: capacity)
    except PlanError:  # nothing fits: balance time alone (the prediction shows the peak)
        starts = balance(merged(seconds), chunks)
    return tuple(firsts[i] for i in starts)


def assign_chunks(tg: TrainGraph, chunk_of_block: dict[str, int], last: int) -> dict[torch.fx.Node, int]:
    """Each computed node's chunk (module docstring); nodes absent from the result are recomputed
    by every chunk that reads them."""
    chunk: dict[torch.fx.Node, int] = {}
    for n in tg.gm.graph.nodes:
        if n.op != "call_function":
            continue
        block = node_block(n, tg.blocks)
        pref = last if block == LOSS_FQN else chunk_of_block.get(block)
        ins = [i for i in n.all_input_nodes if i in chunk]
        if n.meta.get(META_REGION) == REGION_FWD:
            lo = max((chunk[i] for i in ins), default=None)
            options = [x for x in (pref, lo) if x is not None]
            if options:
                chunk[n] = max(options)
        else:
            later = [chunk[i] for i in ins if i.meta.get(META_REGION) == REGION_BWD]
            options = ([pref] if pref is not None else []) + later
            if options:
                chunk[n] = min(options)
            elif ins:
                chunk[n] = max(chunk[i] for i in ins)
    return chunk


def grad_sum(grad: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """A parameter gradient as (addends, the adds summing them): autograd sums the gradient of a
    parameter used more than once (tied embeddings)."""
    leaves, adds, todo = [], [], [grad]
    while todo:
        n = todo.pop()
        is_sum = (n.op == "call_function" and n.target is _ADD and not n.kwargs and len(n.args) == 2
                  and all(isinstance(a, torch.fx.Node) for a in n.args) and (n is grad or len(n.users) == 1))
        if is_sum:
            adds.append(n)
            todo.extend(reversed(n.args))
        else:
            leaves.append(n)
    return leaves, adds


def _grad_parts(grad: torch.fx.Node, chunk: dict) -> tuple[dict[int, list[torch.fx.Node]], list[torch.fx.Node]]:
    """A parameter gradient as partial sums per chunk: (chunk -> addends, the adds dissolved).
    Only a sum whose addends lie in different chunks is split."""
    leaves, adds = grad_sum(grad)
    parts: dict[int, list[torch.fx.Node]] = {}
    for leaf in leaves:
        parts.setdefault(chunk.get(leaf, chunk.get(grad, 0)), []).append(leaf)
    if len(parts) == 1:
        return {chunk.get(grad, 0): [grad]}, []
    return parts, adds


def split(tg: TrainGraph, rp: ResolvedPlan, gpu: GpuSpec | None = None,
          starts: tuple[int, ...] | None = None, only: set[int] | None = None,
          unit_seconds: Sequence[float] | None = None) -> PipelineSplit:
    """Cut ``tg`` into ``S * v`` chunks for ``rp`` (``starts`` forces the cut points). ``only``: build
    the graphs of these chunks alone (``mc.autotune`` has the others' shapes); the rest are None.
    ``unit_seconds``: with ``starts``, the units' ``unit_costs`` seconds where the caller has them (not costed again)."""
    plan = rp.plan
    chunks = rp.stages * plan.chunks
    units = forward_units(tg)
    if starts is None or unit_seconds is None:
        seconds, state, saved = unit_costs(tg, units, gpu or A100_40GB, rp.partition_size)
    else:
        seconds = list(unit_seconds)
    if starts is None:
        starts = cut_points(rp, seconds, state, saved, gpu, unit_params(tg, units))
    if len(starts) != chunks or starts[0] != 0 or list(starts) != sorted(set(starts)) or starts[-1] >= len(units):
        raise PlanError(f"bad pipeline cut points {starts} for {chunks} chunks of {len(units)} blocks")
    chunk_of_block = {u: max(c for c, s in enumerate(starts) if s <= i) for i, u in enumerate(units)}
    chunk = assign_chunks(tg, chunk_of_block, chunks - 1)
    return _build(tg, chunk, chunks, units, tuple(starts), seconds, only, chunk_of_block)


def _build(tg: TrainGraph, chunk: dict, chunks: int, units: list[str], starts: tuple[int, ...],
           seconds: list[float], only: set[int] | None, chunk_of_block: dict[str, int]) -> PipelineSplit:
    """The split of ``tg`` with each node assigned to a chunk (``chunk``; unassigned nodes are recomputed where
    read), in named steps: each gradient cut into the chunks' parts (``_grad_parts``), what each chunk computes
    and sends (``_flows``), which chunks hold each parameter (``_holders``), then each chunk's graph
    (``_stage_graph``; ``only``: those chunks, the others None)."""
    output = next(n for n in reversed(tg.gm.graph.nodes) if n.op == "output")
    loss, *grads = output.args[0]
    if chunk.get(loss) != chunks - 1:
        raise PlanError("the loss must be computed by the last pipeline chunk")
    parts: dict[str, dict[int, list]] = {}
    dissolved: set = set()
    for name, g in zip(tg.trainable, grads):
        if isinstance(g, torch.fx.Node):
            parts[name], adds = _grad_parts(g, chunk)
            dissolved.update(adds)
    placeholders = _placeholders(tg)
    flows = _flows(tg, chunk, chunks, parts, dissolved, output)
    holders = _holders(tg, placeholders[0], flows, parts, chunk_of_block, chunks)
    tied = {n: tuple(sorted(cs)) for n, cs in holders.items() if len(cs) > 1}
    # a tied parameter is a block of its own in every chunk: its bucket then holds it alone and is
    # sharded alike wherever it is (its gradient is summed piece by piece), also where its module's
    # other parameters are read by one chunk only (passes.buckets.assign_buckets)
    blocks = [*tg.blocks, *tied]
    ends = (*starts[1:], len(units))
    stages = tuple(None if only is not None and c not in only else
                   _stage_graph(tg, placeholders, c, flows, holders, parts, loss, blocks,
                                tuple(units[starts[c]:ends[c]]))
                   for c in range(chunks))
    return PipelineSplit(stages, tuple(units), starts, tuple(seconds), tied)


@dataclass
class _Flows:
    """What each chunk of a split computes and reads, and what crosses each cut."""

    order: dict[torch.fx.Node, int]
    """Each node's place in the traced graph (every list below is in that order)."""
    own: list[set]
    """own[c]: the nodes chunk c computes (its own, and what it recomputes)."""
    acts: list[set]
    """acts[c]: the forward values sent from chunk c to c + 1."""
    grads_back: list[set]
    """grads_back[c]: the backward values sent from chunk c to c - 1."""
    need: list[set]
    """need[c]: every node chunk c reads."""


def _flows(tg: TrainGraph, chunk: dict, chunks: int, parts: dict[str, dict[int, list]], dissolved: set,
           output: torch.fx.Node) -> _Flows:
    """Each chunk computes its own nodes (the gradients' sums ``dissolved`` into their parts aside) and recomputes
    what it reads that no chunk owns; a forward value read by a later chunk crosses each cut between them, a
    backward value read by an earlier one crosses back. A backward value flowing forward, or a forward node
    reading a later chunk's value, cannot be pipelined."""
    order = {n: i for i, n in enumerate(tg.gm.graph.nodes)}
    own: list[set] = [set() for _ in range(chunks)]
    for n, c in chunk.items():
        if n not in dissolved:
            own[c].add(n)
    flows = _Flows(order, own, [set() for _ in range(chunks)], [set() for _ in range(chunks)],
                   [set() for _ in range(chunks)])
    acts, grads_back, need = flows.acts, flows.grads_back, flows.need

    def reads(c: int, n: torch.fx.Node, inputs: list[torch.fx.Node] | None = None) -> None:
        """Chunk ``c`` runs ``n`` (reading ``inputs``, default its own): what must reach it."""
        for i in n.all_input_nodes if inputs is None else inputs:
            if i in need[c]:
                continue
            need[c].add(i)
            if i.op != "call_function":
                continue
            a = chunk.get(i)
            if a is None:  # recomputed here
                own[c].add(i)
                reads(c, i)
            elif a < c:
                if i.meta.get(META_REGION) != REGION_FWD:
                    raise PlanError(f"cannot pipeline: backward value {i.name} would flow to a later chunk")
                for cut in range(a, c):
                    acts[cut].add(i)
            elif a > c:
                if n.meta.get(META_REGION) != REGION_BWD:
                    raise PlanError(f"cannot pipeline: {n.name} (forward, chunk {c}) reads {i.name} of chunk {a}")
                for cut in range(c + 1, a + 1):
                    grads_back[cut].add(i)

    for c in range(chunks):
        for n in sorted(own[c], key=order.__getitem__):
            reads(c, n)
    for by_chunk in parts.values():  # each chunk sums its part of a gradient (the output reads it)
        for c, leaves in by_chunk.items():
            reads(c, output, leaves)
    return flows


def _holders(tg: TrainGraph, params: list[torch.fx.Node], flows: _Flows, parts: dict[str, dict[int, list]],
             chunk_of_block: dict[str, int], chunks: int) -> dict[str, set[int]]:
    """Parameter name -> the chunks that hold it: those that read it or sum a part of its gradient. A parameter
    nothing reads is still state (saved, loaded, exported; eager never steps it): the chunk of its block holds
    it, or the last chunk."""
    param_name = dict(zip(params, tg.param_names))
    holders: dict[str, set[int]] = {}
    for c in range(chunks):
        for p in flows.need[c]:
            if p in param_name:
                holders.setdefault(param_name[p], set()).add(c)
    for name, by_chunk in parts.items():
        for c in by_chunk:
            holders.setdefault(name, set()).add(c)
    for name in tg.param_names:
        if name not in holders:
            holders[name] = {chunk_of_block.get(block_of(name.rpartition(".")[0], tg.blocks), chunks - 1)}
    return holders


def _stage_graph(tg: TrainGraph, placeholders: tuple[list, list, list], c: int, flows: _Flows,
                 holders: dict[str, set[int]],
                 parts: dict[str, dict[int, list]], loss: torch.fx.Node, blocks: list[str],
                 units: tuple[str, ...]) -> StageGraph:
    """Chunk ``c``'s graph: placeholders for the parameters it holds, the buffers and batch inputs it reads, the
    activations and gradients it receives; its own nodes copied in order; outputs its loss (the last chunk), its
    parts of the gradients, and what it sends on and back."""
    graph, order, need = tg.gm.graph, flows.order, flows.need[c]
    params, buffers, inputs = placeholders
    chunks = len(flows.own)
    recv_act = flows.acts[c - 1] if c > 0 else set()
    recv_grad = flows.grads_back[c + 1] if c + 1 < chunks else set()
    stage_params = [n for n in tg.param_names if c in holders.get(n, ())]
    held = set(stage_params)
    stage_buffers = [(b, name) for b, name in zip(buffers, tg.buffer_names) if b in need]
    batch = [i for i, x in enumerate(inputs) if x in need]
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for p, name in zip(params, tg.param_names):
        if name in held:
            env[p] = placeholder_like(new, p)
    for b, _ in stage_buffers:
        env[b] = placeholder_like(new, b)
    for i in batch:
        env[inputs[i]] = placeholder_like(new, inputs[i])
    for v in sorted(recv_act, key=order.__getitem__):
        env[v] = placeholder_like(new, v, "act_")
    for v in sorted(recv_grad, key=order.__getitem__):
        env[v] = placeholder_like(new, v, "grad_")
    for n in graph.nodes:  # constants
        if n.op == "get_attr" and n in need:
            env[n] = copy_node(new, n)
    for n in sorted(flows.own[c], key=order.__getitem__):
        if n not in env:
            env[n] = copy_node(new, n, env.__getitem__)
    stage_trainable = [n for n in tg.trainable if n in held]
    stage_grads = []
    for name in stage_trainable:
        leaves = parts.get(name, {}).get(c)
        stage_grads.append(_sum(new, [env[leaf] for leaf in leaves]) if leaves else None)
    stage_loss = env[loss] if c == chunks - 1 else None
    out = (stage_loss, *stage_grads, *(env[v] for v in sorted(flows.acts[c], key=order.__getitem__)))
    out += tuple(env[v] for v in sorted(flows.grads_back[c], key=order.__getitem__))  # (none leave chunk 0)
    new.output(out)
    stage_tg = TrainGraph(
        gm=flat_module(tg.gm, new), param_names=stage_params,
        param_aliases={n: tg.param_aliases[n] for n in stage_params},
        param_shapes={n: tg.param_shapes[n] for n in stage_params},
        param_dtypes={n: tg.param_dtypes[n] for n in stage_params},
        trainable=stage_trainable, buffer_names=[name for _, name in stage_buffers],
        input_specs=[tg.input_specs[i] for i in batch], num_model_inputs=tg.num_model_inputs,
        blocks=blocks, compute_dtype=tg.compute_dtype, token_shape=tg.token_shape,
    )

    def transfers(values: set) -> tuple[Transfer, ...]:
        return tuple(Transfer(v.name, v.meta[META_SHAPE], v.meta[META_DTYPE], scattered(v, tg.tensor_parallel))
                     for v in sorted(values, key=order.__getitem__))

    return StageGraph(
        chunk=c, graph=stage_tg, blocks=units, batch_inputs=tuple(batch), recv_act=transfers(recv_act),
        recv_grad=transfers(recv_grad), send_act=transfers(flows.acts[c]), send_grad=transfers(flows.grads_back[c]),
        has_loss=c == chunks - 1,
    )


def _sum(graph: torch.fx.Graph, terms: list[torch.fx.Node]) -> torch.fx.Node:
    total = terms[0]
    for t in terms[1:]:
        total = graph.call_function(_ADD, (total, t))
        total.meta = dict(t.meta)
    return total


__all__ = ["PipelineSplit", "StageGraph", "Transfer", "scattered", "split", "forward_units", "unit_costs", "unit_state",
           "cut_points", "assign_chunks"]
