"""tensor_split: Megatron-LM's tensor parallelism, found from the trace and applied to it.

Placements (R, S(d, k), P) are ``core.tensor_layout``'s. The analysis walks the joint graph, forward
and backward alike, in order, and gives every value a placement:

* a weight's placement is decided where a matmul first reads it: *column-parallel* (the dim that
  becomes the output's last dim split, the output S) where the matmul's other operand is replicated,
  *row-parallel* (the contraction dim split, the output P) where that operand is split along the
  contraction. A fused projection whose output a view or an unbind cuts into k parts (q|k|v) is split
  in k segments. An embedding's weight is split along the vocabulary. Every other parameter, and
  every buffer and batch input, is replicated;
* every op has a rule: its outputs' placements from its inputs', and the placements it needs of
  them. Where an input's placement is not what the op needs, a conversion joins the graph: P -> R an
  all-reduce over the tensor group, R -> S a local slice. Megatron's f and g are written nowhere:
  they are where the rules put the all-reduces (g after a row-parallel matmul in forward, f's
  conjugate where a column-parallel matmul's input gradient meets a layer norm in backward);
* the vocabulary-parallel embedding (a masked lookup, P) and cross entropy (a max, the target logit
  and a sum of exponentials all-reduced per token, no collective in backward but one sum) are rules
  of their own.

The rewrite emits the graph each tensor rank runs: local shapes (shape arguments of views, expands,
... divided where their dim is split), the conversions as ``core.collectives`` tensor ops whose
``comm`` argument ``insert_collectives`` binds. Every tensor rank runs the same graph; its rank enters
through ``tensor_shard_start`` alone. What no rule covers is refused before any collective, naming
the block, the op and the placements it met.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from micscompile.core import collectives as C
from micscompile.core.errors import InternalError
from micscompile.core.plan import PlanError
from micscompile.core.tensor_layout import P, Placement, R, S
from micscompile.trace import META_FQN, META_PLACEMENT, META_REGION, META_SHAPE, TrainGraph, add_call, source_line

aten = torch.ops.aten
MAX_RESEGMENTS = 4
"""How often one weight's segment count may be revised before the split gives up."""


class TensorSplitError(PlanError):
    """A graph the tensor-parallel split cannot place: the block, the op and the placements it met."""


@dataclass(frozen=True)
class _Undecided:
    """A value computed from one parameter alone (through ``chain``) whose placement is not decided yet."""

    param: str
    chain: tuple[tuple, ...] = ()
    """(op, args) from the parameter to this value: "t", ("transpose", d0, d1), ("permute", dims), "same"."""


class _Resegment(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, param: str, segments: int) -> None:
        super().__init__(param, segments)
        self.param, self.segments = param, segments


def _shape(node) -> tuple[int, ...]:
    """A tensor node's shape as recorded (a symbolic-batch trace's at the size ``at_batch`` evaluated it at)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return ()
    shape = node.meta.get(META_SHAPE)
    return tuple(shape) if shape is not None and len(shape) == val.dim() else tuple(val.shape)


def _ndim(node) -> int:
    return len(_shape(node))


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---- view algebra ------------------------------------------------------------------------------


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Contiguous groups of ``src`` dims and ``dst`` dims with equal products (a view maps each group
    to each); dims of size 1 join the group after them (or the last)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi <= pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                break
            if pi == pj and (i == len(src) or src[i] != 1) and (j == len(dst) or dst[j] != 1):
                break
        groups.append((gi, gj))
    return groups


def view_placement(src: tuple[int, ...], dst: tuple[int, ...], pl: Placement, tp: int) -> Placement | int:
    """Where a view from ``src`` to ``dst`` puts ``pl``'s split: the placement, or the segment count the
    input would need (an int) where the split cannot follow the view as it is."""
    for gi, gj in view_groups(src, dst):
        if pl.dim not in gi:
            continue
        outer = math.prod(src[d] for d in gi if d < pl.dim)
        k = outer * pl.segments  # the group as one dim: k segments, each cut into tp pieces
        for d in gj:
            n = dst[d]
            if n == 1:
                continue
            if n % k == 0 and (n // k) % tp == 0:
                return S(d, k)
            if k % n:
                break
            k //= n
        return _needed_segments(src, dst, gi, gj, pl, tp)
    raise InternalError("a dim outside every view group")


def _needed_segments(src, dst, gi, gj, pl: Placement, tp: int) -> int:
    """The segments the input's split would need for the view to keep it: the output dims before the
    first one that a whole tensor-rank piece can lie in."""
    k = 1
    for d in gj:
        if dst[d] % tp == 0 and dst[d] > 1 and k % pl.segments == 0 and k > 1:
            return k
        k *= dst[d]
    return 0


# ---- the analysis ------------------------------------------------------------------------------


@dataclass
class Analysis:
    """The placement of every value and of every parameter, for ``tp`` tensor ranks."""

    tp: int
    params: dict[str, Placement]
    values: dict[torch.fx.Node, object]
    """A Placement, or a tuple of them (an op of several outputs)."""
    needs: dict[torch.fx.Node, dict[torch.fx.Node, Placement]]
    """What each node needs of its inputs where it differs from what they have."""
    origin: dict[torch.fx.Node, str]
    split_means: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    """mean nodes over a split dim (a norm's statistics over a column-parallel output, OLMo 2's QK-norm): each
    rank's mean of its piece over tp, a partial sum that an all-reduce completes where it is read."""
    row_addmm: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    """addmm nodes whose product is partial: the rewrite all-reduces it (reduce-scatters it along the
    sequence, with sequence parallelism), then adds the bias."""
    sequence: tuple[int, int] | None = None
    """Sequence parallelism: the (batch, sequence) sizes of the tokens whose activations are split."""


