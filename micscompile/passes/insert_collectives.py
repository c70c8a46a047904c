"""insert_collectives: MiCS partitioning of a traced training graph.

Input: a TrainGraph's graph (placeholders: params, buffers, inputs; output: loss and
one gradient per trainable parameter). Output graph signature::

    (comm, shard_0, ..., shard_{B-1}, *buffers, *inputs) -> (loss,)
    a pipeline chunk's: -> (loss, grad_shard_0, ..., grad_shard_{B-1}, *sends)

Rewrite, per bucket b (a gather unit, see passes.buckets):

* A *use interval* is a maximal run of the bucket's consumers (nodes that read a
  parameter, directly or through parameter-only views) with the same phase
  (forward/backward) and region (block). A tied weight used by two blocks therefore
  gets one interval per block it is used in.
* Per interval: ``all_gather_issue`` (``ctx.prefetch.distance`` intervals ahead of its
  use: the issue sits right after the wait of the interval that many before; 0: right
  before its own wait), ``collective_wait`` just before the
  first consumer, one ``unpack_param`` (a view of the gathered bucket) per parameter
  used, parameter-only views
  re-derived from them inside the interval, and ``release`` after the last consumer.
  Forward views that the backward used to share are re-derived from the backward's
  own gather, so nothing gathered in forward stays alive into backward, except for
  ``ctx.prefetch.keep_live`` buckets (those whose forward use ends last): their last
  forward interval and first backward interval merge into one gather.
* ``ctx.prefetch.across_micro_steps`` (distance d >= 1): the first d gathers are
  ``all_gather_carried`` (taken from the previous micro-step when it issued them) and
  ``all_gather_next`` issues them for the next micro-step right after the waits of the
  last d intervals, where gathers n, ..., n + d - 1 would go.
* Gradients: after the bucket's last gradient is produced, ``reduce_scatter_issue``
  over the partition group (2hop) or ``all_reduce_issue`` over all ranks
  (every_step); each is waited just before the next bucket's reduction is issued,
  the last one before the output. The shard is then added into the bucket's fp32
  accumulator (``accumulate``; at p = 1 ``accumulate_local`` adds the gradients
  straight in) and, with 2hop over d > 1 replicas, its ``second_hop`` starts there: on
  the last micro-step (a pipeline chunk: its last backward), the all-reduce over the
  replication group, under the rest of the backward (the runtime waits for it at the
  boundary). The graph outputs only the loss (and a pipeline chunk's sends).
* A pipeline chunk (``plan.stages > 1``) runs its forward and backward as two graphs:
  a backward gather is issued no earlier than the first backward node, and outputs
  after the loss (the chunk's sends) pass through.
* Buckets in ``ctx.hierarchical`` pass ``hierarchical=True`` to their gathers and
  reduce-scatters (collectives.py runs them in two stages over the inter/intra groups).
* p = 1: no gathers (parameters are views of the local shard; with mixed precision,
  of a cast copy made where the gather would be) and ``accumulate_local`` instead of a
  reduce-scatter.

Invariants: every consumer of a parameter sits inside an interval of its bucket;
intervals of one bucket are disjoint; every rank gets the same graph, so every rank
issues the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from micscompile.core import collectives as C
from micscompile.core.errors import InternalError
from micscompile.core.plan import PlanError
from micscompile.core.program import REGION_BWD
from micscompile.core.sharding import unpack_param
from micscompile.passes.buckets import block_of, param_derived
from micscompile.passes.context import PassContext
from micscompile.trace import LOSS_FQN, META_FQN, META_REGION, add_call, copy_node

META_BUCKET = "mc_bucket"
"""Bucket index of an inserted collective / unpack / release node."""


@dataclass
class Interval:
    bucket: int
    key: tuple[str, str]
    """(phase, region) of its consumers."""
    first: torch.fx.Node
    last: torch.fx.Node
    params: set[str] = field(default_factory=set)
    unpacked: dict[str, torch.fx.Node] = field(default_factory=dict)


def _region(node: torch.fx.Node, ctx: PassContext) -> tuple[str, str]:
    if node.op == "output":
        return (REGION_BWD, "<output>")
    fqn = node.meta.get(META_FQN, "")
    block = LOSS_FQN if fqn == LOSS_FQN else block_of(fqn, ctx.graph.blocks)
    return (node.meta.get(META_REGION, REGION_BWD), str(ctx.block_bucket.get(block, block)))


def _tag(node: torch.fx.Node, like: torch.fx.Node, bucket: int | None = None) -> torch.fx.Node:
    node.meta[META_REGION] = like.meta.get(META_REGION, REGION_BWD)
    node.meta[META_FQN] = like.meta.get(META_FQN, "")
    if bucket is not None:
        node.meta[META_BUCKET] = bucket
    return node


def check_keep_live(keep: int, available: int) -> None:
    if keep > available:
        raise PlanError(f"Prefetch.keep_live={keep}, but only {available} buckets are used in both "
                        f"forward and backward")


def keep_live_choice(last_forward: dict[int, int], used_after: Container[int], keep: int) -> list[int]:
    """The buckets ``Prefetch.keep_live`` keeps gathered from forward into backward: of those used
    again after their last forward use (``used_after``), the ``keep`` whose forward use ends last.
    ``last_forward``: bucket -> where its last forward use is (any order-preserving position). The
    one rule this pass applies to the graph and ``lowering.flat.with_keep_live`` to a Program."""
    candidates = [b for b in last_forward if b in used_after]
    check_keep_live(keep, len(candidates))
    return sorted(candidates, key=last_forward.__getitem__, reverse=True)[:keep]


OWN, FIRST, AFTER, CUT = "own", "first", "after", "cut"


def issue_slot(k: int, phases: Sequence[str], distance: int, pipeline: bool) -> tuple[str, int | None]:
    """Where the ``k``-th gather (in use order; ``phases``: each gather's phase) is issued: the one
    rule this pass applies to the graph and ``lowering.flat.with_prefetch`` to a Program.
    (CUT, None): when backward starts (``pipeline``: a chunk's backward gather whose turn falls in
    forward); (OWN, None): right before its own wait (distance 0, or the first gather); (FIRST, None):
    before the first wait (the first ``distance`` gathers); (AFTER, j): right after gather j's wait."""
    if pipeline and k > 0 and distance > 0 and phases[k] == REGION_BWD and (
            k < distance or phases[k - distance] != REGION_BWD):
        return CUT, None
    if distance == 0 or k == 0:
        return OWN, None
    if k < distance:
        return FIRST, None
    return AFTER, k - distance


def carried_gathers(n: int, distance: int, across_micro_steps: bool, micro_batches: int) -> int:
    """How many of the first of ``n`` gathers the previous micro-step issues (``across_micro_steps``):
    the next micro-step's gather j is issued right after the wait of gather n - distance + j."""
    return distance if across_micro_steps and micro_batches > 1 and 1 <= distance < n else 0


def _keep_live(
    intervals: list[Interval], active: dict, order: dict, keep: int,
) -> list[Interval]:
    """Merge, for the ``keep_live_choice`` buckets, their last forward interval with their next
    (backward) one: one gather serves both, released after the backward use."""
    last_fwd = {iv.bucket: i for i, iv in enumerate(intervals) if iv.key[0] != REGION_BWD}
    pairs: dict[int, tuple[int, int]] = {}  # bucket -> (its last forward interval, its next one)
    for b, i in last_fwd.items():
        nxt = next((j for j in range(i + 1, len(intervals)) if intervals[j].bucket == b), None)
        if nxt is not None:
            pairs[b] = (i, nxt)
    # where each ends, as the Program orders their releases (lowering.flat.with_keep_live): after the same
    # last use (a tied weight and the head's bias read by one matmul), a release inserted earlier lands later
    last_forward = {b: (order[intervals[i].last], -i) for b, (i, _) in pairs.items()}
    merged = {}
    for b in keep_live_choice(last_forward, pairs, keep):
        i, j = pairs[b]
        fwd, bwd = intervals[i], intervals[j]
        fwd.last = bwd.last
        fwd.params |= bwd.params
        merged[id(bwd)] = fwd
    for key, iv in active.items():
        active[key] = merged.get(id(iv), iv)
    return [iv for iv in intervals if id(iv) not in merged]


def insert_collectives_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    """MiCS partitioning of ``graph`` under ``ctx``'s plan, layouts, prefetch and hierarchical buckets (the module
    docstring's rewrite), in named steps: find the parameters' use intervals (``use_intervals``), give the graph
    its new signature (``_new_signature``), gather each interval's bucket (``_insert_gathers``), re-derive the
    parameter views inside each interval (``_rederive_views``), reduce each bucket's gradients
    (``_insert_reductions``), and drop the full-parameter placeholders (``_drop_full_parameters``)."""
    uses = use_intervals(graph, ctx)
    comm, shards = _new_signature(graph, ctx)
    _insert_gathers(graph, ctx, uses, comm, shards)
    _rederive_views(graph, uses)
    _insert_reductions(graph, ctx, comm, shards)
    _drop_full_parameters(graph, uses)
    return graph


@dataclass
class Uses:
    """Where a graph reads its parameters (``use_intervals``)."""

    param_nodes: dict[torch.fx.Node, str]
    """Parameter placeholder -> its name."""
    derived: dict[torch.fx.Node, frozenset[str]]
    """Every node computed from parameters alone (placeholders and their views) -> the parameters it reads."""
    consumers: list[torch.fx.Node]
    """The nodes that read a derived node and are not derived themselves, in graph order."""
    intervals: list[Interval]
    """The use intervals, in the order their first consumers run (keep-live pairs merged)."""
    active: dict[tuple[torch.fx.Node, int], Interval]
    """(consumer, bucket) -> the interval it reads that bucket in."""
    bucket_of: dict[str, int]
    """Parameter name -> its bucket."""
    gathers: bool
    """The buckets are gathered (p > 1, or at p = 1 cast to the compute dtype where the gather would be)."""


def use_intervals(graph: torch.fx.Graph, ctx: PassContext) -> Uses:
    """The analysis: each bucket's consumers cut into use intervals (maximal runs with one phase and region), a
    ``keep_live`` bucket's last forward and first backward interval merged into one."""
    layouts = ctx.layouts
    gathers = ctx.plan.partition_size > 1 or any(lay.gather_dtype != lay.dtype for lay in layouts)
    bucket_of = {slot.name: lay.index for lay in layouts for slot in lay.slots}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_nodes = dict(zip(placeholders[: ctx.graph.num_params], ctx.graph.param_names))
    derived = param_derived(graph, param_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    consumers = [
        n for n in graph.nodes
        if n not in derived and n.op != "placeholder" and any(i in derived for i in n.all_input_nodes)
    ]
    intervals: list[Interval] = []
    open_by_bucket: dict[int, Interval] = {}
    active: dict[tuple[torch.fx.Node, int], Interval] = {}
    for c in consumers:
        key = _region(c, ctx)
        used = frozenset().union(*(derived[i] for i in c.all_input_nodes if i in derived))
        for b in sorted({bucket_of[name] for name in used}):
            iv = open_by_bucket.get(b)
            if iv is None or iv.key != key:
                iv = open_by_bucket[b] = Interval(b, key, c, c)
                intervals.append(iv)
            iv.last = c
            iv.params |= {name for name in used if bucket_of[name] == b}
            active[(c, b)] = iv
    intervals.sort(key=lambda iv: (order[iv.first], iv.bucket))
    if gathers and ctx.prefetch.keep_live:
        intervals = _keep_live(intervals, active, order, ctx.prefetch.keep_live)
    return Uses(param_nodes, derived, consumers, intervals, active, bucket_of, gathers)


def _new_signature(graph: torch.fx.Graph, ctx: PassContext) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The graph's new first inputs: ``comm``, then one shard per bucket; the tensor- and context-parallel splits'
    ops (``lowering.tensor_split``, ``lowering.context_split``) run on this Comm too."""
    first = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(first):
        comm = graph.placeholder("comm")
        shards = [graph.placeholder(f"shard_{lay.index}") for lay in ctx.layouts]
    for n in graph.nodes:
        if n.target in C.GROUP_OPS:
            n.args = (comm, *n.args[1:])
    return comm, shards


def _hierarchical(ctx: PassContext, bucket: int) -> dict:
    """The keyword a bucket's gathers and reduce-scatters take where they run in two stages."""
    return {"hierarchical": True} if bucket in ctx.hierarchical else {}


def _insert_gathers(graph: torch.fx.Graph, ctx: PassContext, uses: Uses, comm: torch.fx.Node,
                    shards: list[torch.fx.Node]) -> None:
    """Per interval: its gather's issue (``ctx.prefetch.distance`` intervals ahead; a pipeline chunk's backward
    gathers no earlier than its backward), its wait before the first consumer, one unpack per parameter used and
    its release after the last consumer; across micro-steps, the next micro-step's first gathers issued where
    gathers n, ..., n + d - 1 would go. p = 1 without a cast: the parameters are views of the shard."""
    layouts, intervals, gathers = ctx.layouts, uses.intervals, uses.gathers
    distance = ctx.prefetch.distance
    # across micro-steps: the first `distance` gathers come from the previous micro-step's tail
    carried = carried_gathers(len(intervals), distance, ctx.prefetch.across_micro_steps, ctx.plan.micro_batches)
    phases = [iv.key[0] for iv in intervals]
    # a pipeline chunk runs forward and backward as two graphs (lowering.phase_split): no gather in flight across
    cut = next((n for n in graph.nodes if n.op == "call_function" and n.meta.get(META_REGION) == REGION_BWD), None) \
        if ctx.plan.stages > 1 else None
    waits: list[torch.fx.Node] = []
    last_at_cut = None
    for k, iv in enumerate(intervals):
        lay = layouts[iv.bucket]
        if not gathers:
            src = shards[iv.bucket]
        else:
            slot, j = issue_slot(k, phases, distance, cut is not None)
            at_cut = slot == CUT  # in order, before any backward wait
            if at_cut:
                where = graph.inserting_before(cut) if last_at_cut is None else graph.inserting_after(last_at_cut)
            elif slot == OWN:
                where = graph.inserting_before(iv.first)
            elif slot == FIRST:
                where = graph.inserting_before(waits[0])
            else:
                where = graph.inserting_after(waits[j])
            with where:
                fn = C.all_gather_carried if k < carried else C.all_gather_issue
                issue = add_call(graph, fn, (comm, iv.bucket, shards[iv.bucket]), _hierarchical(ctx, iv.bucket))
            last_at_cut = issue if at_cut else last_at_cut
            with graph.inserting_before(iv.first):
                src = add_call(graph, C.collective_wait, (comm, issue))
            _tag(issue, iv.first, iv.bucket)
            _tag(src, iv.first, iv.bucket)
            waits.append(src)
        for slot in lay.slots:
            if slot.name in iv.params:
                args = (src, slot.offset, slot.numel, slot.shape)
                with graph.inserting_before(iv.first):
                    iv.unpacked[slot.name] = _tag(add_call(graph, unpack_param, args), iv.first, iv.bucket)
                # what it holds (the compiled regions of micscompile.runtime.codegen read shapes from "val")
                iv.unpacked[slot.name].meta["val"] = torch.empty(
                    slot.shape, dtype=lay.gather_dtype if gathers else lay.dtype, device="meta")
        if gathers:
            if iv.last.op == "output":  # a view of the gathered bucket would leave the graph (sent on, freed)
                raise PlanError(f"a value computed from the parameters {sorted(iv.params)} alone leaves the graph "
                                "(a pipeline chunk would send it); each chunk that reads it must compute it from "
                                "parameters it holds: a micscompile bug, please report it")
            with graph.inserting_after(iv.last):
                rel = add_call(graph, C.release, (comm, iv.bucket, *iv.unpacked.values()))
            _tag(rel, iv.last, iv.bucket)
    for j in range(carried):  # the next micro-step's gather j, where gather n + j would be issued
        at = waits[len(intervals) - distance + j]
        bucket = intervals[j].bucket
        with graph.inserting_after(at):
            _tag(add_call(graph, C.all_gather_next, (comm, bucket, shards[bucket]), _hierarchical(ctx, bucket)),
                 intervals[j].first, bucket)


def _rederive_views(graph: torch.fx.Graph, uses: Uses) -> None:
    """Each consumer reads the parameter views re-derived inside its interval from that interval's unpacked
    parameters (one copy per view and set of intervals), so nothing gathered in one interval is read in another."""
    derived, active, bucket_of, param_nodes = uses.derived, uses.active, uses.bucket_of, uses.param_nodes
    memo: dict[tuple, torch.fx.Node] = {}

    def rederive(node: torch.fx.Node, consumer: torch.fx.Node) -> torch.fx.Node:
        if node not in derived:  # (an input of a view that is not a parameter's: the comm of a tensor slice)
            return node
        ivs = tuple(sorted(id(active[(consumer, bucket_of[n])]) for n in derived[node]))
        key = (node, ivs)
        if key not in memo:
            if node in param_nodes:
                memo[key] = active[(consumer, bucket_of[param_nodes[node]])].unpacked[param_nodes[node]]
            else:
                with graph.inserting_before(consumer):
                    memo[key] = _tag(copy_node(graph, node, lambda a: rederive(a, consumer)), consumer)
        return memo[key]

    for c in uses.consumers:
        for i in [i for i in c.all_input_nodes if i in derived]:
            c.replace_input_with(i, rederive(i, c))


def _insert_reductions(graph: torch.fx.Graph, ctx: PassContext, comm: torch.fx.Node,
                       shards: list[torch.fx.Node]) -> None:
    """After each bucket's last gradient, its reduction (a reduce-scatter over the partition group, an all-reduce
    over all ranks with ``grad_sync="every_step"``, at p = 1 a local accumulation), waited just before the next
    bucket's is issued (the last before the output), then added into the bucket's accumulator and, where the plan
    syncs in two hops over replicas, its second hop started; the graph then outputs the loss (and a pipeline
    chunk's sends) alone."""
    tg, layouts = ctx.graph, ctx.layouts
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    loss, *rest = output.args[0]
    grads, extra = rest[: len(tg.trainable)], rest[len(tg.trainable):]  # extra: a pipeline chunk's sends
    grad_of = dict(zip(tg.trainable, grads))
    order = {n: i for i, n in enumerate(graph.nodes)}
    reduce_fn = C.all_reduce_issue if ctx.plan.plan.grad_sync == "every_step" else C.reduce_scatter_issue
    if ctx.plan.partition_size == 1 and reduce_fn is C.reduce_scatter_issue:
        reduce_fn = C.accumulate_local
    hop = ctx.plan.second_hop_in_backward
    jobs = []
    for lay in layouts:
        gs = [grad_of.get(s.name) for s in lay.slots]
        producers = [g for g in gs if isinstance(g, torch.fx.Node)]
        if not producers:
            continue  # nothing in this bucket gets a gradient: nothing to reduce
        at = max(producers, key=order.__getitem__)
        jobs.append((order[at], lay.index, at, gs))
    jobs.sort(key=lambda j: (j[0], j[1]))

    def reduced(b: int, result: torch.fx.Node) -> None:
        """The bucket's reduced shard is ``result``: added into its accumulator there and then, on the
        last micro-step (a pipeline chunk's last backward), its second hop started."""
        with graph.inserting_after(result):
            last = result
            if result.target is not C.accumulate_local:
                last = _tag(add_call(graph, C.accumulate, (comm, b, result)), result, b)
            if hop:
                with graph.inserting_after(last):
                    _tag(add_call(graph, C.second_hop, (comm, b, ctx.plan.plan.reduce_dtype)), result, b)

    anchor, pending = None, None
    for _, b, at, gs in jobs:
        if anchor is not None and order.get(anchor, -1) >= order[at]:
            at = anchor
        with graph.inserting_after(at):
            kwargs = _hierarchical(ctx, b) if reduce_fn is C.reduce_scatter_issue else {}
            issue = _tag(add_call(graph, reduce_fn, (comm, b, shards[b], *gs), kwargs), at, b)
        anchor = issue
        order[issue] = order[at]
        if reduce_fn is C.accumulate_local:
            reduced(b, issue)
            continue
        if pending is not None:
            with graph.inserting_before(issue):
                reduced(pending[0], _tag(add_call(graph, C.collective_wait, (comm, pending[1])), at, pending[0]))
        pending = (b, issue)
    if pending is not None:
        with graph.inserting_before(output):
            reduced(pending[0], _tag(add_call(graph, C.collective_wait, (comm, pending[1])), output, pending[0]))
    output.args = ((loss, *extra),)


def _drop_full_parameters(graph: torch.fx.Graph, uses: Uses) -> None:
    """The full-parameter placeholders and what only they fed go; a parameter still read is a bug."""
    for node in reversed(list(graph.nodes)):
        if node in uses.derived and not node.users:
            graph.erase_node(node)
    alive = set(graph.nodes)  # (membership in graph.nodes is a linear scan)
    left = [name for n, name in uses.param_nodes.items() if n in alive]
    if left:
        raise InternalError(f"insert_collectives: parameters still read outside any interval: {left}")
