"""Trace model + loss + backward of one micro-batch into one FX graph, on meta tensors.

Graph signature: placeholders are the trainable-or-not parameters (canonical names,
tied parameters appear once), then buffers, then the batch inputs; the output is
``(loss, *grads)`` with one gradient (or None if unused) per parameter that requires
grad, in ``TrainGraph.param_names`` order.

Every node carries (keys below): shape, dtype, bytes, estimated FLOPs, region
(forward / backward) and the FQN of the innermost module that produced it. Forward
FQNs come from module pre/post hooks that read the tracer's current node count;
backward FQNs come from prehooks on the autograd nodes, keyed by the forward op's
autograd sequence number (``seq_nr``), the mechanism AOTAutograd uses to carry
stack traces into backward.

Attention (``F.scaled_dot_product_attention``) is recorded as the fused kernel the target
device runs (``trace(device=...)``), forward and backward, not as the math decomposition a
meta tensor would dispatch to (``_FusedAttention``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import os
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext, optimization_hint
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from tqdm import tqdm

from micscompile.core.errors import Error, InputError
from micscompile.core.program import REGION_BWD, REGION_FWD
from micscompile.cost_model.flops import node_flops
from micscompile.cost_model.node_cost import META_BYTES, META_FLOPS, is_shape_arithmetic  # the keys, defined once

META_FQN = "mc_fqn"
"""FQN of the innermost module that produced the node ("" = root, LOSS_FQN = loss_fn)."""
META_REGION = "mc_region"
"""REGION_FWD or REGION_BWD."""
LOSS_SCALE = "_mc_loss_scale"
"""The graph input that seeds the backward with the loss scale (``trace(loss_scale=True)``)."""
META_SHAPE = "mc_shape"
"""Shape of the (first) tensor output, or None."""
META_DTYPE = "mc_dtype"
"""dtype of the (first) tensor output, or None."""
META_PLACEMENT = "mc_tensor_placement"
"""How a tensor rank holds the value (``core.tensor_layout``: R, S, P), where ``lowering.tensor_split`` split
the graph; absent elsewhere."""
_SIZE = "size"
META_BATCH_EXPR = "mc_batch_expr"
"""Symbolic-batch traces: {META_BYTES / META_FLOPS / META_SHAPE: sympy expression(s) in the batch
symbol} for the node's values that depend on the micro-batch size."""

LOSS_FQN = "<loss>"


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@contextlib.contextmanager
def _reparametrized(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """``torch.nn.utils.stateless._reparametrize_module`` (tied weights tied), then every module's own
    parameters and buffers put back as they were. A module reachable under two names (a block reused
    by reference: ``self.blocks[2] = self.blocks[1]``) is swapped once per name, and torch's exit
    restores one of the two swaps with the traced tensor: the caller's model kept fake meta
    parameters, and ``mc.compile`` then sharded zeros (found by benchmarks/fuzz_plans.py)."""
    saved = [(store, key, t) for m in model.modules() for store in (m._parameters, m._buffers) for key, t in store.items()]
    try:
        with _reparametrize_module(model, tensors, tie_weights=True):
            yield
    finally:
        for store, key, t in saved:
            store[key] = t


def find_blocks(model: nn.Module) -> list[str]:
    """Block FQNs in ``named_modules`` order."""
    blocks: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, CONTAINERS) or _holds_layer_stack(child):
                visit(child, fqn + ".")
            else:
                blocks.append(fqn)

    visit(model, "")
    return blocks


def _is_layer_stack(module: nn.Module) -> bool:
    if not isinstance(module, CONTAINERS):
        return False
    kinds: dict[type, int] = {}
    for child in module.children():
        if next(child.children(), None) is not None:
            kinds[type(child)] = kinds.get(type(child), 0) + 1
    return any(n >= 2 for n in kinds.values())


def _holds_layer_stack(module: nn.Module) -> bool:
    return any(_is_layer_stack(m) for m in module.modules())


MODULE_MARKS: list[tuple[Callable[[str], None], Callable[[], None]]] = []
"""(enter, leave) of the trace in progress. A forward that replays a recorded graph instead of
calling the modules (``micscompile.dynamo``) marks through them the module each node came from,
as the module hooks do for an ordinary forward."""


class TraceError(Error, RuntimeError):
    """The model + loss could not be traced; the message names the module and op."""


