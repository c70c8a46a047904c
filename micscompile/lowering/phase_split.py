"""Split one chunk's (rewritten) training graph into a forward and a backward graph.

A pipeline runs a chunk's forward and backward of one micro-batch at different
times, with other micro-batches in between (1F1B), so they must be two callables.
The cut is the first backward node: the graph lists all forward work first (the
trace's order; the MiCS rewrite keeps it, and with ``PassContext.phase_split`` it
issues no backward gather before the cut). Values the backward reads from the
forward (saved activations) become extra forward outputs and backward inputs.

    forward:  (*placeholders)          -> (*forward outputs, *saved)
    backward: [*placeholders, *saved]  -> (*the other outputs)   (boxed: it empties the list)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from micscompile.core import collectives as C
from micscompile.core.program import REGION_BWD, ProgramError
from micscompile.trace import META_REGION


@dataclass(frozen=True)
class Phases:
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    """Boxed: call it with one list of its inputs, which it empties (saved values die at their last use)."""
    saved: int
    """How many saved values the forward returns after its own outputs."""


def placeholder_like(graph: torch.fx.Graph, like: torch.fx.Node, prefix: str = "") -> torch.fx.Node:
    """A placeholder named and annotated like ``like`` (a value that now arrives from outside)."""
    node = graph.placeholder(prefix + like.name)
    node.meta = dict(like.meta)
    return node


def flat_module(root: torch.nn.Module, graph: torch.fx.Graph, boxed: bool = False) -> torch.fx.GraphModule:
    """A GraphModule over ``graph`` called with flat positional arguments, like the trace's; ``boxed``:
    called with one list that it empties (FX's boxed convention, as AOTAutograd's compiled
    backward), so an input dies at its last use instead of when the call returns."""
    graph._codegen = torch.fx.graph._BoxedCodeGen() if boxed else torch.fx.graph.CodeGen()
    # its Python code is generated at the first call: a chunk that is only priced (mc.autotune) never is
    return _LazyGraphModule(root, graph)


def split_phases(gm: torch.fx.GraphModule, forward_outputs: list[int]) -> Phases:
    """``forward_outputs``: indices (into the output tuple) the forward returns; the rest are the
    backward's, in their order."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    body = [n for n in nodes if n.op in ("call_function", "get_attr")]
    cut = next((i for i, n in enumerate(body) if n.op == "call_function"
                and n.meta.get(META_REGION, REGION_BWD) == REGION_BWD), len(body))
    fwd, bwd = body[:cut], body[cut:]
    in_fwd = set(fwd)
    outs = list(output.args[0])
    bwd_outputs = [i for i in range(len(outs)) if i not in set(forward_outputs)]
    for i in forward_outputs:
        if isinstance(outs[i], torch.fx.Node) and outs[i] not in in_fwd and outs[i].op != "placeholder":
            raise ProgramError(f"forward output {i} ({outs[i].name}) is computed in backward")
    for n in bwd:
        if n.target is C.collective_wait and n.args[1] in in_fwd:
            raise ProgramError(f"{n.args[1].name} is issued in forward and waited in backward: a collective "
                               f"may not stay in flight between a chunk's forward and backward")
    saved = []
    seen: set = set()
    for user in [*bwd, *(outs[i] for i in bwd_outputs if isinstance(outs[i], torch.fx.Node))]:
        reads = user.all_input_nodes if user in bwd else [user]
        for v in reads:
            if v in in_fwd and v not in seen:
                seen.add(v)
                saved.append(v)

    fg = torch.fx.Graph()
    env_f = {p: placeholder_like(fg, p) for p in placeholders}
    for n in fwd:
        env_f[n] = fg.node_copy(n, env_f.__getitem__)
    fg.output(tuple(env_f.get(outs[i], outs[i]) if isinstance(outs[i], torch.fx.Node) else outs[i]
                    for i in forward_outputs) + tuple(env_f[v] for v in saved))

    bg = torch.fx.Graph()
    env_b = {p: placeholder_like(bg, p) for p in placeholders}
    env_b.update({v: placeholder_like(bg, v, "saved_") for v in saved})
    for n in bwd:
        env_b[n] = bg.node_copy(n, env_b.__getitem__)
    bg.output(tuple(env_b[outs[i]] if isinstance(outs[i], torch.fx.Node) else outs[i] for i in bwd_outputs))

    return Phases(flat_module(gm, fg), flat_module(gm, bg, boxed=True), len(saved))


def split_chunk(gm: torch.fx.GraphModule, n_send_act: int) -> Phases:
    """A chunk's rewritten graph split into its phases: its outputs are the loss, the ``n_send_act``
    activations it sends (the forward's) and the input gradients it sends back (the backward's); its
    gradients stay inside (``collectives.accumulate``)."""
    return split_phases(gm, list(range(1 + n_send_act)))