class _Propagation:
    def __init__(self, tg: TrainGraph, tp: int, segments: dict[str, int], sequence: tuple[int, int] | None) -> None:
        self.tg, self.tp, self.segments, self.sequence = tg, tp, segments, sequence
        self.tokens: set[torch.fx.Node] = set()
        """Values split along the sequence (sequence parallelism), not along a weight's dim."""
        self.to_tokens: set[tuple[torch.fx.Node, torch.fx.Node]] = set()
        """(node, input): the input converted to its sequence split for the node."""
        self.params: dict[str, Placement] = {}
        self.values: dict[torch.fx.Node, object] = {}
        self.needs: dict[torch.fx.Node, dict[torch.fx.Node, Placement]] = {}
        self.origin: dict[torch.fx.Node, str] = {}
        self.row_addmm: set[torch.fx.Node] = set()
        self.split_means: set[torch.fx.Node] = set()
        self.converted: set[tuple[torch.fx.Node, Placement]] = set()
        """(value, placement) conversions some op already needs: free for the next one."""
        placeholders = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
        self.param_of = dict(zip(placeholders, tg.param_names))

    # ---- helpers ----
    def fail(self, node: torch.fx.Node, why: str, fix: str = "") -> TensorSplitError:
        """The refusal: the block, the op, its inputs' placements, the source line, and ``fix`` (the nearest
        working choice; by default the split weight it came from)."""
        ins = ", ".join(f"{a.name}: {self.show(a)}" for a in node.all_input_nodes)
        where = source_line(node)
        if not fix:
            param = next((self.origin[a] for a in node.all_input_nodes if a in self.origin), None)
            fix = (f"the split comes from {param} ({self.params.get(param)}); no rule carries it through this op: "
                   f"train it with tp=1" if param else "no rule carries a split through this op: train it with tp=1")
        return TensorSplitError(
            f"tensor parallelism (tp={self.tp}) cannot split block '{node.meta.get(META_FQN) or '<root>'}': "
            f"{node.target} ({node.name}) {why} (inputs {ins})" + (f" at {where}" if where else "") + f"; {fix}")

    def show(self, n) -> str:
        v = self.values.get(n)
        return "undecided" if isinstance(v, _Undecided) else str(v)

    def get(self, n) -> Placement:
        """``n``'s placement, deciding an undecided parameter as replicated."""
        v = self.values[n]
        if isinstance(v, _Undecided):
            self.decide(v.param, R)
            v = self.values[n] = self.replay(v)
        return v

    def decide(self, param: str, pl: Placement) -> None:
        have = self.params.get(param)
        if have is not None and have != pl:
            raise TensorSplitError(f"tensor parallelism: parameter {param} is read as {have} and as {pl}; "
                                   "a weight read by two matmuls must be split alike in both")
        self.params[param] = pl

    def replay(self, u: _Undecided) -> Placement:
        """The placement of ``u``'s value once its parameter is decided."""
        pl = self.params[u.param]
        for step in u.chain:
            pl = _move(pl, step)
        return pl

    def want(self, node: torch.fx.Node, inp: torch.fx.Node, pl: Placement) -> None:
        if self.get(inp) != pl:
            self.needs.setdefault(node, {})[inp] = pl
            self.converted.add((inp, pl))

    def token_split(self, node: torch.fx.Node) -> Placement | None:
        """Sequence parallelism: ``node``'s split along the sequence, for an activation of the tokens'
        (batch, sequence, ...) or flattened (batch * sequence, ...) shape; None otherwise."""
        if self.sequence is None:
            return None
        b, s = self.sequence
        shape = _shape(node)
        if len(shape) >= 3 and shape[:2] == (b, s):
            return S(1)
        if len(shape) == 2 and shape[0] == b * s:
            return S(0, b)
        return None

    def to_sequence(self, node: torch.fx.Node, inp: torch.fx.Node) -> Placement | None:
        """Convert a partial ``inp`` to its sequence split for ``node`` (a reduce-scatter where tensor
        parallelism all-reduces); None where it has no sequence split."""
        pl = self.token_split(inp)
        if pl is not None:
            self.want(node, inp, pl)
            self.to_tokens.add((node, inp))
        return pl

    def is_token(self, node: torch.fx.Node, inp: torch.fx.Node) -> bool:
        """Whether ``node`` reads ``inp`` split along the sequence."""
        return inp in self.tokens or (node, inp) in self.to_tokens

    def gather_tokens(self, node: torch.fx.Node, *inputs: torch.fx.Node) -> list[torch.fx.Node]:
        """Make each of ``inputs`` split along the sequence whole for ``node``: those it gathers."""
        done = []
        for x in inputs:
            if self.get(x).kind == "S" and self.is_token(node, x):
                self.want(node, x, R)
                done.append(x)
        return done

    def resegment_or_fail(self, node, inp, k: int, why: str, fix: str = ""):
        param = self.origin.get(inp)
        if param is not None and k > 1 and self.segments.get(param, 1) != k:
            raise _Resegment(param, k)
        raise self.fail(node, why, fix)

    # ---- the walk ----
    def run(self) -> Analysis:
        for node in self.tg.gm.graph.nodes:
            if node.op == "placeholder":
                name = self.param_of.get(node)
                self.values[node] = _Undecided(name) if name is not None else R
            elif node.op == "get_attr":
                self.values[node] = R
            elif node.op == "call_function":
                self.values[node] = self.rule(node)
                first = next((a for a in node.all_input_nodes if a in self.origin), None)
                if first is not None and _has_split(self.values[node]):
                    self.origin.setdefault(node, self.origin[first])
                if self.sequence is not None and _has_split(self.values[node]) and any(
                        (node, a) in self.to_tokens or a in self.tokens and a not in self.needs.get(node, {})
                        for a in node.all_input_nodes):  # (read split along the sequence)
                    self.tokens.add(node)
            elif node.op == "output":
                self.output(node)
        for name in self.tg.param_names:
            self.params.setdefault(name, R)  # (read by no matmul, or by nothing)
        values = {n: (self.replay(v) if isinstance(v, _Undecided) else v) for n, v in self.values.items()}
        return Analysis(self.tp, self.params, values, self.needs, self.origin, self.split_means, self.row_addmm,
                        self.sequence)

    def output(self, node: torch.fx.Node) -> None:
        loss, *grads = node.args[0]
        if isinstance(loss, torch.fx.Node):
            self.want(node, loss, R)
        for name, g in zip(self.tg.trainable, grads):
            if isinstance(g, torch.fx.Node):
                self.want(node, g, self.params.get(name, R))

    def rule(self, node: torch.fx.Node):
        if _draws(node):
            raise self.fail(node, "draws random numbers (dropout)", "each tensor rank would draw its own, also where "
                            "the value is replicated, and the replicas would part: set the model's dropout to 0, "
                            "or train it with tp=1")
        fn = _RULES.get(node.target)
        if fn is None:
            if node.target is operator.getitem:
                return self.values[node.args[0]][node.args[1]]
            if _pointwise(node):
                return _elementwise(self, node)
            ins = [self.get(a) for a in node.all_input_nodes]
            if all(p == R for p in ins):
                return _replicated(node)
            raise self.fail(node, "has no tensor-parallel rule")
        return fn(self, node)


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a seeded op, unless its dropout probability is 0 (attention)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return bool(p)


def _has_split(v) -> bool:
    if isinstance(v, Placement):
        return v.kind == "S"
    return isinstance(v, (tuple, list)) and any(_has_split(x) for x in v)


def _replicated(node: torch.fx.Node):
    val = node.meta.get("val")
    return tuple(R for _ in val) if isinstance(val, (tuple, list)) else R


def _move(pl: Placement, step) -> Placement:
    if pl.kind != "S" or step == "same":
        return pl
    if step == "t":
        return pl.moved(1 - pl.dim)
    if step[0] == "transpose":
        d0, d1 = step[1], step[2]
        return pl.moved(d1 if pl.dim == d0 else d0 if pl.dim == d1 else pl.dim)
    if step[0] == "permute":
        return pl.moved(list(step[1]).index(pl.dim))
    raise InternalError(step)


def _unmove(pl: Placement, chain) -> Placement:
    """The placement a parameter needs for ``chain`` to give ``pl``."""
    for step in reversed(chain):
        if pl.kind != "S" or step == "same":
            continue
        if step == "t":
            pl = pl.moved(1 - pl.dim)
        elif step[0] == "transpose":
            d0, d1 = step[1], step[2]
            pl = pl.moved(d1 if pl.dim == d0 else d0 if pl.dim == d1 else pl.dim)
        elif step[0] == "permute":
            pl = pl.moved(step[1][pl.dim])
    return pl


# ---- rules -------------------------------------------------------------------------------------

_RULES: dict[Callable, Callable[[_Propagation, torch.fx.Node], object]] = {}
_LINEAR = {aten.neg.default, aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default}
"""Pointwise ops linear in their one tensor input: a partial sum stays partial through them."""
_SUMS = {aten.add.Tensor, aten.sub.Tensor}


def _registrar(table: dict):
    """A decorator factory: ``@register(*targets)`` enters the function in ``table`` under each target."""
    def register_for(*targets):
        def register(fn):
            for t in targets:
                table[t] = fn
            return fn
        return register
    return register_for


rule = _registrar(_RULES)


def _pointwise(node: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) or node.target in _LINEAR or node.target in (
        aten.gelu_backward.default, aten.tanh_backward.default, aten.threshold_backward.default,
        aten.silu_backward.default, aten.sigmoid_backward.default, aten.ones_like.default, aten.zeros_like.default,
        aten.full_like.default, aten.empty_like.default)


def _elementwise(g: _Propagation, node: torch.fx.Node):
    """Pointwise ops with broadcasting (dims aligned from the right)."""
    out_nd = _ndim(node)
    tensors = [a for a in node.all_input_nodes if _ndim(a) > 0 or g.get(a).kind != "R"]
    pls = {a: g.get(a) for a in tensors}
    if any(isinstance(v, _Undecided) for v in pls.values()):
        raise InternalError("undecided after get")
    # a param-derived pass-through (clone, detach, a cast) of an undecided parameter stays undecided
    for a, p in pls.items():  # a partial value another op already needs all-reduced: take that (free)
        if p.kind == "P" and (a, R) in g.converted:
            g.want(node, a, R)
            pls[a] = R
        elif p.kind == "P" and (a, g.token_split(a)) in g.converted:  # (or reduce-scattered)
            pls[a] = g.to_sequence(node, a)
    partial = [a for a, p in pls.items() if p.kind == "P"]
    weight_split = any(p.kind == "S" and not g.is_token(node, a) for a, p in pls.items())
    if partial and g.sequence is not None and not weight_split and not _linear(node, tensors, partial):
        for a in partial:  # sequence parallelism: the partial value reduce-scattered along the sequence
            pls[a] = g.to_sequence(node, a) or P
    split = [(a, p) for a, p in pls.items() if p.kind == "S"]
    partial = [a for a, p in pls.items() if p.kind == "P"]
    if split:  # the largest split input keeps its split; the others follow it
        a0, p0 = max(split, key=lambda ap: math.prod(_shape(ap[0])))
        dim = p0.dim + out_nd - _ndim(a0)  # the output dim it is
        for a in tensors:
            ad = dim - (out_nd - _ndim(a))
            if ad < 0 or _shape(a)[ad] == 1:
                if pls[a] != R:
                    g.want(node, a, R)
                continue  # broadcast along the split dim: every rank reads it whole
            target = S(ad, p0.segments)
            if pls[a] != target:
                g.want(node, a, target)
        return S(dim, p0.segments)
    if partial:
        if _linear(node, tensors, partial):
            return P
        for a in partial:
            g.want(node, a, R)
    return R


