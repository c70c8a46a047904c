"""context_split: context parallelism, applied to a trace of one context rank's tokens.

The c ranks of a context group each hold L = s / c consecutive tokens of every sample (rank r tokens [r L,
(r+1) L)); ``mc.compile`` traces the model on L tokens, so every token-wise op (projections, norms, MLPs, the
loss over the rank's tokens) is already the rank's. What couples tokens is rewritten, found from the graph:

* **positions**: an ``arange(L)`` (rotary angles, position ids) becomes the rank's global positions
  (``core.collectives.context_positions``); the first L rows sliced off a table that is not computed from the batch
  (learned positions) become the rank's rows (``context_slice``), and the slice's backward puts the gradient at
  those rows (``context_slice_backward``);
* **attention** (the fused kernel the trace records, forward and backward): Ulysses. An all-to-all turns q, k
  and v from the rank's tokens of every head into every token of h/c heads (``context_to_heads``), the kernel runs
  over the whole sequence (its causal mask is the whole sequence's), and another turns the output back
  (``context_to_tokens``); the backward the same way round (dO in; dQ, dK, dV out), reading the forward's
  head-split q, k, v, output and log-sum-exp;
* what would silently compute a wrong result is refused before any collective, naming it: attention written as
  matmuls and a softmax over the sequence, a causal mask built as a matrix (``tril``/``triu``), attention with a
  mask or dropout, a slice along the sequence of a value computed from the batch (a loss that shifts its labels),
  a cumulative sum along it, heads c does not divide.

The gradients are each rank's over its tokens; they are summed over the context ranks with the data-parallel
ones (the partition and replication groups run over both), so each rank's loss is the mean over its tokens, and
the mean of the ranks' means is the sequence's mean (equal token counts).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._pytree import tree_leaves

from micscompile.core import collectives as C
from micscompile.core.plan import PlanError
from micscompile.trace import META_FQN, META_SHAPE, TrainGraph, add_call, copy_graph, tensor_meta

aten = torch.ops.aten
@dataclass(frozen=True)
class Kernel:
    """Where a fused attention kernel and its backward take what the split reads or rewrites (q, k, v are the
    forward's first three arguments, dO, q, k, v the backward's first four; the output and the log-sum-exp are the
    forward's outputs 0 and 1)."""

    backward: object
    dropout: int
    causal: int
    mask: int | None
    """The attention mask's (or bias's) argument; None: the ``attn_mask`` keyword."""
    backward_out: int
    backward_lse: int
    backward_causal: int
    backward_mask: int | None
    backward_lengths: tuple[int, ...] = ()
    """The backward's arguments that are the sequence's length (the flash kernel's max_q, max_k)."""

    def mask_at(self, forward: bool) -> int | None:
        """The mask's argument of the forward (or of the backward); None: the ``attn_mask`` keyword."""
        return self.mask if forward else self.backward_mask

    def mask_of(self, node: torch.fx.Node, forward: bool = True):
        """The mask ``node`` (this kernel's forward, or its backward) is given, or None."""
        at = self.mask_at(forward)
        return node.kwargs.get("attn_mask") if at is None else (node.args[at] if len(node.args) > at else None)


KERNELS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: Kernel(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, dropout=3, causal=4, mask=None,
        backward_out=4, backward_lse=5, backward_causal=7, backward_mask=None),
    aten._scaled_dot_product_flash_attention.default: Kernel(
        aten._scaled_dot_product_flash_attention_backward.default, dropout=3, causal=4, mask=None,
        backward_out=4, backward_lse=5, backward_causal=11, backward_mask=None, backward_lengths=(8, 9)),
    aten._scaled_dot_product_efficient_attention.default: Kernel(
        aten._scaled_dot_product_efficient_attention_backward.default, dropout=5, causal=6, mask=3,
        backward_out=5, backward_lse=6, backward_causal=11, backward_mask=4),
}
"""The fused attention kernels the trace records (``trace._FusedAttention``: CPU flash, CUDA flash and
memory-efficient) that the split knows, by their forward."""
BACKWARDS = {k.backward: k for k in KERNELS.values()}
ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
SOFTMAXES = (aten._softmax.default, aten._safe_softmax.default)


class ContextSplitError(PlanError):
    """A graph the context-parallel split cannot cut along the sequence: what it met, and what would work."""


