"""Buffer lifetimes of one optimizer step: what a rank allocates, when, and until when.

Time is the position in the rank's execution: one step per node of a rewritten graph
as the runtime runs it. A flat plan runs its graph once per micro-step, so
micro-step j covers ``[j * T, (j + 1) * T)`` with T = nodes + 1 (the last step is the
runtime taking the graph's outputs). A pipeline rank
runs its chunks' forward and backward halves in schedule order (``pipeline_buffers``).
A buffer lives over the half-open ``[start, end)``: from the node that allocates it
to one past its last use (FX frees a value right after its last user; a view keeps
its base alive).

Kinds. Allocated by the collectives (``ARENA_KINDS``: with an arena the runtime takes
them from it, in exactly the order listed here, see ``micscompile.memory.arena``):

* ``gathered``: an all-gather's result, from the issue to the last use of its views
  (the release); a gather issued for the next micro-step starts in this one.
* ``gather_across`` / ``gather_intra``: a hierarchical gather's stages: the across-node
  piece (issue to wait) and the intra-node result before it is reordered (at the wait).
* ``grad_bucket``: gradients packed flat for a reduce-scatter / all-reduce (to the
  wait; to the end of the micro-step when its result is a view of it);
  ``grad_reorder`` / ``grad_partial``: a hierarchical reduce-scatter's reordered input
  and its intra-node result.
* ``grad_shard``: a reduce-scatter's result, held until it is accumulated (a flat plan's
  graph, right after the wait; a pipeline chunk's output, by the runtime).
* ``recv``: a pipeline P2P receive buffer, from the receive to the backward of its
  micro-batch (the runtime keeps a forward's inputs for its backward).

``host``: an offloaded activation's host copy (``micscompile.passes.offload``), not device memory.
Computed by the graph's ops: ``activation`` (alive into the backward: saved for it) and
``temporary`` (the rest); in the arena too when the op writes ``out=`` an ``arena_out``
buffer (``passes.out_variants``; named ``out:<node>``), else allocated by the op itself.
Persistent state (parameter shards, gradient accumulators, optimizer state) is not a
step buffer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx

from micscompile.core import collectives as C
from micscompile.core.errors import InputError
from micscompile.core.pipeline_schedule import COMPUTE, Op
from micscompile.core.program import REGION_BWD
from micscompile.core.sharding import BucketLayout
from micscompile.cost_model.node_cost import META_BYTES, _is_view, mutates_first
from micscompile.memory.planner import Buffer, MemoryPlan, plan_memory
from micscompile.passes.manager import run_passes, runtime_pass_list
from micscompile.passes.offload import offload, offload_done, reload_issue, reload_wait
from micscompile.passes.out_variants import OUT_PREFIX, arena_out
from micscompile.passes.weight_split import backward_phases
from micscompile.trace import META_REGION

ARENA_KINDS = frozenset({"gathered", "gather_across", "gather_intra", "grad_bucket", "grad_reorder", "grad_partial",
                         "grad_shard", "recv"})
def in_arena(b: Buffer) -> bool:
    """Whether the runtime takes ``b`` from its arena (with ``passes.out_variants`` applied)."""
    return b.kind in ARENA_KINDS or b.name.startswith(OUT_PREFIX)


def on_device(buffers: list[Buffer]) -> list[Buffer]:
    """The buffers in device memory (offloaded host copies excluded)."""
    return [b for b in buffers if b.kind != "host"]


_GATHERS = (C.all_gather_issue, C.all_gather_carried, C.all_gather_next)
_GRAD_SYNCS = (C.reduce_scatter_issue, C.all_reduce_issue)
_NO_ALLOC = (C.collective_wait, C.release, reload_wait, offload_done, *_GATHERS, *_GRAD_SYNCS,
             C.accumulate, C.accumulate_local, C.accumulate_mm, C.second_hop)  # (these write the accumulators)


@dataclass
class _Rec:
    size: int
    start: int
    end: int
    name: str
    kind: str


@dataclass
class _Gather:
    """A gather issued and not yet waited for (possibly by the previous micro-step)."""

    bucket: int
    first: _Rec
    """The buffer its issue allocated (the hierarchical across-node piece ends at the wait)."""


def _roots(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """The value each node's result keeps alive (a view's base, transitively)."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        base = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        out = n.kwargs.get("out") if n.op == "call_function" else None
        if isinstance(out, torch.fx.Node):  # an op writing into an arena buffer returns that buffer
            base = out
        aliases = _is_view(n) or out is not None or mutates_first(n)
        root[n] = root[base] if (aliases and base is not None and base in root) else n
    return root