@dataclass
class TrainGraph:
    """One micro-batch of forward + loss + backward as an FX graph, plus its bookkeeping."""

    gm: torch.fx.GraphModule
    param_names: list[str]
    """Canonical parameter FQNs, in placeholder order."""
    param_aliases: dict[str, list[str]]
    """Canonical FQN -> every FQN under which the parameter is reachable (tied weights)."""
    param_shapes: dict[str, torch.Size]
    param_dtypes: dict[str, torch.dtype]
    trainable: list[str]
    """Parameters that get a gradient output, in output order."""
    buffer_names: list[str]
    input_specs: list[tuple[torch.Size, torch.dtype]]
    """Shape and dtype of each batch input of ONE micro-batch."""
    num_model_inputs: int
    blocks: list[str]
    """FQNs of the model's blocks (find_blocks): the default gather units."""
    compute_dtype: torch.dtype | None = None
    """Mixed precision (``trace(param_dtype=...)``): the dtype the graph's floating parameters and
    batch inputs have (the graph casts the inputs itself); None: the model's own dtypes."""
    batch_symbols: tuple = ()
    """``trace(symbolic_batch=True)``: the sympy symbol(s) of the batch dimension (empty: concrete)."""
    batch_guards: tuple = ()
    """The conditions on the batch size the trace assumed (e.g. it is >= 2)."""
    self_checkpoints: int = 0
    """Calls of ``torch.utils.checkpoint`` the model made itself (run plainly while tracing; see
    ``_plain_checkpoints``): ``mc.compile`` then recomputes with ``Plan(checkpoint=True)``."""
    counted_loss: bool = False
    """``loss_fn`` returned ``(loss_sum, count)``: the graph's first output is ``[loss_sum, count]``
    (float32), its gradients those of ``loss_sum``; the step divides by the global count."""
    tensor_parallel: int = 1
    """The tensor ranks this graph is one of (``lowering.tensor_split``): its parameters' shapes are a
    tensor rank's pieces, and it calls the tensor collectives."""
    sequence_parallel: bool = False
    """Split with sequence parallelism (``Plan.sequence_parallel``)."""
    context_parallel: int = 1
    """The context ranks this graph is one of (``lowering.context_split``): it ran on one rank's tokens of each
    sample, and it calls the context exchanges."""
    token_shape: tuple[int, int] | None = None
    """(batch, sequence) of the token ids the model reads (its first 2-D integer input; a pipeline chunk
    keeps its model's); None: it reads none."""
    tensor_placements: dict = dataclasses.field(default_factory=dict)
    """Parameter -> its split (``core.tensor_layout.Placement``) among the tensor ranks; absent: replicated."""
    vocabulary_pads: dict = dataclasses.field(default_factory=dict)
    """(parameter, dim) -> the zeros a vocabulary tp does not divide was padded with (``param_shapes`` holds
    the padded sizes; ``lowering.tensor_split``)."""

    @property
    def batch_size(self) -> int:
        """The micro-batch size the recorded values are for."""
        return self.input_specs[0][0][0]

    def at_batch(self, batch):
        """This trace with every node's bytes, FLOPs and shape evaluated at micro-batch size ``batch``
        (a symbolic-batch trace; the graph is copied, its shape arithmetic folded to constants). At
        ``batch=1`` the values are those of the batch-generic graph (a trace made at size 1 records a
        few views where this one copies); the result is a concrete trace. ``batch`` may also be a sequence of sizes:
        then every batch-dependent value is a numpy array over them (what ``mc.autotune`` lowers
        once per plan structure and prices per size)."""
        if not self.batch_symbols:
            raise TraceError("at_batch needs a trace made with mc.trace(..., symbolic_batch=True)")
        sizes = [batch] if isinstance(batch, int) else list(batch)
        for b in sizes:
            env = dict.fromkeys(self.batch_symbols, b)
            bad = [g for g in self.batch_guards if g.xreplace(env) is sympy.false]
            if b < 1 or bad:
                raise TraceError(f"micro-batch size {b} breaks what the trace assumed of the batch size "
                                 f"({bad or ['a size of at least 1']}); trace that size on its own")
        cache: dict = {}

        def value(expr):
            if expr not in cache:
                vals = [int(expr.xreplace(dict.fromkeys(self.batch_symbols, b))) for b in sizes]
                cache[expr] = vals[0] if isinstance(batch, int) else np.array(vals, dtype=np.int64)
            return cache[expr]

        graph = self.graph_copy()
        for node in list(graph.nodes):
            exprs = node.meta.get(META_BATCH_EXPR) or {}
            if _SIZE in exprs or is_shape_arithmetic(node):  # folded: the graph a trace at this size records
                size = value(exprs[_SIZE]) if _SIZE in exprs else node.meta["val"]
                for user in list(node.users):
                    user.args = torch.fx.node.map_arg(user.args, lambda a, node=node, size=size: size if a is node else a)
                    user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a, node=node, size=size: size if a is node else a)
                graph.erase_node(node)
                continue
            for key, expr in exprs.items():
                node.meta[key] = (tuple(value(d) if isinstance(d, sympy.Expr) else d for d in expr)
                                  if key == META_SHAPE else value(expr))
        gm = _LazyGraphModule(self.gm, graph)  # (its Python code generated when first called)
        specs = [(torch.Size((batch if isinstance(batch, int) else sizes[0], *shape[1:])), dtype)
                 for shape, dtype in self.input_specs]
        tokens = self.token_shape and (batch if isinstance(batch, int) else sizes[0], self.token_shape[1])
        concrete = dict(batch_symbols=(), batch_guards=()) if isinstance(batch, int) else {}  # (what a trace at it records)
        return dataclasses.replace(self, gm=gm, input_specs=specs, token_shape=tokens, **concrete)

    @property
    def num_params(self) -> int:
        return len(self.param_names)

    @property
    def unused_params(self) -> set[str]:
        """Trainable parameters the loss does not depend on (their gradient is None, as in eager)."""
        out = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output").args[0]
        return {name for name, g in zip(self.trainable, out[1:]) if g is None}

    def param_bytes(self, name: str) -> int:
        return self.param_shapes[name].numel() * self.param_dtypes[name].itemsize

    def graph_copy(self) -> torch.fx.Graph:
        """A private copy of the graph for passes to rewrite (meta and all)."""
        return copy_graph(self.gm.graph)

    def summary(self) -> str:
        nodes = [n for n in self.gm.graph.nodes if n.op == "call_function"]
        fwd = sum(1 for n in nodes if n.meta.get(META_REGION) == REGION_FWD)
        flops = sum(n.meta.get(META_FLOPS, 0) for n in nodes)
        total = sum(self.param_shapes[n].numel() for n in self.param_names)
        return (
            f"TrainGraph: {len(nodes)} ops ({fwd} forward, {len(nodes) - fwd} backward), "
            f"{len(self.param_names)} parameters ({total:,} elements), {len(self.buffer_names)} buffers, "
            f"{flops / 1e9:.3f} GFLOP per micro-batch"
        )