def context_split(tg: TrainGraph, c: int) -> TrainGraph:
    """The graph a context rank of ``c`` runs, from ``tg`` traced on one rank's L tokens (the module docstring);
    ``tg`` itself for c = 1 or a ``tg`` split for c already."""
    if c == tg.context_parallel:
        return tg
    if tg.context_parallel != 1:
        raise ContextSplitError(f"a trace split for {tg.context_parallel} context ranks cannot be split for {c}")
    length = local_length(tg)
    graph = copy_graph(tg.gm.graph)
    from_batch = _batch_derived(graph, len(tg.param_names) + len(tg.buffer_names))
    _causal_masks(graph, from_batch, length, tg.input_specs[0][0][0])
    _refuse_what_would_be_wrong(graph, from_batch, length, c)
    _positions(graph, from_batch, length)
    split = _ulysses(graph, c)
    if not split:
        raise ContextSplitError("context_parallel_size > 1, but the model has no fused attention "
                                "(F.scaled_dot_product_attention) for the context ranks to exchange: nothing in it "
                                "couples its tokens, so data parallelism over the same ranks trains it alike")
    graph.lint()
    gm = _LazyGraphModule(tg.gm, graph)
    return dataclasses.replace(tg, gm=gm, context_parallel=c)


def local_length(tg: TrainGraph) -> int:
    """L: the tokens per sample the trace ran (dim 1 of its batch inputs of two or more dims)."""
    lengths = {tuple(shape)[1] for shape, _ in tg.input_specs if len(shape) >= 2}
    if len(lengths) != 1:
        raise ContextSplitError(f"context parallelism splits every batch input along its dim 1 (the sequence); the "
                                f"inputs' shapes {[tuple(s) for s, _ in tg.input_specs]} do not share one")
    return lengths.pop()


def _batch_derived(graph: torch.fx.Graph, num_state: int) -> set[torch.fx.Node]:
    """The nodes computed from the batch inputs (the placeholders after the ``num_state`` parameters and buffers)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    derived = set(placeholders[num_state:])
    for n in graph.nodes:
        if n.op == "call_function" and any(i in derived for i in n.all_input_nodes):
            derived.add(n)
    return derived


def _where(node: torch.fx.Node) -> str:
    return f"{node.name} ({node.target}) in module '{node.meta.get(META_FQN) or '<root>'}'"


def _refuse_what_would_be_wrong(graph: torch.fx.Graph, from_batch: set, length: int, c: int) -> None:
    """ContextSplitError on what the split would compute wrong (the module docstring's list)."""
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        shape = n.meta.get(META_SHAPE) or ()
        if n.target in SOFTMAXES and len(shape) >= 2 and shape[-1] == length:
            raise ContextSplitError(f"attention written as matmuls and a softmax over the sequence ({_where(n)}) is "
                                    "not split along it: use F.scaled_dot_product_attention, whose kernel the "
                                    "context ranks exchange")
        if n.target in (aten.tril.default, aten.triu.default):
            raise ContextSplitError(f"a mask built as a matrix over the sequence ({_where(n)}) is not split: use "
                                    "F.scaled_dot_product_attention(..., is_causal=True)")
        if n.target in KERNELS:
            kernel = KERNELS[n.target]
            dropout = n.args[kernel.dropout] if len(n.args) > kernel.dropout else n.kwargs.get("dropout_p", 0.0)
            if dropout or kernel.mask_of(n) is not None:
                raise ContextSplitError(f"attention with {'dropout' if dropout else 'a mask'} ({_where(n)}) is not "
                                        "split: context parallelism exchanges causal or full attention without "
                                        "dropout")
            heads = n.args[0].meta[META_SHAPE][1]
            kv_heads = n.args[1].meta[META_SHAPE][1]
            if heads % c or kv_heads % c:
                raise ContextSplitError(f"Ulysses splits the {heads} query and {kv_heads} key/value heads of "
                                        f"{_where(n)} over the {c} context ranks: c must divide both")
        if n.target in (aten.slice.Tensor, aten.cumsum.default) and n in from_batch:
            source = n.args[0].meta.get(META_SHAPE) or ()
            dim = (n.args[1] if len(n.args) > 1 else 0) % max(len(source), 1)
            if len(source) >= 2 and dim < len(source) - 1 and source[dim] == length and \
                    (n.target is aten.cumsum.default or shape[dim] != length):  # (the sequence is never the last dim)
                what = "cumulative sum" if n.target is aten.cumsum.default else "slice"
                raise ContextSplitError(f"a {what} along the sequence of a value computed from the batch ({_where(n)}) "
                                        "would be each rank's piece's, not the sequence's: shift labels in the batch "
                                        "(inputs and targets of one length), compute positions from arange")


def _causal_masks(graph: torch.fx.Graph, from_batch: set, length: int, batch: int) -> None:
    """An attention mask computed from positions alone (no batch value: Hugging Face's from ``cache_position``)
    that is causal over the L traced tokens becomes ``is_causal=True``, one that masks nothing is dropped: under
    Ulysses the kernel sees the whole sequence, where a mask built for L tokens would not fit. The mask is
    evaluated once, on the CPU; any other mask is left for the refusal."""
    verdicts: dict[torch.fx.Node, str | None] = {}
    for n in list(graph.nodes):
        kernel, forward = KERNELS.get(n.target) or BACKWARDS.get(n.target), n.target in KERNELS
        if kernel is None:
            continue
        at, mask = kernel.mask_at(forward), kernel.mask_of(n, forward)
        if not isinstance(mask, torch.fx.Node) or mask in from_batch:
            continue
        if mask not in verdicts:
            verdicts[mask] = _mask_kind(mask, length, batch)
        kind = verdicts[mask]
        if kind is None:
            continue
        causal_at = kernel.causal if forward else kernel.backward_causal
        # (arguments left at their defaults up to is_causal: dropout_p 0.0, then is_causal False)
        args = [*n.args, *(False if i == causal_at else 0.0 for i in range(len(n.args), causal_at + 1))]
        args[causal_at] = kind == "causal"
        if at is not None:
            args[at] = None
        n.args = tuple(args)
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "attn_mask"}
    for mask in verdicts:  # what only the masks read goes with them
        _erase_unused(mask)


