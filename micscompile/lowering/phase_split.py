"""Split one chunk's (rewritten) training graph into a forward and a backward graph.

A pipeline runs a chunk's forward and backward of one micro-batch at different
times, with other micro-batches in between (1F1B), so they must be two callables.
The cut is the first backward node: the graph lists all forward work first (the
trace's order; the MiCS rewrite keeps it, and with ``PassContext.phase_split`` it
issues no backward gather before the cut). Values the backward reads from the
forward (saved activations) become extra forward outputs and backward inputs.

    forward:  (*placeholders)          -> (*forward outputs, *saved)
    backward: [*placeholders, *saved]  -> (*the other outputs)   (boxed: it empties the list)

A zero-bubble schedule's chunk (``passes.weight_split``: its backward ordered B then W) is cut
once more, after B; W returns nothing (its work lands in the gradient accumulators):

    backward: [*placeholders, *saved]            -> (*the other outputs, *carried)
    weight:   [*placeholders, *saved, *carried]  -> ()                  (boxed)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from micscompile.core import collectives as C
from micscompile.core.program import REGION_BWD, ProgramError
from micscompile.passes.weight_split import backward_phases
from micscompile.trace import META_REGION, copy_node


@dataclass(frozen=True)
class Phases:
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    """Boxed: call it with one list of its inputs, which it empties (saved values die at their last use)."""
    saved: int
    """How many saved values the forward returns after its own outputs."""
    weight: torch.fx.GraphModule | None = None
    """A zero-bubble chunk's W (boxed), else None."""
    carried: int = 0
    """How many values B returns after its outputs for W."""


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


def split_phases(gm: torch.fx.GraphModule, forward_outputs: list[int], weight: bool = False) -> Phases:
    """``forward_outputs``: indices (into the output tuple) the forward returns; the rest are the
    backward's, in their order. ``weight``: cut the backward again into B and W (``weight_split``)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    body = [n for n in nodes if n.op in ("call_function", "get_attr")]
    cut = next((i for i, n in enumerate(body) if n.op == "call_function"
                and n.meta.get(META_REGION, REGION_BWD) == REGION_BWD), len(body))
    fwd, bwd = body[:cut], body[cut:]
    phases = [fwd, bwd]
    if weight:
        b, w = backward_phases(gm.graph)
        phases = [fwd, b, w]
    where = {n: i for i, phase in enumerate(phases) for n in phase}
    outs = list(output.args[0])
    bwd_outputs = [i for i in range(len(outs)) if i not in set(forward_outputs)]
    for k, indices in enumerate((forward_outputs, bwd_outputs)):
        for i in indices:
            if isinstance(outs[i], torch.fx.Node) and outs[i].op != "placeholder" and where[outs[i]] > k:
                raise ProgramError(f"{'forward' if k == 0 else 'backward'} output {i} ({outs[i].name}) is computed "
                                   f"in {'backward' if where[outs[i]] == 1 else 'W'}")
    for n in body:
        if n.target is C.collective_wait and n.args[1] in where and where[n.args[1]] != where[n]:
            raise ProgramError(f"{n.args[1].name} is issued in one phase and waited in a later one: a collective "
                               f"may not stay in flight between a chunk's forward and backward (or B and W)")
    # what each phase hands on: values it computes that a later phase (or a later phase's output) reads
    handed: list[list[torch.fx.Node]] = [[] for _ in phases]
    seen: set = set()
    readers = [(where[n], n.all_input_nodes) for n in body if where[n] > 0]
    readers += [(1, [outs[i]]) for i in bwd_outputs if isinstance(outs[i], torch.fx.Node)]
    for k, reads in readers:
        for v in reads:
            if v in where and where[v] < k and v not in seen:
                seen.add(v)
                handed[where[v]].append(v)

    def module(k: int, own_outputs: tuple, boxed: bool) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        env = {p: placeholder_like(g, p) for p in placeholders}
        for j in range(k):
            env.update({v: placeholder_like(g, v, "saved_" if j == 0 else "carried_") for v in handed[j]})
        for n in phases[k]:
            env[n] = copy_node(g, n, env.__getitem__)
        g.output(tuple(env.get(o, o) if isinstance(o, torch.fx.Node) else o for o in own_outputs)
                 + tuple(env[v] for v in handed[k]))
        return flat_module(gm, g, boxed=boxed)

    forward = module(0, tuple(outs[i] for i in forward_outputs), False)
    backward = module(1, tuple(outs[i] for i in bwd_outputs), True)
    if not weight:
        return Phases(forward, backward, len(handed[0]))
    return Phases(forward, backward, len(handed[0]), module(2, (), True), len(handed[1]))


def split_chunk(gm: torch.fx.GraphModule, n_send_act: int, weight: bool = False) -> Phases:
    """A chunk's rewritten graph split into its phases: its outputs are the loss, the ``n_send_act``
    activations it sends (the forward's) and the input gradients it sends back (the backward's); its
    gradients stay inside (``collectives.accumulate``). ``weight``: a zero-bubble chunk's B and W apart."""
    return split_phases(gm, list(range(1 + n_send_act)), weight)