GC_THRESHOLDS = (50_000, 20, 10)
"""Python's collector's thresholds while a trace is made and ``mc.autotune`` prices (the defaults are (700, 10, 10)).
The search keeps what it lowers (Programs, split graphs: about 1.5 GB for GPT-3) and makes many short-lived cyclic
objects (fx graphs); by default each growth of a quarter of that heap runs a full collection through all of it:
GPT-3's search (docs/autotune.md) ran 20, 18 s of its 76 s in one process. A young generation of 50,000 lets the
graphs die there (9 collections of the middle one, none full) and the peak stays as low: 59 s. Its trace: 13.1 s
to 12.4 s."""


@contextlib.contextmanager
def fewer_collections():
    """``GC_THRESHOLDS`` inside, and what exists on entry (a search's trace) frozen out of every collection (forked
    workers then leave its pages shared: a collection writes to each object it visits); both undone on exit. Where
    something is frozen already (a caller's ``gc.freeze()``, an outer use), that is left as it is."""
    old, freeze = gc.get_threshold(), gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if freeze:
            gc.unfreeze()


def add_node(graph: torch.fx.Graph, op: str, target, args: tuple = (), kwargs: dict | None = None,
             name: str | None = None, type_expr=None) -> torch.fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)``: the same node at the insert point, without
    the check torch 2.13's ``create_node`` makes of a call's arguments (a pytree walk of them, warning of raw
    ``SymInt`` leaves, which graphs made from a trace never hold: make_fx records sizes as nodes). The walk was a
    tenth of ``mc.autotune``'s search, in its tensor splits, passes and graph copies (docs/autotune.md). The
    arguments are set after the node is made, as any pass sets them (``Node.args``'s setter, torch's own)."""
    node = graph.create_node(op, target, None, None, name, type_expr)
    if args:
        node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def add_call(graph: torch.fx.Graph, target, args: tuple = (), kwargs: dict | None = None) -> torch.fx.Node:
    """``graph.call_function(target, args, kwargs)`` by ``add_node``."""
    return add_node(graph, "call_function", target, args, kwargs)


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node,
              arg_transform: Callable[[torch.fx.Node], object] = lambda n: n) -> torch.fx.Node:
    """``graph.node_copy(node, arg_transform)`` by ``add_node``: the same name, arguments, users' order, and a
    shallow copy of its meta."""
    new = add_node(graph, node.op, node.target, torch.fx.node.map_arg(node.args, arg_transform),
                   torch.fx.node.map_arg(node.kwargs, arg_transform), node.name, node.type)
    new.meta = copy.copy(node.meta)
    return new


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """``copy.deepcopy(graph)`` (node for node, meta copied shallowly, the same codegen) by ``copy_node``."""
    out = torch.fx.Graph(tracer_cls=graph._tracer_cls)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        env[node] = copy_node(out, node, env.__getitem__)
    out._codegen = copy.deepcopy(graph._codegen)
    return out


class _OpRecorder(TorchDispatchMode):
    """Remembers the last aten op dispatched, to name it when tracing fails."""

    def __init__(self) -> None:
        super().__init__()
        self.last_op: object = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.last_op = func
        return func(*args, **(kwargs or {}))


aten = torch.ops.aten


def _sdpa_choice(device_type: str, q, k, v, mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> SDPBackend:
    """The SDPA backend PyTorch picks for these inputs on ``device_type``: asked of its dispatcher on
    stand-ins with the same sizes, dtypes, last-dim strides and requires_grad (a few elements each)
    on the CPU or the current GPU once CUDA is in use (``mc.compile`` has made its GPU current), else
    ``_cuda_rule`` (no GPU, or tracing before any: asking would create a context on cuda:0)."""
    if device_type == "cuda" and not torch.cuda.is_initialized():  # no GPU, or none in use: no context made
        return _cuda_rule(q, k, v, mask)

    def stand_in(t):
        shape = [optimization_hint(d) if isinstance(d, torch.SymInt) else d for d in t.shape]
        step = int(t.stride(-1))
        base = torch.empty((shape[-1] - 1) * step + 1, dtype=t.dtype, device=device_type)
        return base.as_strided(shape, [0] * (len(shape) - 1) + [step]).detach().requires_grad_(t.requires_grad)

    with _disable_current_modes():  # real tensors, not traced
        return SDPBackend(torch._fused_sdp_choice(
            stand_in(q), stand_in(k), stand_in(v), None if mask is None else stand_in(mask),
            dropout_p, is_causal, enable_gqa=enable_gqa))


def _cuda_rule(q, k, v, mask) -> SDPBackend:
    """PyTorch's CUDA choice on sm80+ (A100, H100) in short: flash for fp16/bf16 without a mask,
    else memory-efficient; math for grouped heads, unequal head dims or head dims over 256."""
    dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    if q.dim() != 4 or len(dims) != 1 or max(dims) > 256 or q.shape[1] != k.shape[1]:
        return SDPBackend.MATH
    if q.dtype in (torch.float16, torch.bfloat16) and mask is None:
        return SDPBackend.FLASH_ATTENTION
    floating = q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return SDPBackend.EFFICIENT_ATTENTION if floating else SDPBackend.MATH


_FUSED = {"cpu": {SDPBackend.FLASH_ATTENTION},
          "cuda": {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION}}


class _FusedAttention(TorchFunctionMode):
    """Records ``F.scaled_dot_product_attention`` as the fused kernel ``device_type`` runs (flash on
    the CPU; flash, memory-efficient or cuDNN on CUDA), as aten's SDPA does there: one op forward
    and its own backward op, no L x S scores. What PyTorch would run as math (dropout on the CPU,
    unsupported shapes) stays the math decomposition; so do CUDA head dims that are not a multiple
    of 8 (aten pads them, which this does not repeat)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = self.fused(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def fused(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """The fused op's output, or None where this records the math decomposition."""
        backend = _sdpa_choice(self.device_type, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        if backend == SDPBackend.CUDNN_ATTENTION and attn_mask is not None:  # its mask conversion is not repeated
            backend = _cuda_rule(q, k, v, attn_mask)  # memory-efficient where that takes these inputs
        cuda = self.device_type == "cuda"
        if backend not in _FUSED[self.device_type] or (cuda and (q.shape[-1] % 8 or v.shape[-1] % 8)):
            return None
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # aten: convert_boolean_attn_mask
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(q.dtype)
        if not cuda:
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if backend == SDPBackend.FLASH_ATTENTION:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if backend == SDPBackend.CUDNN_ATTENTION:
            return aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, dropout_p, is_causal, scale=scale)[0]
        if attn_mask is not None:  # aten: preprocess_mask (the kernel reads mask rows aligned to 16 elements)
            if attn_mask.stride(-1) != 1 or any(st % 16 for st in attn_mask.stride()[:-1]):
                size = attn_mask.shape[-1]
                attn_mask = F.pad(attn_mask, (0, 16 - size % 16))[..., :size]
            attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]


def _to_meta(t: torch.Tensor, floating: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on meta (a leaf); ``floating``: the dtype a floating ``t`` gets."""
    out = torch.empty_like(t, device="meta", dtype=floating if floating is not None and t.is_floating_point() else None)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: where the user's code failed."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith((torch_dir, here))]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "unknown location"


def tensor_meta(node: torch.fx.Node, shape_env: ShapeEnv | None = None) -> None:
    """The node's shape, dtype, bytes and FLOPs; with ``shape_env`` (symbolic batch) their values at
    the example batch, and the sympy expressions of those that depend on it (META_BATCH_EXPR)."""
    val = node.meta.get("val")
    vals = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
    exprs: dict[str, object] = {}

    def concrete(key: str, v):
        if not isinstance(v, torch.SymInt):
            return int(v)
        expr = shape_env.replace(v.node.expr)
        if expr.free_symbols:
            exprs[key] = expr
        return optimization_hint(v)

    if isinstance(val, torch.SymInt):  # shape arithmetic (symbolic batch): at_batch folds it to a constant
        exprs[_SIZE] = shape_env.replace(val.node.expr)
    shape = tuple(vals[0].shape) if vals else None
    node.meta[META_DTYPE] = vals[0].dtype if vals else None
    node.meta[META_BYTES] = concrete(META_BYTES, sum(v.numel() * v.element_size() for v in vals))
    node.meta[META_FLOPS] = concrete(META_FLOPS, node_flops(node))
    if shape is not None and shape_env is not None and any(isinstance(d, torch.SymInt) for d in shape):
        dims = [shape_env.replace(d.node.expr) if isinstance(d, torch.SymInt) else d for d in shape]
        if any(getattr(d, "free_symbols", None) for d in dims):
            exprs[META_SHAPE] = tuple(dims)
        shape = tuple(optimization_hint(d) if isinstance(d, torch.SymInt) else d for d in shape)
    node.meta[META_SHAPE] = shape
    if exprs:
        node.meta[META_BATCH_EXPR] = exprs


def _check_no_mutation(gm: torch.fx.GraphModule, graph_inputs: dict[torch.fx.Node, str]) -> None:
    """Refuse in-place writes to parameters, buffers or inputs (e.g. BatchNorm running stats)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg_schema, arg in zip(node.target._schema.arguments, node.args):
            alias = arg_schema.alias_info
            if alias is None or not alias.is_write or not isinstance(arg, torch.fx.Node):
                continue
            base = arg  # follow views (they share storage) back to what is written; stop at anything else
            while (base.op == "call_function" and isinstance(base.target, torch._ops.OpOverload)
                   and base.target.is_view and isinstance(base.args[0], torch.fx.Node)):
                base = base.args[0]
            if base in graph_inputs:
                raise TraceError(
                    f"module '{node.meta.get(META_FQN) or '<root>'}' writes in place to "
                    f"{graph_inputs[base]} with {node.target}: state updated by the batch during "
                    "training (e.g. BatchNorm running statistics) is not supported; "
                    "use LayerNorm/GroupNorm or put the module in eval mode"
                )


def trace(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    *,
    num_model_inputs: int = 1,
    param_dtype: torch.dtype | None = None,
    symbolic_batch: bool = False,
    progress: bool = False,
    device: str | torch.device | None = None,
    forward_only: bool = False,
    loss_scale: bool = False,
    source_lines: bool = False,
) -> TrainGraph:
    """Trace forward + loss + backward of one micro-batch on the meta device.

    ``model(*example_inputs[:num_model_inputs])`` is the forward; the loss is
    ``loss_fn(output, *example_inputs[num_model_inputs:])`` and must be a scalar.
    Works for models built under ``torch.device("meta")`` and for real models (their
    values are not read). Needs no process group.

    ``param_dtype`` (mixed precision, ``Plan.param_dtype``): the graph computes with its
    floating parameters in this dtype (they arrive gathered in it) and casts the floating
    buffers and batch inputs to it as its first ops; gradients come out in it. The result is
    what ``model.to(param_dtype)`` computes on inputs cast the same way.

    ``symbolic_batch``: the batch dimension (dim 0 of every input) is a symbol while tracing, so
    every node's bytes, FLOPs and shape are also recorded as sympy expressions in it
    (META_BATCH_EXPR); ``TrainGraph.at_batch(b)`` evaluates them for any micro-batch size b >= 2
    without tracing again (``mc.autotune`` searches micro-batch sizes this way). The recorded
    values are those of the example batch, which must be at least 2 (PyTorch specializes size-1
    dimensions). The graph then also holds the shape arithmetic (``sym_size``, ``mul``) that
    derives view sizes from the batch; it costs nothing in the cost model.

    ``progress``: a progress bar (blocks traced forward, then autograd nodes backward).

    ``device``: the device (type) the graph will run on; device-specific kernels are recorded for
    it: ``F.scaled_dot_product_attention`` becomes the fused attention op it runs there (see
    ``_FusedAttention``). Default: this process's, "cuda" where a GPU is visible, else "cpu"
    (``mc.compile`` passes the device it runs on). To predict a GPU cluster from a machine
    without one, pass "cuda".

    ``forward_only``: forward and loss alone (``Step.evaluate``): the graph returns the loss (or
    ``[loss_sum, count]``) and no gradients, and is traced with the model in ``eval()`` mode
    (dropout off; the model's mode is restored after).

    ``loss_scale`` (fp16 training, ``Plan.param_dtype=torch.float16``): the backward is seeded with
    the value of an extra fp32 scalar buffer named ``LOSS_SCALE`` instead of 1, so every gradient
    comes out multiplied by it (dynamic loss scaling; the step owns the value).

    ``source_lines``: every node keeps the Python stack that made it (``node.meta["stack_trace"]``),
    so a pass that refuses a node can name the model's source line (``source_line``); 6-14% more
    trace time on a 12-layer GPT (``mc.compile`` asks for it with tensor parallelism).
    """
    target = _target_device(device)
    example_inputs = _checked_inputs(example_inputs, num_model_inputs, symbolic_batch)
    aliases = _parameter_aliases(model)
    fakes = _FakeInputs(model, example_inputs, param_dtype, symbolic_batch, loss_scale and not forward_only)
    marks = _Marks(model, progress)
    joint = _joint(model, loss_fn, num_model_inputs, fakes, marks, forward_only)
    recorder, self_checkpoints = _OpRecorder(), [0]

    def recorded_joint(params, buffers, *inputs):
        with recorder, _FusedAttention(target), _plain_checkpoints(self_checkpoints):
            return joint(params, buffers, *inputs)

    with marks, _tracing_mode(model, forward_only):
        try:
            # lazy: Python code for the graph is generated on first call / .code only (~1.5 s at 175B);
            # simulation never needs it, and compile builds its own GraphModule from the rewritten graph
            with fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True), fewer_collections():
                gm = make_fx(recorded_joint, tracing_mode="fake", record_stack_traces=source_lines)(
                    fakes.params, fakes.buffers, *fakes.inputs)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the module and op named
            raise _trace_error(exc, model, marks, recorder.last_op) from exc
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat signature: (*params, *buffers, *inputs)
    gm.recompile()  # lazy (see above): marks the code stale
    _annotate(gm, marks.forward, marks.backward, marks.backward_start, fakes.shape_env)
    batch_symbols, guards = fakes.batch_symbols()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [f"parameter '{n}'" for n in fakes.params] + [f"buffer '{n}'" for n in fakes.buffers]
    names += [f"input {i}" for i in range(len(fakes.inputs))]
    _check_no_mutation(gm, dict(zip(placeholders, names)))
    return TrainGraph(
        gm=gm,
        param_names=list(fakes.params),
        param_aliases=aliases,
        param_shapes={n: p.shape for n, p in fakes.params.items()},
        param_dtypes={n: p.dtype for n, p in model.named_parameters()},
        trainable=[] if forward_only else fakes.trainable,
        buffer_names=list(fakes.buffers),
        input_specs=[(x.shape, x.dtype) for x in example_inputs],
        num_model_inputs=num_model_inputs,
        blocks=marks.blocks,
        compute_dtype=fakes.low,
        batch_symbols=batch_symbols,
        batch_guards=guards,
        counted_loss=marks.counted,
        self_checkpoints=self_checkpoints[0],
        token_shape=next((tuple(x.shape) for x in example_inputs
                          if x.dim() == 2 and not x.is_floating_point() and isinstance(x.shape[1], int)), None),
    )


def _target_device(device: str | torch.device | None) -> str:
    """The device type the graph will run on (``trace(device=...)``): this process's by default."""
    target = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu").type
    if target not in ("cpu", "cuda"):
        raise TraceError(f"device={device!r}: the graph runs on 'cpu' or 'cuda' (it is traced on meta regardless)")
    return target


def _checked_inputs(example_inputs: Sequence[torch.Tensor], num_model_inputs: int,
                    symbolic_batch: bool) -> tuple[torch.Tensor, ...]:
    """The example batch as a tuple of tensors, or a TraceError saying what is wrong with it."""
    example_inputs = tuple(example_inputs)
    if not 1 <= num_model_inputs <= len(example_inputs):
        raise TraceError(f"num_model_inputs={num_model_inputs} but {len(example_inputs)} example inputs")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"example input {i} is a {type(x).__name__}; every batch input must be a tensor")
    if symbolic_batch and any(x.dim() == 0 or x.shape[0] < 2 for x in example_inputs):
        raise TraceError("symbolic_batch=True needs example inputs with a batch dimension of at least 2 "
                         f"(got shapes {[tuple(x.shape) for x in example_inputs]}): PyTorch specializes size-1 "
                         "dimensions")
    return example_inputs