def _linear(node: torch.fx.Node, tensors: list, partial: list) -> bool:
    """Whether a pointwise op of partial values ``partial`` (among ``tensors``) gives a partial value."""
    return (node.target in _LINEAR and len(tensors) == 1
            or node.target is aten.mul.Tensor and len(partial) == 1  # P * R
            or node.target is aten.div.Tensor and partial == [node.args[0]]  # P / R
            or node.target in _SUMS and all(a in partial for a in node.args[:2]))  # P + P (not P + a constant)


@rule(aten.t.default, aten.transpose.int, aten.permute.default)
def _transpose(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    step = "t" if node.target is aten.t.default else (
        ("transpose", _dim(node.args[1], _ndim(x)), _dim(node.args[2], _ndim(x)))
        if node.target is aten.transpose.int else ("permute", tuple(_dim(d, _ndim(x)) for d in node.args[1])))
    v = g.values[x]
    if isinstance(v, _Undecided):
        return _Undecided(v.param, (*v.chain, step))
    return _move(v, step)


@rule(aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default)
def _same(g: _Propagation, node: torch.fx.Node):
    v = g.values[node.args[0]]
    if isinstance(v, _Undecided):
        return _Undecided(v.param, (*v.chain, "same"))
    return v


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    if pl.kind != "S":
        return pl
    src, dst = _shape(x), _shape(node)
    out = view_placement(src, dst, pl, g.tp)
    if isinstance(out, Placement) and len(dst) >= 4 and out.dim == len(dst) - 1 and dst[-2] > 1 and any(
            len(dst) - 2 in gj and pl.dim in gi for gi, gj in view_groups(src, dst)):  # (…, heads, head_dim)
        raise g.fail(node, f"would split within the last dim of a view to {dst} (a head's {dst[-1]} features), not "
                     f"the {dst[-2]} before it", _divide(dst[-2], g.tp, f"{dst[-2]} heads (or K/V heads)"))
    if isinstance(out, int):
        group = next(gj for gi, gj in view_groups(src, dst) if pl.dim in gi)
        first = next((dst[d] for d in group if dst[d] > 1), 1)
        fix = _divide(src[pl.dim], g.tp, f"{src[pl.dim]} of its split dim (K/V heads, in attention: one is "
                      "multi-query attention)") if src[pl.dim] % g.tp else \
            _divide(first, g.tp, f"{first} of dim {group[0]} of the view") if first % g.tp else ""
        g.resegment_or_fail(node, x, out, f"cannot keep the split of dim {pl.dim} through a view from {src} to {dst}",
                            fix)
    return out


def _bounds(start: int | None, end: int | None, n: int) -> tuple[int, int]:
    """A slice's [start, end) on a dim of ``n``, as Python reads its bounds (None, negative, past the end)."""
    end = n if end is None or end > n else end + n if end < 0 else end
    return (0 if start is None else start + n if start < 0 else start), end


def _local_bounds(start: int | None, end: int | None, n: int, tp: int) -> tuple[int, int]:
    """A slice [start, end) of a dim of ``n`` that takes whole segments: the same segments of a rank's piece."""
    start, end = _bounds(start, end, n)
    return start // tp, end // tp


def _divide(n: int, tp: int, what: str) -> str:
    """The fix for a dim of ``n`` that ``tp`` does not divide: the tensor sizes that do."""
    valid = [t for t in (1, 2, 4, 8, 16, 32, 64) if n % t == 0 and t <= n]
    if valid == [1]:
        return f"tp must divide the {what}: only tp=1 does"
    return f"tp must divide the {what}: tp in {{{', '.join(map(str, valid))}}} splits it, or tp=1"


@rule(aten.expand.default)
def _expand(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    if pl.kind == "S":
        return pl.moved(pl.dim + _ndim(node) - _ndim(x))
    return pl


@rule(aten.unsqueeze.default)
def _unsqueeze(g: _Propagation, node: torch.fx.Node):
    pl = g.get(node.args[0])
    d = _dim(node.args[1], _ndim(node))
    return pl.moved(pl.dim + (d <= pl.dim)) if pl.kind == "S" else pl


@rule(aten.squeeze.dim)
def _squeeze(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    d = _dim(node.args[1], _ndim(x))
    if pl.kind == "S" and _shape(x)[d] == 1:
        return pl.moved(pl.dim - (d < pl.dim))
    return pl


@rule(aten.unbind.int)
def _unbind(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    d = _dim(node.args[1] if len(node.args) > 1 else 0, _ndim(x))
    n = _shape(x)[d]
    if pl.kind == "S":
        if pl.dim == d:
            g.resegment_or_fail(node, x, n * pl.segments, f"unbinds its split dim {d}")
        return tuple(pl.moved(pl.dim - (d < pl.dim)) for _ in range(n))
    return tuple(pl for _ in range(n))


@rule(aten.stack.default, aten.cat.default)
def _stack(g: _Propagation, node: torch.fx.Node):
    tensors = node.args[0]
    pls = [g.get(a) for a in tensors]
    ndim = _ndim(tensors[0])
    d = _dim(node.args[1] if len(node.args) > 1 else 0, ndim + (node.target is aten.stack.default))
    first = pls[0]
    if first.kind == "S":
        if node.target is aten.cat.default and first.dim == d:  # equal pieces, each split: a split in segments
            if any(p != first for p in pls) or len({_shape(a) for a in tensors}) > 1:
                raise g.fail(node, f"concatenates unequal pieces along its split dim {d}")
            return S(d, first.segments * len(tensors))
        for a, p in zip(tensors, pls):
            if p != first:
                g.want(node, a, first)
        return first.moved(first.dim + (node.target is aten.stack.default and d <= first.dim))
    if first.kind == "P" and all(p == P for p in pls):
        return P
    for a, p in zip(tensors, pls):
        if p != R:
            g.want(node, a, R)
    return R


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    d = _dim(node.args[2] if len(node.args) > 2 else 0, _ndim(x))
    n = len(node.meta["val"])
    if pl.kind == "S" and pl.dim == d:
        if pl.segments != n:
            g.resegment_or_fail(node, x, n, f"splits its split dim {d} in {n}")
        return tuple(S(d) for _ in range(n))
    return tuple(pl for _ in range(n))


@rule(aten.slice.Tensor, aten.select.int)
def _slice(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    d = _dim(node.args[1] if len(node.args) > 1 else 0, _ndim(x))
    if pl.kind == "S":
        if pl.dim == d and g.gather_tokens(node, x):  # (sequence parallelism: a slice of the sequence)
            return R
        segment = _one_segment(node, _shape(x)[d]) if node.target is aten.slice.Tensor and pl.dim == d else None
        parts = {_one_segment(u, _shape(x)[d]) for u in x.users if u.target is aten.slice.Tensor
                 and _dim(u.args[1] if len(u.args) > 1 else 0, _ndim(x)) == d}
        if segment is not None and parts == {segment}:  # a fused projection's part (q|k|v of one size): a segment
            if pl.segments == segment:
                return S(d)
            g.resegment_or_fail(node, x, segment, f"slices its split dim {d} in {segment}")
        if pl.dim == d:
            param = g.origin.get(x)
            raise g.fail(node, f"slices its split dim {d} (of {_shape(x)[d]})", (
                f"{param}'s output is cut by slices (a fused projection whose parts differ in size, such as q|k|v "
                "under grouped-query attention, or a slice of a split dim): not split; train it with tp=1"
                if param else "the slice needs the whole dim: train it with tp=1"))
        return pl.moved(pl.dim - (node.target is aten.select.int and d < pl.dim))
    return pl


def _one_segment(node: torch.fx.Node, n: int) -> int | None:
    """k where ``node`` (a slice, or its backward, of a dim of ``n``) takes whole one of k equal segments."""
    start, end, step = (list(node.args[2:]) + [0, None, 1][len(node.args) - 2:])[:3] if node.target is \
        aten.slice.Tensor else node.args[3:6]
    start, end = _bounds(start, end, n)
    length = end - start
    if step != 1 or length <= 0 or length == n or n % length or start % length:
        return None
    return n // length


@rule(aten.slice_backward.default)
def _slice_backward(g: _Propagation, node: torch.fx.Node):
    pl = g.get(node.args[0])
    d = _dim(node.args[2], len(node.args[1]))
    if pl.kind == "S" and pl.dim == d:
        if g.gather_tokens(node, node.args[0]):
            return R
        segment = _one_segment(node, node.args[1][d])
        if segment is not None and pl.segments == 1:  # (one segment's gradient placed in the whole)
            return S(d, segment)
        raise g.fail(node, "pads its split dim")
    return pl


@rule(aten.select_backward.default)
def _select_backward(g: _Propagation, node: torch.fx.Node):
    """The gradient of a select: ``grad`` placed in zeros of the input's shape, a dim inserted at ``dim``."""
    pl = g.get(node.args[0])
    d = _dim(node.args[2], len(node.args[1]))
    return pl.moved(pl.dim + (d <= pl.dim)) if pl.kind == "S" else pl


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim)
def _reduce(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    ndim = _ndim(x)
    dims = list(range(ndim)) if node.target is aten.sum.default or not node.args[1] else \
        [_dim(d, ndim) for d in node.args[1]]
    keep = node.target is not aten.sum.default and len(node.args) > 2 and node.args[2]
    if pl.kind == "S":
        if pl.dim in dims:  # each rank's sum (a mean: over the whole count) of its piece, P
            if node.target is aten.mean.dim:
                g.split_means.add(node)
            return P
        return pl if keep else pl.moved(pl.dim - sum(d < pl.dim for d in dims))
    return pl


def _matmul_weight(g: _Propagation, node, mat, other_pl: Placement, operand: int) -> Placement:
    """Decide an undecided weight ``mat`` (operand ``operand`` of a 2-D matmul, the other's
    placement ``other_pl``): column-parallel where the other is replicated, row-parallel where it is
    split along the contraction."""
    u = g.values[mat]
    out_dim, k_dim = (1, 0) if operand == 1 else (0, 1)  # b [k, n]: n is the output's; a [m, k]
    if other_pl.kind == "S" and other_pl.dim == (1 if operand == 1 else 0):
        want = S(k_dim, other_pl.segments)  # row-parallel
    elif other_pl == R:
        want = S(out_dim, g.segments.get(u.param, 1))  # column-parallel
        if _shape(mat)[out_dim] % (want.segments * g.tp):
            want = R
    else:
        want = R
    g.decide(u.param, _unmove(want, u.chain))
    g.values[mat] = pl = g.replay(u)
    if pl.kind == "S" and pl.dim == out_dim:
        g.origin[mat] = u.param
    return pl


@rule(aten.mm.default, aten.addmm.default)
def _mm(g: _Propagation, node: torch.fx.Node):
    a, b = node.args[-2:] if node.target is aten.mm.default else node.args[1:3]
    ua, ub = isinstance(g.values[a], _Undecided), isinstance(g.values[b], _Undecided)
    if ub and not ua:
        pa = g.get(a)
        if pa.kind == "P":  # all-reduce a partial input: the weight then splits column-parallel
            g.want(node, a, R)
            pa = R
        elif g.gather_tokens(node, a):  # (sequence parallelism: all-gather it along the sequence)
            pa = R
        pb = _matmul_weight(g, node, b, pa, 1)
    elif ua and not ub:
        pb = g.get(b)
        if pb.kind == "P":
            g.want(node, b, R)
            pb = R
        elif g.gather_tokens(node, b):
            pb = R
        pa = _matmul_weight(g, node, a, pb, 0)
    else:
        pa, pb = g.get(a), g.get(b)
    out = _mm_placement(g, node, a, b, pa, pb)
    if node.target is aten.addmm.default:
        bias = node.args[0]
        if isinstance(g.values[bias], _Undecided) and out.kind == "S":
            g.decide(g.values[bias].param, _unmove(S(_ndim(bias) - 1, out.segments), g.values[bias].chain))
            g.values[bias] = g.replay(g.values[bias])
        pbias = g.get(bias)
        if out.kind == "P":
            g.row_addmm.add(node)
            if pbias != R:
                g.want(node, bias, R)
            # the rewrite all-reduces the product (reduce-scatters it along the sequence), then adds the bias
            # (Megatron's row-parallel bias)
            seq = g.token_split(node)
            if seq is not None:
                g.tokens.add(node)
                if _ndim(bias) == 2 and _shape(bias)[0] > 1:  # (a bias per token: this rank's tokens)
                    g.want(node, bias, seq)
                return seq
            return R
        if out.kind == "S" and pbias.kind != "S" and _shape(bias) and _shape(bias)[-1] != 1:
            g.want(node, bias, S(_ndim(bias) - 1, out.segments))
    return out


def _mm_placement(g: _Propagation, node, a, b, pa: Placement, pb: Placement) -> Placement:
    if pa == R and pb == R:
        return R
    if pa == R and pb.kind == "S" and pb.dim == 1:
        return S(1, pb.segments)
    if g.sequence is not None and (pa.kind == "S" and pb.kind == "S" or pa.kind == "P" or pb.kind == "P"):
        gathered = g.gather_tokens(node, *(x for x, p in ((a, pa), (b, pb)) if p.kind == "S"))
        if gathered:  # sequence parallelism: an operand split along the sequence meets a split weight: gathered
            return _mm_placement(g, node, a, b, R if a in gathered else pa, R if b in gathered else pb)
    if pa.kind == "S" and pa.dim == 0 and pb == R:
        return S(0, pa.segments)
    if pa.kind == "S" and pa.dim == 1 and pb.kind == "S" and pb.dim == 0 and pa.segments == pb.segments:
        return P
    if pa.kind == "P" and pb == R or pa == R and pb.kind == "P":
        return P
    if pa.kind == "S" and pa.dim == 1 and pb == R:
        g.want(node, b, S(0, pa.segments))
        return P
    if pa == R and pb.kind == "S" and pb.dim == 0:
        g.want(node, a, S(1, pb.segments))
        return P
    if pa.kind == "P" or pb.kind == "P":  # a partial sum read by a matmul with a split operand: summed first
        for x, p in ((a, pa), (b, pb)):  # (the forward's conversion where it made one: free)
            if p.kind == "P":
                g.want(node, x, R)
        return _mm_placement(g, node, a, b, R if pa.kind == "P" else pa, R if pb.kind == "P" else pb)
    raise g.fail(node, f"multiplies {pa} by {pb}")


@rule(aten.bmm.default)
def _bmm(g: _Propagation, node: torch.fx.Node):
    """A batch of matmuls: split along the batch (heads) dim, or a matmul's rule over the other two."""
    return _bmm_placement(g, node, *node.args)


def _bmm_placement(g: _Propagation, node: torch.fx.Node, a, b) -> Placement:
    pa, pb = g.get(a), g.get(b)
    if pa.kind == "S" and pa.dim == 0 or pb.kind == "S" and pb.dim == 0:
        first = pa if pa.kind == "S" and pa.dim == 0 else pb
        for x, p in ((a, pa), (b, pb)):
            if p != first:
                g.want(node, x, first)
        return first
    out = _mm_placement(g, node, a, b, _drop_batch(pa), _drop_batch(pb))
    return out.moved(out.dim + 1) if out.kind == "S" else out


@rule(aten.baddbmm.default)
def _baddbmm(g: _Propagation, node: torch.fx.Node):
    """beta * input + alpha * bmm(b1, b2) (Bloom's ALiBi scores): the bmm's rule; the input added to each
    rank's piece as the product is placed."""
    bias, a, b = node.args[:3]
    out = _bmm_placement(g, node, a, b)
    if out.kind == "P":
        raise g.fail(node, "adds its input to a partial product (a contraction over a split dim)")
    pbias = g.get(bias)
    if out.kind == "S":
        ad = out.dim - (_ndim(node) - _ndim(bias))
        want = R if ad < 0 or _shape(bias)[ad] == 1 else S(ad, out.segments)
        if pbias != want:
            g.want(node, bias, want)
    elif pbias != R:
        g.want(node, bias, R)
    return out


def _drop_batch(pl: Placement) -> Placement:
    return pl.moved(pl.dim - 1) if pl.kind == "S" else pl


@rule(aten.native_layer_norm.default)
def _layer_norm(g: _Propagation, node: torch.fx.Node):
    x, shape = node.args[0], node.args[1]
    pl = g.get(x)
    first_norm = _ndim(x) - len(shape)
    for w in node.args[2:4]:
        if isinstance(w, torch.fx.Node):
            g.get(w)
            g.want(node, w, R)
    if pl.kind == "S" and pl.dim >= first_norm:
        g.want(node, x, R)
        pl = R
    elif pl.kind == "P":
        seq = g.token_split(x)
        if seq is not None and seq.dim < first_norm:  # (sequence parallelism: reduce-scattered along the sequence)
            pl = g.to_sequence(node, x)
        else:
            g.want(node, x, R)
            pl = R
    return (pl, pl, pl)


@rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(g: _Propagation, node: torch.fx.Node):
    grad, x, shape = node.args[0], node.args[1], node.args[2]
    px = g.get(x)
    if px.kind == "P" and (x, g.token_split(x)) in g.converted:  # (as the forward normalised it: reduce-scattered)
        px = g.to_sequence(node, x)
    if px.kind == "P" or px.kind == "S" and px.dim >= _ndim(x) - len(shape):
        g.want(node, x, R)  # (as the forward normalised it: the same conversion, cached)
        px = R
    for n in (node.args[3], node.args[4], *node.args[5:7]):
        if isinstance(n, torch.fx.Node):
            g.get(n)
    if g.get(grad) != px:
        g.want(node, grad, px)
    wgrad = P if px.kind == "S" else R  # summed over the split (sequence) dims
    return (px, wgrad, wgrad)


@rule(aten._log_softmax.default, aten._softmax.default, aten._safe_softmax.default)
def _softmax(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    along = pl.kind == "S" and pl.dim == _dim(node.args[1], _ndim(x))
    if pl.kind == "P" or along and node.target is not aten._log_softmax.default:  # (no rewrite sums a split softmax)
        g.want(node, x, R)
        return R
    return pl  # (log_softmax S along the reduced dim: the vocabulary-parallel rewrite)


@rule(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
def _softmax_backward(g: _Propagation, node: torch.fx.Node):
    grad, out = node.args[0], node.args[1]
    po = g.get(out)
    if g.get(grad) != po:
        g.want(node, grad, po)
    return po


@rule(aten.nll_loss_forward.default)
def _nll_loss(g: _Propagation, node: torch.fx.Node):
    x = node.args[0]
    pl = g.get(x)
    if node.args[2] is not None:
        raise g.fail(node, "weighs classes (weight=): not split")
    if pl.kind == "P":
        g.want(node, x, R)
    if pl.kind == "S" and pl.dim != _ndim(x) - 1:
        raise g.fail(node, f"reads log-probabilities split along dim {pl.dim}")
    return (R, R)


@rule(aten.nll_loss_backward.default)
def _nll_loss_backward(g: _Propagation, node: torch.fx.Node):
    grad, x = node.args[0], node.args[1]
    g.want(node, grad, R) if g.get(grad) != R else None
    return g.get(x)


@rule(aten.embedding.default)
def _embedding(g: _Propagation, node: torch.fx.Node):
    w, idx = node.args[0], node.args[1]
    v = g.values[w]
    if isinstance(v, _Undecided) and not v.chain:
        vocab = _shape(w)[0]  # (a table tp does not divide is replicated, each rank looking up the whole: a
        g.decide(v.param, S(0) if vocab % g.tp == 0 else R)  # vocabulary was padded before, where it could be)
        g.values[w] = g.params[v.param]
    pw = g.get(w)
    if g.get(idx) != R:
        g.want(node, idx, R)
    if pw == S(0):
        return P
    if pw != R:
        raise g.fail(node, f"reads a table split as {pw}")
    return R


@rule(aten.embedding_dense_backward.default)
def _embedding_backward(g: _Propagation, node: torch.fx.Node):
    grad = node.args[0]
    if g.get(grad) != R:
        g.want(node, grad, R)
    table = next((n for n in node.graph.nodes if n.target is aten.embedding.default
                  and n.args[1] is node.args[1]), None)
    return g.get(table.args[0]) if table is not None else R


def _attention(g: _Propagation, node: torch.fx.Node):
    """Fused attention kernels: heads (dim 1 of q, k, v) are independent; every output of 2+ dims
    follows them. A mask broadcast along the heads (``(batch, 1, q, k)``, as Hugging Face builds it
    for SDPA) is read whole by every rank."""
    tensors = [a for a in node.all_input_nodes if _ndim(a) >= 3]
    pls = [g.get(a) for a in tensors]
    split = next((p for p in pls if p.kind == "S"), None)
    if split is None:
        for a, p in zip(tensors, pls):
            if p.kind == "P":
                g.want(node, a, R)
        return _replicated(node)
    if split.dim != 1:
        raise g.fail(node, f"splits attention along dim {split.dim}, not its heads")
    for a, p in zip(tensors, pls):
        if _shape(a)[1] == 1:  # broadcast along the heads: never sliced
            if p != R:
                g.want(node, a, R)
        elif p != split:
            g.want(node, a, split)
    val = node.meta["val"]
    # (the gradient of a mask broadcast along the heads, where a kernel returns one: summed over the heads, P)
    return tuple(R if not isinstance(v, torch.Tensor) or v.dim() < 2 else P if v.dim() >= 3 and v.shape[1] == 1
                 else split for v in val)


for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):
    if hasattr(aten, _name):
        _RULES[getattr(aten, _name).default] = _attention


def analyse(tg: TrainGraph, tp: int, sequence_parallel: bool = False) -> Analysis:
    """Every value's and parameter's placement on ``tp`` tensor ranks (pure: ``tg`` is not changed).
    A fused projection's segment count is found by trying: where a view or an unbind cannot keep a
    weight's split, the walk starts again with that weight in the segments it would need.
    ``sequence_parallel``: the activations between the split matmuls split along the sequence."""
    sequence = _sequence(tg, tp) if sequence_parallel else None
    segments: dict[str, int] = {}
    tries: dict[str, int] = {}
    while True:
        try:
            return _Propagation(tg, tp, segments, sequence).run()
        except _Resegment as r:
            tries[r.param] = tries.get(r.param, 0) + 1
            if tries[r.param] > MAX_RESEGMENTS:
                raise TensorSplitError(f"tensor parallelism: no segment count of {r.param} keeps its split "
                                       f"through the graph (tried {tries[r.param]})") from None
            segments[r.param] = r.segments
            suffix = _role(r.param)  # (a hint: the same weight of the other layers needs the same; checked)
            for name in tg.param_names:
                if _role(name) == suffix and name not in tries:
                    segments.setdefault(name, r.segments)


def _sequence(tg: TrainGraph, tp: int) -> tuple[int, int]:
    """(batch, sequence) of the tokens (``TrainGraph.token_shape``)."""
    shape = tg.token_shape
    if shape is None:
        raise TensorSplitError("sequence parallelism splits the activations of a sequence of tokens: the model "
                               "takes no (batch, sequence) token ids; use sequence_parallel=False")
    if shape[1] % tp:
        raise TensorSplitError(f"sequence parallelism (tp={tp}) splits the sequence of {shape[1]} tokens into tp "
                               f"pieces: give it a length divisible by {tp} (or sequence_parallel=False)")
    return shape


def _role(name: str) -> str:
    parts = name.split(".")
    return ".".join(p for p in parts if not p.isdigit())




# ---- the rewrite -------------------------------------------------------------------------------

_SIZED = {aten.select_backward.default: 1, aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
          aten.expand.default: 1,
          aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
          aten.zeros.default: 0, aten.empty.memory_format: 0, aten.full.default: 0}
"""Ops whose argument at this index is their output's shape: divided where the output is split."""


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
          aten.permute.default}


class _Rewrite:
    """The graph each tensor rank runs, from ``analysis`` of ``tg``."""

    def __init__(self, tg: TrainGraph, analysis: Analysis) -> None:
        self.tg, self.a, self.tp = tg, analysis, analysis.tp
        self.new = torch.fx.Graph()
        self.env: dict[torch.fx.Node, object] = {}
        self.conv: dict[tuple, torch.fx.Node] = {}
        self.source: dict[torch.fx.Node, torch.fx.Node] = {}
        """New node -> the node it stands for (its block and phase)."""

    def op(self, target, *args, like: torch.fx.Node, **kwargs) -> torch.fx.Node:
        n = add_call(self.new, target, args, kwargs)
        self.source[n] = like
        return n

    def convert(self, old: torch.fx.Node, want: Placement, like: torch.fx.Node) -> torch.fx.Node:
        have, x = self.a.values[old], self.env[old]
        if have == want:
            return x
        key = (old, want)
        if self.a.sequence is not None and have.kind == "S" and want == R:
            key = (old, want, like.meta.get(META_REGION))  # (gathered again in backward, as Megatron does)
        if key not in self.conv:
            if have.kind == "P" and want == R:
                out = self.op(C.tensor_all_reduce, None, x, like=old)
            elif have == R and want.kind == "S":
                out = self.op(C.tensor_slice, None, x, want.dim, want.segments, self.tp, like=like)
            elif have.kind == "S" and want == R and self._view_of_split(old):
                # a view of a split value: the value gathered (once, whichever view asks first), viewed whole
                out = self.op(old.target, self.convert(old.args[0], R, like), *old.args[1:], like=like, **old.kwargs)
            elif have.kind == "S" and want == R:
                out = self.op(C.tensor_all_gather, None, x, have.dim, have.segments, self.tp, like=like)
            elif have.kind == "P" and want.kind == "S" and (old, R) in self.conv:  # (all-reduced already: free)
                out = self.op(C.tensor_slice, None, self.conv[(old, R)], want.dim, want.segments, self.tp, like=like)
            elif have.kind == "P" and want.kind == "S":
                out = self.op(C.tensor_reduce_scatter, None, x, want.dim, want.segments, self.tp, like=old)
            elif have.kind == "S" and want.kind == "S":  # split otherwise (the sequence's for a weight's): whole first
                out = self.op(C.tensor_slice, None, self.convert(old, R, like), want.dim, want.segments, self.tp,
                              like=like)
            else:
                raise TensorSplitError(f"tensor parallelism: no conversion of {old.name} from {have} to {want}")
            self.conv[key] = out
        return self.conv[key]

    def _view_of_split(self, old: torch.fx.Node) -> bool:
        """Whether ``old`` is a view or transpose of a split value (the norm's output each linear views, the
        gradient a row-parallel matmul's backward reads as dY and dY^T: each gathered once)."""
        src = old.args[0] if old.target in _VIEWS and old.args else None
        pl = self.a.values.get(src) if isinstance(src, torch.fx.Node) else None
        return isinstance(pl, Placement) and pl.kind == "S"

    def args(self, node: torch.fx.Node):
        needs = self.a.needs.get(node, {})

        def get(a):
            return self.convert(a, needs[a], node) if a in needs else self.env[a]
        return torch.fx.node.map_arg(node.args, get), torch.fx.node.map_arg(node.kwargs, get)

    def run(self) -> torch.fx.Graph:
        for node in self.tg.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.new.placeholder(node.target)
            elif node.op == "get_attr":
                self.env[node] = self.new.get_attr(node.target)
            elif node.op == "output":
                args, _ = self.args(node)
                self.new.output(args[0])
            elif node.target is operator.getitem and isinstance(self.env[node.args[0]], tuple):
                self.env[node] = self.env[node.args[0]][node.args[1]]
            else:
                special = _SPECIAL.get(node.target)
                out = special(self, node) if special is not None else None
                if out is None:
                    args, kwargs = self.args(node)
                    out = self.op(node.target, *self._local_sizes(node, args), like=node, **kwargs)
                self.env[node] = out
        return self.new

    def _local_sizes(self, node: torch.fx.Node, args: tuple) -> tuple:
        if node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            x = node.args[0]
            pl, d = self.a.values[x], _dim(node.args[2] if len(node.args) > 2 else 0, _ndim(x))
            if pl.kind == "S" and pl.dim == d:  # pieces of the split dim: each a tensor rank's share
                sizes = args[1] // self.tp if isinstance(args[1], int) else [n // self.tp for n in args[1]]
                return (args[0], sizes, *args[2:])
            return args
        if node.target is aten.slice.Tensor and len(args) > 2 and _one_segment(
                node, _shape(node.args[0])[_dim(args[1], _ndim(node))]):
            pl = self.a.values[node.args[0]]
            if pl.kind == "S" and pl.dim == _dim(args[1], _ndim(node)) and pl.segments > 1:  # one segment: local bounds
                n = _shape(node.args[0])[pl.dim]
                return (args[0], args[1], *_local_bounds(args[2], args[3] if len(args) > 3 else None, n, self.tp),
                        *args[4:])
        i = _SIZED.get(node.target)
        pl = self.a.values.get(node)
        if i is None or not isinstance(pl, Placement) or pl.kind != "S":
            if node.target is aten.slice_backward.default:
                return self._slice_backward_sizes(node, args)
            return args
        size = list(args[i])
        if size[pl.dim] != -1:
            size[pl.dim] //= self.tp
        return (*args[:i], size, *args[i + 1:])

    def _slice_backward_sizes(self, node, args):
        pl = self.a.values[node]
        if pl.kind != "S":
            return args
        sizes = list(args[1])
        sizes[pl.dim] //= self.tp
        if pl.segments > 1 and _dim(args[2], len(sizes)) == pl.dim:  # (one segment: its local bounds)
            return (args[0], sizes, args[2], *_local_bounds(args[3], args[4], node.args[1][pl.dim], self.tp),
                    *args[5:])
        return (args[0], sizes, *args[2:])

    def vocab(self, node: torch.fx.Node, table: torch.fx.Node, ids, full_vocab: int):
        """(local ids clamped into this rank's piece of the vocabulary, whether each id is in it)."""
        size = full_vocab // self.tp
        start = self.op(C.tensor_shard_start, None, ids, size, like=node)
        local = self.op(aten.sub.Tensor, ids, start, like=node)
        inside = self.op(aten.bitwise_and.Tensor, self.op(aten.ge.Scalar, local, 0, like=node),
                         self.op(aten.lt.Scalar, local, size, like=node), like=node)
        safe = self.op(aten.where.self, inside, local, self.op(aten.zeros_like.default, local, like=node), like=node)
        return safe, inside


_SPECIAL: dict[Callable, Callable[[_Rewrite, torch.fx.Node], object]] = {}
_special = _registrar(_SPECIAL)


@_special(aten.addmm.default)
def _row_addmm(rw: _Rewrite, node: torch.fx.Node):
    """A row-parallel linear: the partial product all-reduced, then the bias added once."""
    if node.target is not aten.addmm.default or node not in rw.a.row_addmm:
        return None
    (bias, a, b), _ = rw.args(node)
    if len(node.args) > 3 or node.kwargs:
        raise TensorSplitError(f"tensor parallelism: {node.name} scales its addmm (beta, alpha)")
    product = rw.op(aten.mm.default, a, b, like=node)
    out = rw.a.values[node]
    summed = rw.op(C.tensor_all_reduce, None, product, like=node) if out == R else \
        rw.op(C.tensor_reduce_scatter, None, product, out.dim, out.segments, rw.tp, like=node)
    return rw.op(aten.add.Tensor, summed, bias, like=node)


@_special(aten.mean.dim)
def _split_mean(rw: _Rewrite, node: torch.fx.Node):
    """A mean over a split dim: this rank's mean over tp, so that the all-reduce of the pieces is the mean."""
    if node not in rw.a.split_means:
        return None
    args, kwargs = rw.args(node)
    return rw.op(aten.div.Tensor, rw.op(aten.mean.dim, *args, like=node, **kwargs), rw.tp, like=node)


@_special(aten.embedding.default)
def _vocab_embedding(rw: _Rewrite, node: torch.fx.Node):
    """Megatron's VocabParallelEmbedding: ids outside this rank's rows look up row 0, then read zero."""
    table = node.args[0]
    if rw.a.values[table] != S(0):
        return None
    (w, ids, *rest), _ = rw.args(node)  # (a padding_idx changes the backward alone: there)
    safe, inside = rw.vocab(node, table, ids, _shape(table)[0])
    rows = rw.op(aten.embedding.default, w, safe, like=node)
    keep = rw.op(aten.unsqueeze.default, inside, -1, like=node)
    return rw.op(aten.mul.Tensor, rows, rw.op(aten._to_copy.default, keep, dtype=_dtype(node), like=node), like=node)


@_special(aten.embedding_dense_backward.default)
def _vocab_embedding_backward(rw: _Rewrite, node: torch.fx.Node):
    """The rows of this rank's piece only: other ids' gradients zeroed, then added into row 0."""
    pl = rw.a.values[node]
    if pl != S(0):
        return None
    (grad, ids, num, pad, scale), _ = rw.args(node)
    safe, inside = rw.vocab(node, None, ids, num)
    if pad is not None and pad >= 0:  # the padding row gets no gradient
        inside = rw.op(aten.bitwise_and.Tensor, inside, rw.op(aten.ne.Scalar, ids, pad, like=node), like=node)
    if scale:
        raise TensorSplitError(f"tensor parallelism: {node.name} scales gradients by frequency; not split")
    keep = rw.op(aten._to_copy.default, rw.op(aten.unsqueeze.default, inside, -1, like=node), dtype=_dtype(node),
                 like=node)
    masked = rw.op(aten.mul.Tensor, grad, keep, like=node)
    return rw.op(aten.embedding_dense_backward.default, masked, safe, num // rw.tp, -1, scale, like=node)


@_special(aten._log_softmax.default)
def _vocab_log_softmax(rw: _Rewrite, node: torch.fx.Node):
    """log_softmax along the split dim: the max and the sum of exponentials all-reduced (Megatron's
    vocab-parallel cross entropy, its first two all-reduces)."""
    x_old, dim = node.args[0], node.args[1]
    pl = rw.a.values[x_old]
    if pl.kind != "S" or pl.dim != _dim(dim, _ndim(x_old)):
        return None
    if node.args[2]:
        raise TensorSplitError(f"tensor parallelism: {node.name} casts half to float in log_softmax; not split yet")
    (x, *_), _ = rw.args(node)
    n = _shape(x_old)[_dim(dim, _ndim(x_old))]
    true = _padded_sizes(rw.tg).get(n, n)
    if true < n:  # a padded vocabulary: its zero logits masked to -inf (no probability, no gradient)
        x = _mask_padding(rw, node, x, _dim(dim, _ndim(x_old)), n // rw.tp, true)
    peak = rw.op(C.tensor_all_reduce, None, rw.op(aten.amax.default, x, [dim], True, like=node), "max", like=node)
    shifted = rw.op(aten.sub.Tensor, x, rw.op(aten.detach.default, peak, like=node), like=node)
    total = rw.op(aten.sum.dim_IntList, rw.op(aten.exp.default, shifted, like=node), [dim], True, like=node)
    total = rw.op(C.tensor_all_reduce, None, total, like=node)
    return rw.op(aten.sub.Tensor, shifted, rw.op(aten.log.default, total, like=node), like=node)


def _mask_padding(rw: _Rewrite, node: torch.fx.Node, x, dim: int, local: int, true: int):
    """``x`` (this rank's ``local`` columns of a vocabulary padded past ``true``) with the padding at -inf."""
    iota = rw.op(aten.arange.default, local, dtype=torch.long, device=torch.device("meta"), like=node)  # (moved by
    column = rw.op(aten.add.Tensor, iota, rw.op(C.tensor_shard_start, None, iota, local, like=node),  # retarget_device)
                   like=node)
    shape = [1] * _ndim(node)
    shape[dim] = local
    beyond = rw.op(aten.view.default, rw.op(aten.ge.Scalar, column, true, like=node), shape, like=node)
    return rw.op(aten.masked_fill.Scalar, x, beyond, float("-inf"), like=node)


@_special(aten._log_softmax_backward_data.default)
def _vocab_log_softmax_backward(rw: _Rewrite, node: torch.fx.Node):
    """grad - exp(out) * sum(grad) along the split dim: the sum all-reduced."""
    out_old, dim = node.args[1], node.args[2]
    pl = rw.a.values[out_old]
    if pl.kind != "S" or pl.dim != _dim(dim, _ndim(out_old)):
        return None
    (grad, out, *_), _ = rw.args(node)
    total = rw.op(C.tensor_all_reduce, None, rw.op(aten.sum.dim_IntList, grad, [dim], True, like=node), like=node)
    return rw.op(aten.sub.Tensor, grad, rw.op(aten.mul.Tensor, rw.op(aten.exp.default, out, like=node), total,
                                               like=node), like=node)


def _targets(rw: _Rewrite, node: torch.fx.Node, target, ignore: int, vocab: int):
    """(local target ids, whether each is this rank's and not ignored) of a vocab-parallel nll_loss."""
    safe, inside = rw.vocab(node, None, target, vocab)
    counted = rw.op(aten.ne.Scalar, target, ignore, like=node)
    return safe, rw.op(aten.bitwise_and.Tensor, inside, counted, like=node), counted


@_special(aten.nll_loss_forward.default)
def _vocab_nll_loss(rw: _Rewrite, node: torch.fx.Node):
    """The target's log-probability read where this rank holds it, all-reduced (the third all-reduce)."""
    x_old = node.args[0]
    pl = rw.a.values[x_old]
    if pl.kind != "S":
        return None
    (x, target, _, reduction, ignore), _ = rw.args(node)
    if _ndim(x_old) != 2:
        raise TensorSplitError(f"tensor parallelism: {node.name} reads {_ndim(x_old)}-D log-probabilities; "
                               "flatten them to (tokens, vocabulary)")
    safe, mine, counted = _targets(rw, node, target, ignore, _shape(x_old)[1])
    picked = rw.op(aten.squeeze.dim, rw.op(aten.gather.default, x, 1, rw.op(aten.unsqueeze.default, safe, 1,
                                                                           like=node), like=node), 1, like=node)
    dtype = _dtype(x_old)
    losses = rw.op(aten.neg.default, rw.op(aten.mul.Tensor, picked, rw.op(aten._to_copy.default, mine, dtype=dtype,
                                                                        like=node), like=node), like=node)
    count = rw.op(aten.sum.default, rw.op(aten._to_copy.default, counted, dtype=dtype, like=node), like=node)
    if reduction == 0:
        return (rw.op(C.tensor_all_reduce, None, losses, like=node), count)
    total = rw.op(C.tensor_all_reduce, None, rw.op(aten.sum.default, losses, like=node), like=node)
    return (rw.op(aten.div.Tensor, total, count, like=node) if reduction == 1 else total, count)


@_special(aten.nll_loss_backward.default)
def _vocab_nll_loss_backward(rw: _Rewrite, node: torch.fx.Node):
    """-grad (over the count, for a mean) at the target, on the rank that holds it."""
    x_old = node.args[1]
    if rw.a.values[x_old].kind != "S":
        return None
    (grad, x, target, _, reduction, ignore, total_weight), _ = rw.args(node)
    safe, mine, _ = _targets(rw, node, target, ignore, _shape(x_old)[1])
    scale = rw.op(aten.neg.default, grad, like=node)
    if reduction == 1:
        scale = rw.op(aten.div.Tensor, scale, total_weight, like=node)
    dtype = _dtype(x_old)
    values = rw.op(aten.mul.Tensor, rw.op(aten._to_copy.default, mine, dtype=dtype, like=node), scale, like=node)
    zeros = rw.op(aten.zeros_like.default, x, like=node)
    return rw.op(aten.scatter.src, zeros, 1, rw.op(aten.unsqueeze.default, safe, 1, like=node),
                 rw.op(aten.unsqueeze.default, values, 1, like=node), like=node)


def _dtype(node: torch.fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def local_shape(shape: tuple[int, ...], pl: Placement, tp: int) -> tuple[int, ...]:
    if pl.kind != "S":
        return tuple(shape)
    return tuple(n // tp if d == pl.dim else n for d, n in enumerate(shape))


def tensor_split(tg: TrainGraph, tp: int, sequence_parallel: bool = False) -> TrainGraph:
    """The graph each of ``tp`` tensor ranks runs (local parameter shapes, the tensor collectives),
    as a TrainGraph whose ``tensor_placements`` say how each parameter is split. ``sequence_parallel``:
    Megatron's sequence parallelism (``Plan.sequence_parallel``)."""
    if tg.tensor_parallel == tp and tg.sequence_parallel == sequence_parallel:
        return tg
    if tg.tensor_parallel != 1:
        raise TensorSplitError(f"a trace split for tp={tg.tensor_parallel} (sequence_parallel={tg.sequence_parallel}) "
                               f"cannot be split for tp={tp} (sequence_parallel={sequence_parallel})")
    if tg.batch_symbols:
        raise TensorSplitError("tensor parallelism splits a concrete trace: a symbolic-batch one at a size first "
                               "(trace.at_batch(b))")
    tg, analysis = _padded_analysis(tg, tp, sequence_parallel) or (tg, analyse(tg, tp, sequence_parallel))
    rw = _Rewrite(tg, analysis)
    graph = rw.run()
    gm = _LazyGraphModule(tg.gm, graph)  # (its Python code generated when first called: a priced split never is)
    _propagate_meta(gm, tg, analysis, rw.source)
    for old_node, new_node in rw.env.items():  # what each value is on a tensor rank (a pipeline's cut reads it)
        pl = analysis.values.get(old_node)
        if isinstance(new_node, torch.fx.Node) and isinstance(pl, Placement):
            new_node.meta[META_PLACEMENT] = pl
    for key, new_node in rw.conv.items():  # ((value, placement[, region]): its conversion)
        new_node.meta[META_PLACEMENT] = key[1]
    shapes = {n: torch.Size(local_shape(s, analysis.params[n], tp)) for n, s in tg.param_shapes.items()}
    placements = {n: S(p.dim, p.segments, tg.vocabulary_pads.get((n, p.dim), 0)) if p.kind == "S" else p  # (true shape)
                  for n, p in analysis.params.items() if p != R}
    return dataclasses.replace(tg, gm=gm, param_shapes=shapes, tensor_parallel=tp, sequence_parallel=sequence_parallel,
                               tensor_placements=placements)


def _padded_analysis(tg: TrainGraph, tp: int, sequence_parallel: bool) -> tuple[TrainGraph, Analysis] | None:
    """Megatron's padded vocabulary: ``tg`` with each vocabulary tp does not divide padded, and its analysis;
    None where there is none, or where the split fails or something but the masked log-softmax would read the
    padding (the unpadded analysis then replicates the table, or says why it cannot split)."""
    pads = _vocabulary_pads(tg, tp)
    if not pads:
        return None
    padded = _padded(tg, pads)
    try:
        analysis = analyse(padded, tp, sequence_parallel)
    except TensorSplitError:
        return None
    return None if _reads_padding(padded, analysis, set(pads.values())) else (padded, analysis)


def _vocabulary_pads(tg: TrainGraph, tp: int) -> dict[int, int]:
    """{V: V padded to a multiple of tp} for each vocabulary tp does not divide: the rows of an embedding
    table that are also the classes a log-softmax normalises over."""
    nodes = tg.gm.graph.nodes
    tables = {_shape(n.args[0])[0] for n in nodes if n.target is aten.embedding.default}
    classes = {_shape(n.args[0])[_dim(n.args[1], _ndim(n.args[0]))] for n in nodes
               if n.target is aten._log_softmax.default}
    pads = {v: -(-v // tp) * tp for v in tables & classes if v % tp}
    sizes = {d for n in nodes for d in _shape(n)}
    return {v: vp for v, vp in pads.items() if vp not in sizes}  # (a padded size must name the vocabulary alone)


def _padded(tg: TrainGraph, pads: dict[int, int]) -> TrainGraph:
    """``tg`` with every dim of a vocabulary's size padded (parameters, shape arguments, the embedding
    backward's row count), its values propagated again; the parameters' pads in ``vocabulary_pads``."""
    def grow(a):
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, int) for x in a):
            return type(a)(pads.get(x, x) for x in a)
        return a

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in tg.gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        new.args = tuple(grow(a) for a in new.args)
        if node.target is aten.embedding_dense_backward.default:
            new.args = (*new.args[:2], pads.get(new.args[2], new.args[2]), *new.args[3:])
        env[node] = new
    gm = torch.fx.GraphModule(tg.gm, graph)
    shapes = {n: torch.Size(pads.get(d, d) for d in s) for n, s in tg.param_shapes.items()}
    _MetaProp(gm).run(*_placeholder_values(tg, lambda name, shape: shapes[name] if name else shape))
    for n in gm.graph.nodes:
        if META_SHAPE in n.meta and isinstance(n.meta.get("val"), torch.Tensor):
            n.meta[META_SHAPE] = tuple(n.meta["val"].shape)
    vocabulary_pads = {(name, d): pads[n] - n for name, s in tg.param_shapes.items() for d, n in enumerate(s)
                       if n in pads}
    return dataclasses.replace(tg, gm=gm, param_shapes=shapes, vocabulary_pads=vocabulary_pads)


def _padded_sizes(tg: TrainGraph) -> dict[int, int]:
    """{a padded vocabulary's size: its true size} of a graph ``_padded`` made."""
    return {tg.param_shapes[name][d]: tg.param_shapes[name][d] - pad for (name, d), pad in tg.vocabulary_pads.items()}


def _reads_padding(tg: TrainGraph, a: Analysis, padded: set[int]) -> bool:
    """Whether any op would see a padded vocabulary's zeros as values: one that needs a value split along it
    whole or split otherwise (a gather would show them), or sums over it outside the masked log-softmax (a
    matmul's contraction over it reads the table's zero rows: safe)."""
    def on_padding(n) -> bool:
        pl = a.values.get(n)
        return isinstance(pl, Placement) and pl.kind == "S" and _shape(n)[pl.dim] in padded
    for needs in a.needs.values():
        if any(on_padding(x) and want != a.values[x] for x, want in needs.items()):
            return True
    return any(node.target in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default,
                               aten.logsumexp.default, aten._softmax.default)
               and on_padding(node.args[0]) for node in tg.gm.graph.nodes)


class _MetaProp(torch.fx.Interpreter):
    """Runs a graph on meta tensors, keeping each node's value as ``meta["val"]`` (what FakeTensorProp keeps, at
    half its cost: the split's shapes are concrete, nothing needs a fake tensor's shape environment). An op is run
    once per distinct call: its arguments' shapes, strides, dtypes and values (a model's repeated blocks make the
    same calls), the next such call given fresh tensors of the results' shapes, strides and dtypes (an op's meta
    result depends on nothing else; one that writes its arguments is always run)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.results: dict = {}

    def call_function(self, target, args, kwargs):
        key = _call_key(target, args, kwargs)
        if key is None:
            return super().call_function(target, args, kwargs)
        if key not in self.results:
            result = super().call_function(target, args, kwargs)
            self.results[key] = _result_template(result)
            return result
        return _from_template(self.results[key]) if self.results[key] is not None else \
            super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        val = torch.fx.node.map_aggregate(result, lambda o: o if isinstance(o, (torch.Tensor, int, float, bool)) else None)
        if val is not None:
            n.meta["val"] = val
        return result


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _call_key(target, args, kwargs):
    """What an op's meta result depends on (``_MetaProp``), hashable; None where it cannot be cached (an op that
    writes its arguments, an argument of another kind)."""
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return None

    def key(a):
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.stride(), a.dtype, a.storage_offset())
        if isinstance(a, (tuple, list)):
            parts = tuple(key(x) for x in a)
            return None if any(p is _NO for p in parts) else (type(a).__name__, parts)
        return (type(a).__name__, a) if isinstance(a, _PLAIN) else _NO

    out = key((args, tuple(sorted(kwargs.items()))))
    return None if out is _NO else (target, out)


_NO = object()


def _result_template(result):
    """``result`` with each tensor as (shape, stride, dtype); None where a tensor starts inside its storage or
    another kind of value is returned (not cached)."""
    if isinstance(result, torch.Tensor):
        return None if result.storage_offset() else ("T", tuple(result.shape), result.stride(), result.dtype)
    if isinstance(result, (tuple, list)):
        parts = [_result_template(r) for r in result]
        return None if any(p is None for p in parts) else (type(result), parts)
    return ("V", result) if isinstance(result, (int, float, bool, type(None))) else None


def _from_template(template):
    if template[0] == "T":
        return torch.empty_strided(template[1], template[2], dtype=template[3], device="meta")
    if template[0] == "V":
        return template[1]
    kind, parts = template
    return kind(_from_template(p) for p in parts)


def _placeholder_values(tg: TrainGraph, shape_of: Callable[[str | None, tuple], tuple]) -> list[torch.Tensor]:
    """A meta tensor per placeholder of ``tg`` in its dtype, shaped ``shape_of(its parameter's name, or None for a
    batch input or buffer; its recorded shape)`` (a symbolic-batch trace's at the size at_batch evaluated it at)."""
    nodes = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(nodes, tg.param_names))
    return [torch.empty(shape_of(names.get(n), tuple(n.meta.get(META_SHAPE) or n.meta["val"].shape)),
                        dtype=n.meta["val"].dtype, device="meta") for n in nodes]


def _propagate_meta(gm: torch.fx.GraphModule, tg: TrainGraph, analysis: Analysis, source: dict) -> None:
    """Every node's value (on meta, local shapes) and the trace's metadata of it (shape, bytes, FLOPs, block,
    phase), as ``mc.trace`` records them."""
    from micscompile.trace import tensor_meta

    old = [n for n in tg.gm.graph.nodes if n.op == "placeholder"]
    _MetaProp(gm).run(*_placeholder_values(tg, lambda name, shape: local_shape(
        shape, analysis.params.get(name, R) if name else R, analysis.tp)))
    for new_node, old_node in zip((n for n in gm.graph.nodes if n.op == "placeholder"), old):
        source[new_node] = old_node
    for n in gm.graph.nodes:
        src = source.get(n)
        if src is not None:
            n.meta[META_FQN] = src.meta.get(META_FQN, "")
            n.meta[META_REGION] = src.meta.get(META_REGION)
            if "seq_nr" in src.meta:
                n.meta["seq_nr"] = src.meta["seq_nr"]
        tensor_meta(n)


__all__ = ["Analysis", "TensorSplitError", "analyse", "local_shape", "tensor_split", "view_groups", "view_placement"]
