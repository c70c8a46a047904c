"""``t(t(x))`` is ``x``: the runtime graph drops transposes of transposes.

A traced linear's backward computes its input gradient as ``mm(grad, t(t(w)))``: the forward's
``t(w)`` transposed back. Op by op each ``t`` is a dispatch on the host (no kernel), 34 per
micro-step of bench_peers' GPT (a tenth of its ops at p=1), and on a GPU a small model's step is
the host dispatching (docs/gpu.md). ``t(t(x))`` has ``x``'s shape and strides and shares its
storage, so its users read ``x`` itself; an inner ``t`` left without users goes too. Runs on the
graph the runtime executes, after lowering (it never changes the Program), unless Inductor
generates the compute (its kernels fold views themselves).
"""

from __future__ import annotations

import torch
import torch.fx

from micscompile.passes.context import PassContext

_T = torch.ops.aten.t.default


def _is_t(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is _T


def fold_transposes_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    for node in list(graph.nodes):
        if not (_is_t(node) and _is_t(node.args[0])):
            continue
        inner = node.args[0]
        node.replace_all_uses_with(inner.args[0])
        graph.erase_node(node)
        if not inner.users:
            graph.erase_node(inner)
    graph.lint()
    return graph