class GraphLifetimes:
    """One rewritten graph's allocations, replayed at the times an execution gives its nodes."""

    def __init__(self, graph: torch.fx.Graph, layouts: tuple[BucketLayout, ...], groups: dict) -> None:
        self.nodes = [n for n in graph.nodes if n.op in ("call_function", "placeholder", "output")]
        self.layouts = layouts
        self.k = groups["intra"].size if "intra" in groups else 1
        self.root = _roots(self.nodes)
        self.users: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for n in self.nodes:
            for i in n.all_input_nodes:
                self.users.setdefault(self.root[i], []).append(n)
        self.wait_of = {n.args[1]: n for n in self.nodes if n.target is C.collective_wait}
        self.saved = {n for n in self.nodes if n.op == "call_function" and n.meta.get(META_REGION) != REGION_BWD
                      and any(u.meta.get(META_REGION) == REGION_BWD for u in self.users.get(n, ()))}

    def run(self, when: Callable[[torch.fx.Node], int], held_until: Callable[[torch.fx.Node], int], out: list[_Rec], *,
            micro_step: int = 0, micro_steps: int = 1, carry: deque | None = None,
            nodes: list[torch.fx.Node] | None = None) -> None:
        """Append the buffers one execution of ``nodes`` (default: all) allocates, in the runtime's
        order. ``when(node)``: the node's time in this execution (its last users may run in a later
        execution, e.g. a pipeline backward); ``held_until(root)``: when the runtime drops the
        graph's outputs that are (views of) the value ``root``. ``carry``: gathers issued for the
        next micro-step (consumed and refilled)."""
        carry = carry if carry is not None else deque()
        mine: deque = deque()
        pending: dict[torch.fx.Node, _Gather] = {}  # issuing (or carried) node -> its gather

        def last_use(n: torch.fx.Node) -> int:
            root = self.root[n]
            users = self.users.get(root, ())
            return max((held_until(root) - 1 if u.op == "output" else when(u) for u in users), default=when(n))

        of: dict[torch.fx.Node, _Rec] = {}  # value (root) -> its buffer

        def add(size: int, start: int, end: int, name: str, kind: str, value: torch.fx.Node | None = None) -> _Rec:
            rec = _Rec(size, start, max(end, start + 1), name, kind)
            out.append(rec)
            if value is not None:
                of[value] = rec
            return rec

        for n in nodes if nodes is not None else self.nodes:
            if n.op != "call_function":
                continue
            t = when(n)
            if n.target in _GATHERS:
                bucket, hier = n.args[1], n.kwargs.get("hierarchical", False)
                issues = (n.target is C.all_gather_issue or (n.target is C.all_gather_carried and micro_step == 0)
                          or (n.target is C.all_gather_next and micro_step < micro_steps - 1))
                if issues:
                    full = self.layouts[bucket].full_bytes
                    first = add(full // self.k if hier else full, t, t + 1, f"AG{bucket}",
                                "gather_across" if hier else "gathered")
                    g = _Gather(bucket, first)
                    if n.target is C.all_gather_next:
                        mine.append(g)
                    else:
                        pending[n] = g
                elif n.target is C.all_gather_carried:
                    g = carry.popleft()
                    if g.bucket != bucket:
                        raise InputError(f"carried gather of bucket {g.bucket} where bucket {bucket} is used")
                    pending[n] = g
            elif n.target is C.collective_wait and n.args[1] in pending:
                g = pending.pop(n.args[1])
                hier = n.args[1].kwargs.get("hierarchical", False)
                full = self.layouts[g.bucket].full_bytes
                end = last_use(n) + 1
                if hier:
                    g.first.end = t + 1
                    add(full, t, t + 1, f"AG{g.bucket}", "gather_intra")
                    add(full, t, end, f"AG{g.bucket}", "gathered")
                else:
                    g.first.end = end
            elif n.target in _GRAD_SYNCS:
                lay = self.layouts[n.args[1]]
                full, row = lay.grad_bytes, lay.grad_shard_bytes
                name = f"RS{n.args[1]}"
                result = self.wait_of.get(n, n)
                held = last_use(result) + 1  # the output (a pipeline chunk's) or its accumulation (flat)
                waited = when(self.wait_of[n]) + 1 if n in self.wait_of else held
                if n.target is C.reduce_scatter_issue:
                    hier = n.kwargs.get("hierarchical", False)
                    add(full, t, t + 1 if hier else waited, name, "grad_bucket")
                    if hier:
                        add(full, t, t + 1, name, "grad_reorder")
                        add(full // self.k, t, waited, name, "grad_partial")
                    add(row, t, held, name, "grad_shard")
                else:  # the result is a view of the packed bucket
                    add(full, t, held, name, "grad_bucket")
            elif n.target is offload:  # a host copy: not device memory (``kind="host"``)
                add(n.args[1].meta.get(META_BYTES, 0), t, last_use(n) + 1, n.name, "host")
            elif n.target is offload_done:  # the side stream read the offloaded value until here
                rec = of.get(self.root[n.args[1].args[1]])
                if rec is not None and rec.end <= t:
                    raise InputError(f"{rec.name} ({rec.kind}) would be free for reuse at step {rec.end} while its "
                                     f"offload copy may read it until step {t} ({n.name})")
            elif n.target is reload_issue:  # allocated at the issue, read through its wait
                wait = next(u for u in self.users[n] if u.target is reload_wait)
                add(wait.meta.get(META_BYTES, 0), t, last_use(wait) + 1, n.name, "activation")
            elif n.target is arena_out:
                size = math.prod(n.args[2]) * n.args[3].itemsize
                add(size, t, last_use(n) + 1, n.args[1], "activation" if n in self.saved else "temporary", n)
            elif n.target not in _NO_ALLOC and self.root[n] is n and n.meta.get(META_BYTES, 0) and n in self.users:
                kind = "activation" if n in self.saved else "temporary"
                add(n.meta[META_BYTES], t, last_use(n) + 1, n.name, kind, n)
        if pending:
            raise InputError(f"gathers never waited for: {sorted(p.name for p in pending)}")
        carry.extend(mine)


def _finish(recs: list[_Rec]) -> list[Buffer]:
    return [Buffer(r.size, r.start, r.end, r.name, r.kind) for r in recs]


def step_buffers(graph: torch.fx.Graph, program) -> list[Buffer]:
    """Every buffer one optimizer step of a flat plan's rewritten ``graph`` allocates on this rank,
    in allocation order (``program``: the Program lowered from it)."""
    lt = GraphLifetimes(graph, program.layouts, program.groups)
    index = {n: i for i, n in enumerate(lt.nodes)}
    period = len(lt.nodes) + 1
    recs: list[_Rec] = []
    carry: deque = deque()
    s = program.plan.micro_batches
    for j in range(s):
        base = j * period
        lt.run(lambda n, base=base: base + index[n], lambda n, end=base + period: end, recs,
               micro_step=j, micro_steps=s, carry=carry)
    if carry:
        raise InputError(f"{len(carry)} gathers carried past the last micro-step")
    return _finish(recs)


class _Phases(NamedTuple):
    lt: GraphLifetimes
    nodes: dict[Op, list[torch.fx.Node]]
    """Each compute action's nodes: F's, B's (the whole backward unless a zero-bubble chunk's is split) and W's
    (``passes.weight_split``; empty unless split)."""
    sends: set[torch.fx.Node]
    """The values (roots) of the outputs sent to another chunk (held until the step ends)."""
    in_bwd: set[torch.fx.Node]


def pipeline_buffers(pp, rank: int | None = None) -> list[Buffer]:
    """Every buffer one optimizer step of a pipeline plan allocates on ``rank`` (default: the
    Program's), in allocation order: its chunks' forward and backward phases and receives, in
    schedule order. A forward's saved values live until the last backward phase that reads them
    (a zero-bubble schedule's W reads some of them, and some of B's); what it sends is held until
    the step ends (the runtime waits for its sends then); a receive until its micro-batch's
    backward is done with it (the runtime keeps a forward's inputs for it), its W where split."""
    rank = pp.rank if rank is None else rank
    actions = pp.schedule.ranks[pp.plan.stage_of(rank)]
    split = pp.schedule.split_backward
    chunks = {}
    for c in pp.my_chunks(rank):
        sched = pp.chunks[c]
        lt = GraphLifetimes(sched.graph, sched.program.layouts, sched.program.groups)
        body = [n for n in lt.nodes if n.op == "call_function"]
        cut = next((i for i, n in enumerate(body) if n.meta.get(META_REGION) == REGION_BWD), len(body))
        b, w = backward_phases(sched.graph) if split else (body[cut:], [])
        outputs = list(lt.nodes[-1].args[0])
        sends = {lt.root[v] for v in outputs[1:] if isinstance(v, torch.fx.Node)}
        chunks[c] = _Phases(lt, {Op.FORWARD: body[:cut], Op.BACKWARD: b, Op.WEIGHT: w}, sends, set(b) | set(w))
    # pass 1: when each action runs (a compute action takes one step per node, plus one to hand
    # over its outputs; a P2P action one step)
    start: dict[tuple, int] = {}
    t = 0
    for a in actions:
        start[(a.op, a.mb, a.chunk)] = t
        t += len(chunks[a.chunk].nodes[a.op]) + 1 if a.op in COMPUTE else 1
    step_end = t
    last = Op.WEIGHT if split else Op.BACKWARD  # (the phase a micro-batch's backward ends with)
    # pass 2: the buffers, in the runtime's order
    recs: list[_Rec] = []
    for a in actions:
        t0 = start[(a.op, a.mb, a.chunk)]
        if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            stage = pp.split.stages[a.chunk]
            end = start[(last, a.mb, a.chunk)] + len(chunks[a.chunk].nodes[last]) + 1
            for tr in stage.recv_act if a.op is Op.RECV_ACT else stage.recv_grad:
                recs.append(_Rec(tr.nbytes, t0, end, f"{a.op.value}{a.chunk}", "recv"))
        elif a.op in COMPUTE:
            lt, nodes, sends, in_bwd = chunks[a.chunk]
            pos = {n: start[(op, a.mb, a.chunk)] + i for op, ns in nodes.items() for i, n in enumerate(ns)}
            f_end = start[(Op.FORWARD, a.mb, a.chunk)] + len(nodes[Op.FORWARD]) + 1
            b_end = start[(Op.BACKWARD, a.mb, a.chunk)] + len(nodes[Op.BACKWARD]) + 1

            def held(n, sends=sends, in_bwd=in_bwd, f_end=f_end, b_end=b_end):
                return step_end if n in sends else b_end if n in in_bwd else f_end

            lt.run(pos.__getitem__, held, recs, nodes=nodes[a.op])
    return _finish(recs)


def run_runtime_passes(graphs, plan, arena: bool) -> None:
    """Run the runtime's passes (``passes.manager.runtime_pass_list``) on ``graphs``, (graph, PassContext)
    pairs, in place: transposes of transposes folded and, with an arena, ops with an ``out=`` overload
    writing into it."""
    passes = runtime_pass_list(plan, arena)
    for graph, ctx in graphs:
        run_passes(graph, ctx, passes)


def arena_offsets(buffers: list[Buffer]) -> tuple[list[Buffer], MemoryPlan]:
    """The buffers the runtime takes from its arena (``in_arena``), in order, and their offsets."""
    owned = [b for b in buffers if in_arena(b)]
    return owned, plan_memory(owned)
