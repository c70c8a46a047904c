"""Split each backward into B (input gradients) and W (weight gradients), for zero-bubble pipelines.

A pipeline chunk's backward does two jobs: the gradient of the chunk's input, which the previous
stage waits for, and the gradients of its weights, which nothing waits for until the optimizer.
Zero-bubble schedules (``core.pipeline_schedule.zero_bubble``) run the first as B and defer the
second, W, into the pipeline's bubbles. Holding the whole backward graph, the compiler cuts it:

* B is every backward node the input gradients (the backward's graph outputs) are computed from:
  their ancestors inside the backward, the gathers of the weights they multiply by included;
* a ``release`` of gathered weights goes with B when nothing in W reads them (so they are not held
  through W), and so does every piece (``getitem``) of a multi-output op of B (a layer norm's backward
  gives the input gradient and its weight's): W reads tensors, never a tuple;
* W is the rest: the weight-gradient matmuls, what only they read, the accumulations into the
  gradient buckets, the buckets' reduce-scatters and their second hops. Nothing in B reads W.

The backward is reordered to B then W (each in the trace's order); the graph still runs as one, and
whoever needs the two phases (the Program's actions, the lifetimes, ``lowering.phase_split``) asks
``backward_phases`` for them on the graph it holds, rewritten further or not. What W reads from B and from the forward stays
alive until W: the memory plan (``memory.lifetimes``) and the pricing (``cost_model.pipeline``)
see it there. A collective is issued and waited for in one phase (checked).
"""

from __future__ import annotations

import operator

import torch.fx

from micscompile.core import collectives as C
from micscompile.core.program import REGION_BWD, ProgramError
from micscompile.passes.context import PassContext
from micscompile.trace import META_REGION


def _input_gradient_nodes(graph: torch.fx.Graph) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """(the backward's nodes in order, those of B)."""
    bwd = [n for n in graph.nodes if n.op == "call_function" and n.meta.get(META_REGION) == REGION_BWD]
    in_bwd = set(bwd)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    todo = [v for v in output.all_input_nodes if v in in_bwd]
    b: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in in_bwd and n not in b:
            b.add(n)
            todo.extend(n.all_input_nodes)
    for n in bwd:
        # gathered weights B alone read: released in B
        if n.target is C.release and n not in b and all(
                u is n or u in b or u not in in_bwd for v in n.all_input_nodes if v.op != "placeholder" for u in v.users):
            b.add(n)
        # a multi-output op's pieces taken in B (W reads tensors, never a tuple: Inductor's regions need it so)
        if n.target is operator.getitem and n.args[0] in b:
            b.add(n)
    return bwd, b


def backward_phases(graph: torch.fx.Graph) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(B's nodes, W's nodes), each in graph order; after ``weight_split_pass`` every B node comes before
    every W node (checked)."""
    bwd, b = _input_gradient_nodes(graph)
    first_w = next((i for i, n in enumerate(bwd) if n not in b), len(bwd))
    if any(n in b for n in bwd[first_w:]):
        raise ProgramError("the backward is not ordered B then W: run passes.weight_split first")
    return bwd[:first_w], bwd[first_w:]


def weight_split_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    bwd, b = _input_gradient_nodes(graph)
    w = [n for n in bwd if n not in b]
    for n in bwd:
        if n.target is C.collective_wait and (n in b) != (n.args[1] in b):
            raise ProgramError(f"{n.args[1].name} is issued in {'B' if n.args[1] in b else 'W'} and waited for in "
                               f"{'B' if n in b else 'W'}: a collective may not stay in flight between the two")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in w:
        output.prepend(n)
    return graph