EXACT_MASK_TOKENS = 2048
"""Up to this many traced tokens a mask is evaluated as traced; beyond, at ``SMALL_MASK_TOKENS``."""
SMALL_MASK_TOKENS = 64
MASK_VIEWS = (aten.expand.default, aten._to_copy.default, aten.alias.default, aten.unsqueeze.default)
"""What a mask passes through on its way to the kernel without changing which keys a query sees."""


def _mask_kind(mask: torch.fx.Node, length: int, batch: int) -> str | None:
    """"causal" or "none" for a mask whose value (computed from constants and aranges alone) is that over L
    tokens; None otherwise, or where it cannot be computed here. Beyond ``EXACT_MASK_TOKENS`` (an L x L mask per
    sample would not fit the host) it is evaluated at ``SMALL_MASK_TOKENS`` tokens, its integers L - 1, L, L + 1
    read as the small length's, and only where its other integers are the batch size and dims (|i| <= 4): a
    window or any other constant leaves it unverified (refused)."""
    while mask.target in MASK_VIEWS:  # (an expand over the heads, a cast: the same pattern)
        mask = mask.args[0]
    nodes, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in nodes:
            continue
        if n.op != "call_function":
            return None  # (a parameter, buffer or input feeds it)
        nodes.add(n)
        todo.extend(n.all_input_nodes)
    size, resize = length, {}
    if length > EXACT_MASK_TOKENS:
        ints = [a for n in nodes for a in tree_leaves((n.args, n.kwargs)) if isinstance(a, int) and not isinstance(a, bool)]
        if any(abs(i) > 4 and i not in (length - 1, length, length + 1, batch) for i in ints):  # (dims: <= 4)
            return None
        size = SMALL_MASK_TOKENS
        resize = {length - 1: size - 1, length: size, length + 1: size + 1}
    cpu, values = torch.device("cpu"), {}

    def value(a):
        if isinstance(a, torch.fx.Node):
            return values[a]
        if isinstance(a, torch.device):
            return cpu
        return resize.get(a, a) if isinstance(a, int) and not isinstance(a, bool) else a

    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    try:
        for n in sorted(nodes, key=order.__getitem__):
            values[n] = n.target(*torch.fx.node.map_aggregate(n.args, value),
                                 **torch.fx.node.map_aggregate(n.kwargs, value))
    except Exception:  # noqa: BLE001 - a mask it cannot compute is left for the refusal
        return None
    m = values[mask]
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or tuple(m.shape[-2:]) != (size, size):
        return None
    allowed = m if m.dtype == torch.bool else m == 0
    if bool(allowed.all()):
        return "none"
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return "causal" if bool((allowed == causal).all()) else None


