"""Which pipeline chunks are alike, so that ``mc.autotune`` lowers and prices each shape once.

A transformer's repeated blocks trace to the same operations on the same shapes, so the
chunks of a pipeline cut (``lowering.pipeline_split``) repeat too: every middle chunk of three
blocks is the same graph but for names. A chunk is the units [a, b) of the forward chain; what
it computes and what crosses its two cuts follows from those units' operations and its
neighbours' (units a - 1 and b), as long as every edge between units joins neighbours. Its key
is then (signature of unit a - 1 or None for the first chunk, signatures of a .. b - 1,
signature of unit b or None for the last chunk): chunks with equal keys split into equal graphs.

An edge that skips units (a skip connection, the token embedding's gradient flowing from two
blocks on) makes the chunks it touches depend on more than their neighbours: they get no key
(None) unless the edge lies inside them. A parameter shared between units (tied input and
output embeddings) is held by each chunk that reads it, with its gradient summed at the
boundary: the chunks holding it only in part get a key only when they are first or last (their
extent is then in the key). A node outside every unit that reads a unit's value (whose chunk
depends on where the cuts go) turns keys off for the whole graph.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.fx

from micscompile.lowering.pipeline_split import grad_sum, node_block
from micscompile.trace import LOSS_FQN, META_DTYPE, META_REGION, META_SHAPE, TrainGraph


class ChunkKeys:
    """The keys of the chunks of any cut of ``tg`` along ``units`` (``lowering.pipeline_split.forward_units``)."""

    def __init__(self, tg: TrainGraph, units: Sequence[str]) -> None:
        nodes = list(tg.gm.graph.nodes)
        index = {u: i for i, u in enumerate(units)}
        last = len(units)  # the loss: a unit after the last one (always in the last chunk)
        sums = set()
        for g in nodes[-1].args[0][1:]:
            if isinstance(g, torch.fx.Node):
                sums.update(grad_sum(g)[1])
        unit: dict[torch.fx.Node, int | None] = {}
        for n in nodes:
            if n.op == "call_function" and n not in sums:
                b = node_block(n, tg.blocks)
                unit[n] = last if b == LOSS_FQN else index.get(b)
        members: list[list[torch.fx.Node]] = [[] for _ in units]
        for n, u in unit.items():
            if u is not None and u < last:
                members[u].append(n)
        self.local = {n: i for m in members for i, n in enumerate(m)}
        self.unit, self.units = unit, len(units)
        self.usable = True
        self.far: list[tuple[int, int]] = []
        params = set(nodes[: tg.num_params])
        readers: dict[torch.fx.Node, set[int]] = {}
        for n, u in unit.items():
            for i in n.all_input_nodes:
                k = unit.get(i)
                if u is None:
                    self.usable &= k is None  # an unplaced node reading a unit's value
                elif k is not None and abs(k - u) > 1:
                    self.far.append((min(k, u), max(k, u)))
                elif k is None:
                    for p in _placeholders_of(i, unit) & params:
                        readers.setdefault(p, set()).add(u)
        self.shared = [frozenset(us) for us in readers.values() if len(us) > 1]
        self._free: dict[torch.fx.Node, tuple] = {}
        self._numbers: dict[tuple, int] = {}
        self.signatures = [hash(tuple(self._describe(n, u) for n in m)) for u, m in enumerate(members)]

    def _arg(self, i: torch.fx.Node, u: int) -> tuple:
        k = self.unit.get(i)
        if k is not None and k < self.units:
            return "unit", k - u, self.local[i]
        if i.op == "placeholder":
            return "input", repr(i.meta.get(META_SHAPE)), repr(i.meta.get(META_DTYPE))
        if i not in self._free:  # computed from parameters, inputs or constants alone: recomputed by each reader
            what = (str(i.target), repr(i.meta.get(META_SHAPE)),
                    repr(torch.fx.node.map_arg((i.args, i.kwargs), lambda j: self._arg(j, u))))
            # (numbered, not nested: a chain of such nodes with shared inputs, a tensor-split loss, would repeat
            # each input's description once per path)
            self._free[i] = ("free", self._numbers.setdefault(what, len(self._numbers)))
        return self._free[i]

    def _describe(self, n: torch.fx.Node, u: int) -> tuple:
        return (str(n.target), n.meta.get(META_REGION), repr(n.meta.get(META_SHAPE)), repr(n.meta.get(META_DTYPE)),
                repr(torch.fx.node.map_arg((n.args, n.kwargs), lambda i: self._arg(i, u))))

    def key(self, a: int, b: int) -> Hashable | None:
        """The key of the chunk of units [a, b) (None: it may differ from chunks of equal key)."""
        if not self.usable:
            return None
        end = self.units + 1 if b == self.units else b  # the last chunk computes the loss
        for lo, hi in self.far:
            if not (a <= lo and hi < end) and not (hi < a or lo >= end):
                return None
        edge = a == 0 or b == self.units
        for us in self.shared:
            held = {u for u in us if a <= u < end}
            if held and held != us and not edge:
                return None
        sig = self.signatures
        return (sig[a - 1] if a > 0 else None, tuple(sig[a:b]), sig[b] if b < self.units else None)

    def of(self, starts: Sequence[int]) -> list[Hashable | None]:
        """The key of every chunk of the cut at ``starts``."""
        ends = (*starts[1:], self.units)
        return [self.key(a, b) for a, b in zip(starts, ends)]


def _placeholders_of(n: torch.fx.Node, unit: dict) -> set[torch.fx.Node]:
    """The placeholders ``n`` is computed from through nodes outside every unit (itself if one)."""
    out, todo, seen = set(), [n], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":
            out.add(x)
        elif unit.get(x) is None:
            todo.extend(x.all_input_nodes)
    return out