def _parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's canonical name -> every name it is reached under (tied weights: several)."""
    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        aliases.setdefault(canonical[id(p)], []).append(name)
    return aliases


class _FakeInputs:
    """The joint function's inputs as fake meta tensors: the parameters (in the compute dtype), the buffers (and
    the loss-scale seed), the batch.

    One fake mode for the whole trace, over meta tensors: "real" tracing of meta tensors makes a new fake mode
    (and a Python stack capture) per op, ~45% of the time on large models; and ops whose output shape depends
    on data fail where they happen, not at a later guard. No ShapeEnv: dynamic output shapes raise at their op;
    ``symbolic_batch``: one that guards, with the batch dimension of the inputs dynamic and every other static."""

    def __init__(self, model: nn.Module, example_inputs: tuple[torch.Tensor, ...], param_dtype: torch.dtype | None,
                 symbolic_batch: bool, loss_scale: bool) -> None:
        self.shape_env = ShapeEnv() if symbolic_batch else None
        self.mode = FakeTensorMode(shape_env=self.shape_env)
        self.low = param_dtype if param_dtype is not None and param_dtype != torch.float32 else None
        self.params = {name: self.fake(_to_meta(p, self.low)) for name, p in model.named_parameters()}
        self.buffers = {name: self.fake(_to_meta(b)) for name, b in model.named_buffers()}
        if loss_scale:
            self.buffers[LOSS_SCALE] = self.fake(torch.ones((), device="meta"))
        self.inputs = [self.fake(_to_meta(x).requires_grad_(False), batch=True) for x in example_inputs]
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    def fake(self, x: torch.Tensor, batch: bool = False) -> torch.Tensor:
        if self.shape_env is None:
            return self.mode.from_tensor(x)
        dims = [DimDynamic.DYNAMIC if batch and i == 0 else DimDynamic.STATIC for i in range(x.dim())]
        return self.mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    def compute(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the compute dtype where it is floating (mixed precision), else as it is."""
        return t.to(self.low) if self.low is not None and t.is_floating_point() else t

    def batch_symbols(self) -> tuple[tuple, tuple]:
        """(the batch dimension's symbols, the guards on them) of a symbolic-batch trace; ((), ()) otherwise."""
        if self.shape_env is None:
            return (), ()
        env = self.shape_env
        symbols = tuple(sorted({s for x in self.inputs for s in env.replace(x.shape[0].node.expr).free_symbols},
                               key=str))
        if not symbols:
            raise TraceError("symbolic_batch=True, but the model fixes the batch size (a shape check or a "
                             "reshape to a constant specialized it); trace one batch size at a time instead")
        return symbols, tuple(env.replace(g.expr) for g in env.guards)


class _Marks:
    """Where each module's and each autograd node's ops start in the graph being traced, for ``_annotate``:
    ``forward`` (node, fqn) marks from module pre/post hooks, ``backward`` (node, autograd sequence number)
    marks from autograd prehooks; a progress bar over blocks, then autograd nodes. A context: the hooks are on
    the model (and ``MODULE_MARKS`` names them) while it is entered."""

    def __init__(self, model: nn.Module, progress: bool) -> None:
        self.model = model
        self.forward: list[tuple[torch.fx.Node, str]] = []
        self.backward: list[tuple[torch.fx.Node, int]] = []
        self.backward_start: torch.fx.Node | None = None
        self.counted = False
        self.stack: list[str] = []
        self.callers: list[nn.Module | None] = []
        self.blocks = find_blocks(model)
        self.block_set = set(self.blocks)
        # (disable=None: off where stderr is no terminal, e.g. a log file: no carriage returns)
        self.bar = tqdm(total=len(self.blocks), desc="trace forward", unit="block", disable=None if progress else True,
                        leave=False)
        self.handles: list = []

    def __enter__(self) -> _Marks:
        for fqn, mod in self.model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, fqn=fqn: self.enter(fqn, m)))
            # no always_call: on an exception the stack must still name the failing module
            self.handles.append(mod.register_forward_hook(lambda m, a, o: self.leave()))
        MODULE_MARKS.append((self.enter, self.leave))
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        MODULE_MARKS.pop()
        for h in self.handles:
            h.remove()

    @staticmethod
    def now() -> torch.fx.Node:
        """The graph's last node so far: marks what follows (a node, not a count, because make_fx later drops
        the unused shape arithmetic of a symbolic-batch trace)."""
        return get_proxy_mode().tracer.graph._root._prev

    def enter(self, fqn: str, module: nn.Module | None = None) -> None:
        # a module reached under several names (a block reused, a Linear shared by two blocks) is named by
        # the path it was called through, so each use's nodes belong to the block that calls it
        caller = self.callers[-1] if self.callers else None
        child = next((n for n, c in caller.named_children() if c is module), None) if caller is not None else None
        if child is not None:  # (the canonical name, unless the caller was reached under another)
            fqn = f"{self.stack[-1]}.{child}" if self.stack[-1] else child
        self.stack.append(fqn)
        self.callers.append(module)
        self.forward.append((self.now(), fqn))
        if fqn in self.block_set:
            self.bar.update()

    def leave(self) -> None:
        self.stack.pop()
        self.callers.pop()
        self.forward.append((self.now(), self.stack[-1] if self.stack else ""))

    def start_backward(self, loss: torch.Tensor) -> None:
        """The backward starts here: a prehook on every autograd node reachable from ``loss`` marks its ops."""
        self.backward_start = self.now()
        seen, todo = set(), [loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            fn.register_prehook(functools.partial(self.backward_mark, fn._sequence_nr()))
            todo.extend(next_fn for next_fn, _ in fn.next_functions)
        self.bar.reset(total=len(seen))
        self.bar.set_description("trace backward")
        self.bar.unit = "node"

    def backward_mark(self, seq: int, grads) -> None:
        self.backward.append((self.now(), seq))
        self.bar.update()


def _joint(model: nn.Module, loss_fn: Callable, num_model_inputs: int, fakes: _FakeInputs, marks: _Marks,
           forward_only: bool) -> Callable:
    """The function make_fx traces: (params, buffers, *inputs) -> (loss head, *gradients)."""
    def joint(params, buffers, *inputs):
        # traced: the graph casts the batch and the buffers itself (they stay in their dtype outside it)
        seed = buffers.pop(LOSS_SCALE, None)  # not the model's: the step's loss scale
        inputs = [fakes.compute(x) for x in inputs]
        buffers = {n: fakes.compute(b) for n, b in buffers.items()}
        # the traced tensors stand in for the module's own while the forward AND the loss run:
        # a loss_fn that reads a parameter (a temperature, a regulariser) must see the traced one
        # ... and the backward: a model that checkpoints itself (torch.utils.checkpoint) runs its
        # forward again there, which must read the traced parameters too
        with _reparametrized(model, {**params, **buffers}):
            out = model(*inputs[:num_model_inputs])
            marks.enter(LOSS_FQN)
            loss, count = _split_loss(loss_fn(out, *inputs[num_model_inputs:]))
            # the loss's own forward ops (the last pipeline chunk's), not the backward's
            head = loss if count is None else torch.stack([loss.float().reshape(()), count.float().reshape(())])
            marks.leave()
            marks.counted = count is not None
            if forward_only:
                return (head,)
            marks.start_backward(loss)
            grads = torch.autograd.grad(loss, [params[n] for n in fakes.trainable], allow_unused=True,
                                        grad_outputs=None if seed is None else seed.to(loss.dtype).reshape(loss.shape))
        return (head, *grads)
    return joint


@contextlib.contextmanager
def _tracing_mode(model: nn.Module, forward_only: bool):
    """The model as it is traced: in eval() for a forward-only graph, and a Hugging Face model as it comes
    (use_cache=True) without building a KV cache (not part of the loss); restored after."""
    modes = {m: m.training for m in model.modules()}
    if forward_only:
        model.eval()
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", False) is True
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        if cached:
            config.use_cache = True


def _trace_error(exc: Exception, model: nn.Module, marks: _Marks, last_op) -> TraceError:
    """A failure inside the trace as a TraceError naming the module (or the loss, or the backward) and the op it
    failed at, with a hint where the op says what the model does that cannot be traced."""
    where = marks.stack[-1] if marks.stack else "<root>"
    mod = model.get_submodule(where) if where and where != LOSS_FQN and marks.stack else model
    kind = "the loss function" if where == LOSS_FQN else f"module '{where or '<root>'}' ({type(mod).__name__})"
    if marks.backward_start is not None:
        kind = "the backward pass (autograd)"
    hint = ""
    if last_op in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
        hint = " — data-dependent control flow or .item() on a tensor cannot be traced"
    elif last_op is torch.ops.aten.index.Tensor and "FakeTensor" in str(exc):
        hint = (" — indexing with a Python list (x[..., [i]]) makes an index tensor on the meta device, "
                "without its values, that the trace cannot use: index with a slice (x[..., i:i+1])")
    elif last_op is torch.ops.aten._grouped_mm.default and "BF16" in str(exc):
        hint = " — grouped_mm (MoE experts) runs in bf16 only: Plan(param_dtype=torch.bfloat16)"
    return TraceError(f"cannot trace {type(model).__name__}: failed in {kind} at op {last_op} "
                      f"[{_user_frame(exc)}]{hint}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _plain_checkpoints(calls: list[int]):
    """While tracing, a model's own ``torch.utils.checkpoint`` calls (Hugging Face's
    ``gradient_checkpointing_enable()``, torchtitan's and Megatron's activation checkpointing,
    ``checkpoint_wrapper``) run their function plainly, counted in ``calls``: the recomputation is
    the Plan's (``mc.compile`` maps a self-checkpointing model onto ``Plan(checkpoint=True)``,
    which recomputes each block where its backward gather serves it). Both of checkpoint's paths
    are patched where it looks them up at call time (the function itself is often captured in a
    ``functools.partial`` before tracing)."""
    import torch.utils.checkpoint as ckpt

    def plain_generator(*args, **kwargs):  # the non-reentrant path's pre- and post-forward logic: none
        calls[0] += 1
        yield

    class PlainFunction:  # the reentrant path
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            calls[0] += 1
            return function(*args)

    saved = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction
    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = plain_generator, PlainFunction
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = saved


def _split_loss(result) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``loss_fn``'s result -> (the scalar to differentiate, the count it sums over or None): a mean
    loss, or ``(loss_sum, count)`` (token-weighted: e.g. the summed cross-entropy and the number of
    targets that are not ``ignore_index``)."""
    count = None
    if isinstance(result, (tuple, list)):
        if len(result) != 2 or not all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in result):
            raise TraceError("loss_fn must return a scalar tensor (the mean loss) or a pair of scalar tensors "
                             f"(loss_sum, count), got {type(result).__name__} of {len(result)}")
        result, count = result
        if count.requires_grad:
            raise TraceError("loss_fn's count (the second of (loss_sum, count)) must not depend on the "
                             "parameters: count the targets, e.g. (labels != ignore_index).sum()")
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        raise TraceError(f"loss_fn must return a scalar tensor, got {getattr(result, 'shape', type(result))}")
    if not result.requires_grad:
        raise TraceError("the loss does not depend on any parameter that requires grad")
    return result, count


def _annotate(gm: torch.fx.GraphModule, fwd_marks, bwd_marks, bwd_start: torch.fx.Node, shape_env: ShapeEnv | None) -> None:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def count(mark: torch.fx.Node) -> int:  # nodes before the mark in the final graph
        while mark not in index and mark.op != "root":
            mark = mark._prev  # erased since: its predecessor when it was erased
        return 0 if mark.op == "root" else index[mark] + 1

    fwd_marks = sorted(((count(m), fqn) for m, fqn in fwd_marks), key=lambda m: m[0])  # stable: keeps hook order
    bwd_marks = [(count(m), seq) for m, seq in bwd_marks]
    bwd_start = count(bwd_start) if bwd_start is not None else len(index)  # forward_only: no backward
    seq_fqn: dict[int, str] = {}
    fi = bi = 0
    fqn, bwd_fqn = "", LOSS_FQN
    for i, node in enumerate(gm.graph.nodes):
        while fi < len(fwd_marks) and fwd_marks[fi][0] <= i:
            fqn = fwd_marks[fi][1]
            fi += 1
        tensor_meta(node, shape_env)
        if i < bwd_start:
            node.meta[META_REGION] = REGION_FWD
            node.meta[META_FQN] = fqn
            if node.op == "call_function":
                seq_fqn.setdefault(node.meta.get("seq_nr", -1), fqn)
        else:
            while bi < len(bwd_marks) and bwd_marks[bi][0] <= i:
                bwd_fqn = seq_fqn.get(bwd_marks[bi][1], bwd_fqn)
                bi += 1
            node.meta[META_REGION] = REGION_BWD
            node.meta[META_FQN] = bwd_fqn


def check_batch(batch, input_specs, micro_batches: int, whose: str = "this rank's") -> None:
    """Raise ValueError unless ``batch`` is ``micro_batches`` micro-batches of the traced inputs."""
    if len(batch) != len(input_specs):
        raise InputError(f"step() takes {len(input_specs)} batch inputs (as example_inputs), got {len(batch)}")
    for i, (x, (shape, dtype)) in enumerate(zip(batch, input_specs)):
        want = (shape[0] * micro_batches, *shape[1:])
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != dtype:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"batch input {i}: expected shape {want} {dtype} ({whose} local batch, "
                             f"{micro_batches} micro-batches of {shape[0]}), got {got}; a step runs the one "
                             "batch shape it was compiled for: pad a shorter batch to it (with a (loss_sum, "
                             "count) loss, targets padded with ignore_index leave the mean exact) or compile "
                             "a step for the other shape (docs/training.md)")


def context_part(batch: Sequence[torch.Tensor], c: int, index: int) -> tuple[torch.Tensor, ...]:
    """Context rank ``index`` of ``c``'s part of ``batch`` (``Plan.context_parallel_size``): every input of two or
    more dims cut along dim 1 (the sequence) into c pieces, the index-th; the batch as it is for c = 1."""
    if c == 1:
        return tuple(batch)
    out = []
    for i, x in enumerate(batch):
        if x.dim() < 2:
            raise InputError(f"batch input {i} has shape {tuple(x.shape)}: context parallelism cuts every input "
                             "along dim 1 (the sequence), so each needs one")
        if x.shape[1] % c:
            raise InputError(f"batch input {i} has {x.shape[1]} tokens along dim 1 (the sequence): "
                             f"context_parallel_size={c} must divide it")
        length = x.shape[1] // c
        out.append(x.narrow(1, index * length, length).contiguous())
    return tuple(out)


def split_batch(batch: Sequence[torch.Tensor], micro_batches: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every batch input along dim 0 into ``micro_batches`` equal micro-batches."""
    for i, x in enumerate(batch):
        if x.dim() == 0 or x.shape[0] % micro_batches:
            raise InputError(
                f"batch input {i} has shape {tuple(x.shape)}: its first (batch) dimension must be "
                f"divisible by micro_batches={micro_batches}"
            )
    chunks = [x.chunk(micro_batches) for x in batch]
    return [tuple(c[j] for c in chunks) for j in range(micro_batches)]


__all__ = [
    "TrainGraph", "TraceError", "trace", "split_batch", "check_batch",
    "META_FQN", "META_REGION", "META_SHAPE", "META_DTYPE", "META_BYTES", "META_FLOPS",
    "REGION_FWD", "REGION_BWD", "LOSS_FQN",
]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def source_line(node: torch.fx.Node) -> str:
    """Where the model's code made ``node`` ("path:line: code"): the innermost frame of its recorded stack
    outside torch and this module; "" without one (traced without ``source_lines``, or made by autograd)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = [f for f in _FRAME.findall(node.meta.get("stack_trace") or "")
              if not f[0].startswith(torch_dir) and os.path.abspath(f[0]) != os.path.abspath(__file__)]
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{path}:{line}: {code.strip()}"