def _erase_unused(node: torch.fx.Node) -> None:
    """``node`` and its inputs, as far as nothing else reads them."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and not n.users and n.graph is not None:
            inputs = n.all_input_nodes
            n.graph.erase_node(n)
            todo.extend(inputs)


def _positions(graph: torch.fx.Graph, from_batch: set, length: int) -> None:
    """arange(L) -> the rank's positions; a state table's first L rows -> the rank's rows (and the backward)."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n in from_batch:
            continue
        if n.target in ARANGES:
            start, end, step = ((0, n.args[0], 1) if n.target is aten.arange.default else
                                (n.args[0], n.args[1], 1) if n.target is aten.arange.start else n.args[:3])
            if (start, end, step) != (0, length, 1):
                continue
            dtype = n.kwargs.get("dtype") or torch.int64
            with graph.inserting_before(n):
                new = add_call(graph, C.context_positions, (None, length, dtype, n.kwargs.get("device")))
            _replace(n, new)
        elif n.target is aten.slice.Tensor and _bounds(n) == (0, length) and \
                (n.args[0].meta.get(META_SHAPE) or (0,))[n.args[1]] > length:
            with graph.inserting_before(n):
                new = add_call(graph, C.context_slice, (None, n.args[0], n.args[1], length))
            _replace(n, new)
    for n in list(graph.nodes):  # the table's gradient: its backward's slice, at the rank's rows
        if n.target is aten.slice_backward.default and tuple(n.args[3:5]) == (0, length) and n.args[5] == 1 \
                and list(n.args[1])[n.args[2]] > length:
            with graph.inserting_before(n):
                new = add_call(graph, C.context_slice_backward, (None, n.args[0], list(n.args[1]), n.args[2], length))
            _replace(n, new)


def _bounds(n: torch.fx.Node) -> tuple:
    """(start, end) of an ``aten.slice.Tensor`` of step 1 (None where the step is another)."""
    args = (*n.args, *(0, None, None, 1)[len(n.args) - 1:])
    return None if args[4] != 1 else (args[2] or 0, args[3])


def _replace(old: torch.fx.Node, new: torch.fx.Node) -> None:
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def _ulysses(graph: torch.fx.Graph, c: int) -> int:
    """Each fused attention and its backward between Ulysses' all-to-alls; how many attentions it split."""
    forwards = [n for n in graph.nodes if n.target in KERNELS]
    backward_of = {tuple(n.args[1:4]): n for n in graph.nodes if n.target in BACKWARDS}
    for f in forwards:
        kernel = KERNELS[f.target]
        b = backward_of.get(tuple(f.args[:3]))
        with graph.inserting_before(f):
            qh, kh, vh = (_new(graph, C.context_to_heads, (None, x, c)) for x in f.args[:3])
        f.args = (qh, kh, vh, *f.args[3:])
        _meta(f)
        outs = {u.args[1]: u for u in f.users if u.target is operator.getitem}
        for u in outs.values():
            _meta(u)
        out_h = outs.get(0)
        if out_h is not None:
            with graph.inserting_after(out_h):
                out = _new(graph, C.context_to_tokens, (None, out_h, c))
            out_h.replace_all_uses_with(out, delete_user_cb=lambda user, out=out, b=b: user is not out and user is not b)
        if b is None:
            continue
        with graph.inserting_before(b):
            dout = _new(graph, C.context_to_heads, (None, b.args[0], c))
        args = [dout, qh, kh, vh, *b.args[4:]]
        args[kernel.backward_out], args[kernel.backward_lse] = out_h, outs.get(1)
        for i in kernel.backward_lengths:  # (the kernel runs the whole sequence)
            args[i] = args[i] * c
        b.args = tuple(args)
        _meta(b)
        for g in [u for u in b.users if u.target is operator.getitem and u.args[1] in (0, 1, 2)]:  # dQ, dK, dV
            _meta(g)
            with graph.inserting_after(g):
                grad = _new(graph, C.context_to_tokens, (None, g, c))
            g.replace_all_uses_with(grad, delete_user_cb=lambda user, grad=grad: user is not grad)
    for n in list(graph.nodes):  # what the backward read of the forward's token-split output before: nothing now
        if n.op == "call_function" and not n.users and n.target in (aten.detach.default, aten.alias.default):
            graph.erase_node(n)
    return len(forwards)


def _new(graph: torch.fx.Graph, target, args: tuple) -> torch.fx.Node:
    node = add_call(graph, target, args)
    like = args[1]
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val",)}
    _meta(node)
    return node


def _fake(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _meta(node: torch.fx.Node) -> None:
    """The node's value (on meta) and the shapes, bytes and FLOPs of it, from its inputs' values."""
    args = torch.fx.node.map_aggregate(node.args, _fake)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, _fake)
    if node.target is operator.getitem:
        val = args[0][args[1]]
    else:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            metas = torch.fx.node.map_aggregate(args, lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                                                if isinstance(a, torch.Tensor) else a)
            val = node.target(*metas, **kwargs)
    node.meta["val"] = val
    tensor_meta(node)
