"""Per-node work and activation liveness of a traced (or rewritten) graph.

Pure analyses over ``node.meta`` (shapes recorded at trace time):

* ``node_work``: matmul-class FLOPs (priced at matmul throughput), bytes moved by
  every other op (priced at memory bandwidth: inputs read + outputs written), and
  whether the node costs a dispatch at all (views do, placeholders do not).
* ``activation_bytes``: bytes of values alive after each node, where a view keeps
  its base alive and a value dies after its last use (what FX's generated code
  does). Gathered parameters and reduction buffers are not included: the
  simulator tracks those from the collectives that own them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from micscompile.cost_model.flops import _VIEW_OPS, FLOP_RULES

META_BYTES = "mc_bytes"
"""Bytes of all tensor outputs of a node (set by the tracer; the cost model reads it)."""
META_FLOPS = "mc_flops"
"""Estimated FLOPs of a node (cost_model.flops, set by the tracer)."""
META_TIME_S = "mc_time_s"
"""Measured seconds of one execution of the node (tune.profile), preferred to the roofline."""


@dataclass(frozen=True)
class NodeWork:
    matmul_flops: int = 0
    mem_bytes: int = 0
    ops: int = 0

    def __add__(self, other: NodeWork) -> NodeWork:
        return NodeWork(self.matmul_flops + other.matmul_flops, self.mem_bytes + other.mem_bytes, self.ops + other.ops)


def _is_view(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.target in _VIEW_OPS or name in ("getitem", "unpack_param")


def mutates_first(node: torch.fx.Node) -> bool:
    """An in-place op (``add_``, ``relu_``, ``copy_``): its result is its first argument, written."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and schema.returns[0].alias_info.is_write)


def is_shape_arithmetic(node: torch.fx.Node) -> bool:
    """A node computing a size, not a tensor (``sym_size``, ``mul`` of sizes): a symbolic-batch trace
    derives view sizes from the batch size with them; free in the cost model."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def node_work(node: torch.fx.Node) -> NodeWork:
    if node.op != "call_function" or is_shape_arithmetic(node):
        return NodeWork()
    if node.target in FLOP_RULES:  # FLOPs recorded at trace time (rewrites may have changed the inputs)
        return NodeWork(matmul_flops=node.meta.get(META_FLOPS, 0), ops=1)
    if _is_view(node):
        return NodeWork(ops=1)
    moved = node.meta.get(META_BYTES, 0) + sum(i.meta.get(META_BYTES, 0) for i in node.all_input_nodes)
    return NodeWork(mem_bytes=moved, ops=1)


def activation_bytes(graph: torch.fx.Graph, exclude: set[torch.fx.Node] = frozenset()) -> dict[torch.fx.Node, int]:
    """Bytes of live values right after each node (placeholders and ``exclude`` not counted)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        base = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        root[n] = root[base] if (_is_view(n) and base is not None) else n
    last_use: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for i in n.all_input_nodes:
            r = root[i]
            last_use[r] = max(last_use.get(r, -1), index[n])
    dies_at: dict[int, list[torch.fx.Node]] = {}
    for r, i in last_use.items():
        dies_at.setdefault(i, []).append(r)
    live, out = 0, {}
    counted: set[torch.fx.Node] = set()
    for i, n in enumerate(nodes):
        if root[n] is n and n.op == "call_function" and n not in exclude and n.users:
            live = live + n.meta.get(META_BYTES, 0)  # not +=: numpy arrays (mc.autotune) would alias
            counted.add(n)
        for r in dies_at.get(i, ()):
            if r in counted:
                live = live - r.meta.get(META_BYTES, 0)
                counted.discard(r)
        out[n] = live
    return out
