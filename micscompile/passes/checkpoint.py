"""checkpoint: activation checkpointing on the joint forward + backward graph.

Terms. A *segment* is ``Plan.checkpoint_every`` consecutive blocks (``TrainGraph.blocks``,
forward order; the loss is never checkpointed). A forward value of a segment is *kept*
(saved for backward as before) when a forward node outside the segment reads it (the
segment's outputs: the next segment's input, the checkpoint boundary) or, with
``checkpoint="selective"``, when a matmul-class op produced it, or, with ``checkpoint="attention"``
(Korthikanti et al.'s selective recomputation), unless it is one of the attention core's sequence x
sequence values (scores, masks, probabilities); every other forward value the backward reads is
*recomputed*.

Rewrite, per segment: the forward nodes needed to recompute those values from kept values,
parameters and inputs are copied, in forward order, right before the first backward node
that reads one of them, tagged backward (``META_RECOMPUTE``), and the backward reads the
copies. The copies read parameters in the segment's backward region, so
``insert_collectives`` serves them with the backward's gather (issued before the
recompute): parameters gathered for the recompute stay live into the backward instead of
being gathered a third time.

Invariants: the same ops on the same inputs, so the numbers are bitwise those of the
plan without checkpointing (random ops are refused: recomputing them would draw again;
so is an in-place op that would write a kept value a second time); forward nodes and
their order are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from micscompile.core.plan import PlanError
from micscompile.core.program import REGION_BWD
from micscompile.cost_model.flops import FLOP_RULES
from micscompile.cost_model.node_cost import mutates_first
from micscompile.passes.buckets import block_of
from micscompile.passes.context import PassContext
from micscompile.passes.offload import META_OFFLOAD
from micscompile.trace import LOSS_FQN, META_FQN, META_REGION, copy_node

META_RECOMPUTE = "mc_recompute"
"""True on the backward copy of a forward node (a recomputation)."""

aten = torch.ops.aten
RANDOM_OPS = {aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli_.float, aten.rand.default,
              aten.randn.default, aten.rand_like.default, aten.randn_like.default, aten.randint.low}


def segments(blocks: list[str], every: int) -> dict[str, int]:
    """Block -> its segment index (``every`` consecutive blocks per segment)."""
    return {b: i // every for i, b in enumerate(blocks)}


def _is_bwd(n: torch.fx.Node) -> bool:
    return n.meta.get(META_REGION) == REGION_BWD


def segment_members(graph: torch.fx.Graph, blocks: list[str], every: int) -> dict[int, list[torch.fx.Node]]:
    """Segment index -> its forward nodes, in graph order."""
    seg_of = segments(blocks, every)
    members: dict[int, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and not _is_bwd(n):
            fqn = n.meta.get(META_FQN, "")
            block = block_of(fqn, blocks)
            if fqn != LOSS_FQN and block in seg_of:
                members.setdefault(seg_of[block], []).append(n)
    return members


def checkpoint_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    plan = ctx.plan.plan
    if not plan.checkpoint:
        return graph
    members = segment_members(graph, ctx.graph.blocks, plan.checkpoint_every)
    position = {n: i for i, n in enumerate(graph.nodes)}  # the copies go between original nodes: their order holds
    keep = keep_rule(plan.checkpoint, ctx.graph)
    for seg in sorted(members):
        _recompute_segment(graph, members[seg], position, keep, plan.offload_activations)
    graph.lint()
    return graph


def keep_rule(checkpoint, tg) -> Callable[[torch.fx.Node], bool] | None:
    """Which forward values of a segment ``checkpoint`` keeps besides its outputs (None: none). "attention"
    keeps all but the (batch, heads, s, s) or (batch * heads, s, s) values of the token ids' sequence
    length s (a single head's (batch, s, s) looks like an activation of width s: kept)."""
    if checkpoint == "selective":
        return lambda v: v.target in FLOP_RULES
    if checkpoint == "attention":
        if tg.token_shape is None:
            raise PlanError("checkpoint='attention' recomputes the attention's sequence x sequence values: the model "
                            "takes no (batch, sequence) token ids; use checkpoint=True or 'selective'")
        batch, seq = tg.token_shape

        def outside_the_core(v: torch.fx.Node) -> bool:
            # (batch, heads, s, s) or (batch * heads, s, s); not a (batch, s, h) activation where h = s
            val = v.meta.get("val")
            return not (isinstance(val, torch.Tensor) and val.dim() >= 3 and tuple(val.shape[-2:]) == (seq, seq)
                        and tuple(val.shape[:-2]) != (batch,))
        return outside_the_core
    return None


def recomputed(forward: list[torch.fx.Node], keep: Callable[[torch.fx.Node], bool] | None) -> tuple[set, list, list]:
    """(the segment's outputs, the values its backward reads that are not kept, the forward nodes recomputed for
    them in forward order) of the segment of ``forward`` nodes under ``keep`` (``keep_rule``)."""
    inside = set(forward)
    outputs = {v for v in forward if any(u not in inside and not _is_bwd(u) and u.op != "output" for u in v.users)}
    kept = outputs | ({v for v in forward if keep(v)} if keep is not None else set())
    need = [v for v in forward if v not in kept and any(_is_bwd(u) for u in v.users)]
    recompute: set[torch.fx.Node] = set()
    stack = list(need)
    while stack:
        v = stack.pop()
        if v in recompute:
            continue
        recompute.add(v)
        stack += [x for x in v.all_input_nodes if x in inside and x not in kept]
    return outputs, need, [v for v in forward if v in recompute]


def _recompute_segment(
    graph: torch.fx.Graph, forward: list[torch.fx.Node], position: dict[torch.fx.Node, int],
    keep: Callable[[torch.fx.Node], bool] | None, offload: bool,
) -> None:
    outputs, need, order = recomputed(forward, keep)
    owned = set(order)
    if offload:  # the segment's outputs go to host memory between forward and backward (micscompile.passes.offload)
        for v in outputs:
            v.meta[META_OFFLOAD] = True
    if not need:
        return
    for v in order:
        if v.target in RANDOM_OPS:
            raise PlanError(f"checkpoint: {v.meta.get(META_FQN) or '<root>'} runs a random op ({v.target}); "
                            f"recomputing it would draw new numbers: turn checkpoint off for this model")
        if mutates_first(v) and v.args[0] not in owned:
            raise PlanError(f"checkpoint: {v.meta.get(META_FQN) or '<root>'} writes {v.args[0].name} in place "
                            f"({v.target}), a value the recomputation does not own")
    first = min((u for v in need for u in v.users if _is_bwd(u)), key=position.__getitem__)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(first):
        for v in order:
            copy = copy_node(graph, v, lambda x: env.get(x, x))
            copy.meta = {**v.meta, META_REGION: REGION_BWD, META_RECOMPUTE: True}
            env[v] = copy
    copies = set(env.values())
    for v in need:
        for u in list(v.users):
            if _is_bwd(u) and u not in copies:
                u.replace_input_with(v, env[v])
