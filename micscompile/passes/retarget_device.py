"""retarget_device: factory ops traced on meta (masks, scalars) run on the rank's device.

Tracing happens on the meta device, so ops that create tensors (``ones``, ``arange``,
``scalar_tensor``, ``_to_copy``...) record ``device=meta``. This pass rewrites every
meta device argument to ``ctx.device``. No-op when the graph has none.
"""

from __future__ import annotations

import torch
import torch.fx

from micscompile.passes.context import PassContext

META = torch.device("meta")


def retarget_device_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    return retarget_device(graph, ctx.device)


def retarget_device(graph: torch.fx.Graph, device: torch.device) -> torch.fx.Graph:
    """Rewrite every ``device=meta`` argument in ``graph`` to ``device`` (in place)."""

    def fix(a):
        return device if isinstance(a, torch.device) and a == META else a

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_aggregate(node.args, fix), torch.fx.node.map_aggregate(node.kwargs, fix)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
    return graph
