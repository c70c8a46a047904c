"""Ops write their results into the arena: ``op(args)`` -> ``op.out(args, out=arena_out(...))``.

Runs after scheduling, on the graph ``mc.compile`` executes, when the step has an arena
(``micscompile.memory.arena``). An op qualifies when it returns one contiguous tensor, is not a
view or a collective, and its overload packet has an ``out`` overload whose other
arguments are exactly its own (so the same kernel runs: no numbers change). Before it the
pass inserts ``arena_out(comm, name, shape, dtype)``, which takes the op's planned buffer
from the arena; the op's result *is* that buffer (``lifetimes`` treats it as a view of
the ``arena_out`` node). Everything else (multi-output ops, ops without an ``out``
overload) still allocates for itself and is counted outside the arena
(``TrainStep.memory_stats``).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from micscompile.cost_model.node_cost import META_BYTES, _is_view
from micscompile.passes.context import PassContext

OUT_PREFIX = "out:"
"""Names of the arena buffers ops write into (this pass)."""


def arena_out(comm, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Graph op (this pass): the arena buffer an op writes its result into."""
    return comm.arena.take(name, math.prod(shape), dtype, tuple(shape))


def out_overload(node: torch.fx.Node):
    """The ``out`` overload that computes ``node`` into a given tensor, or None."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or _is_view(node):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_contiguous() or not node.meta.get(META_BYTES):
        return None
    out = getattr(op.overloadpacket, "out", None)
    if out is None or out is op:
        return None
    names = [a.name for a in out._schema.arguments]
    if names[-1:] != ["out"] or names[:-1] != [a.name for a in op._schema.arguments]:
        return None
    return out


def out_variants_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    """Every op with an ``out=`` overload writes into an ``arena_out`` buffer (the pass signature's
    ``ctx`` is not needed: the buffers are named from the nodes)."""
    comm = next(n for n in graph.nodes if n.op == "placeholder")
    for node in list(graph.nodes):
        out_op = out_overload(node)
        if out_op is None:
            continue
        val = node.meta["val"]
        with graph.inserting_before(node):
            buf = graph.call_function(arena_out, (comm, OUT_PREFIX + node.name, tuple(val.shape), val.dtype))
            buf.meta = dict(node.meta)
            new = graph.call_function(out_op, node.args, {**node.kwargs, "out": buf})
            new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    return graph
