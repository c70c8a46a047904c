"""FLOP estimates for aten ops in a traced graph.

Assumptions: a multiply-add counts as 2 FLOPs; matmul-like ops and convolutions are
counted exactly from their shapes (forward and backward), fused attention as its two
matmuls over the (query, key) pairs it computes (backward 2.5x: dQ, dK, dV and the recomputed
scores; causal: only the pairs on and below the diagonal, which the fused kernels compute and
the masked ones they skip); every other op is counted as one FLOP per output element (elementwise
estimate; views count 0). Shapes come from ``node.meta["val"]`` (meta or fake tensors
recorded by make_fx).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx

aten = torch.ops.aten

_VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.detach.default,
    aten.alias.default, aten.reshape.default, aten.as_strided.default, aten.split.Tensor,
    aten.unbind.int, aten.split_with_sizes.default,
}


def _shape(x) -> tuple[int, ...]:
    return tuple(x.meta["val"].shape) if isinstance(x, torch.fx.Node) else tuple(x.shape)


def _mm(node: torch.fx.Node) -> int:
    (m, k), (_, n) = _shape(node.args[0]), _shape(node.args[1])
    return 2 * m * k * n


def _addmm(node: torch.fx.Node) -> int:
    (m, k), (_, n) = _shape(node.args[1]), _shape(node.args[2])
    return 2 * m * k * n + m * n


def _bmm(node: torch.fx.Node) -> int:
    (b, m, k), (_, _, n) = _shape(node.args[0]), _shape(node.args[1])
    return 2 * b * m * k * n


def _baddbmm(node: torch.fx.Node) -> int:
    (b, m, k), (_, _, n) = _shape(node.args[1]), _shape(node.args[2])
    return 2 * b * m * k * n + b * m * n


def _conv_fwd_flops(out_shape, weight_shape, transposed: bool, in_shape) -> int:
    # each output element takes (C_in / groups) * prod(kernel) multiply-adds
    c_out, c_in_per_group, *kernel = weight_shape
    if transposed:  # weight is (C_in, C_out / groups, *kernel): count per input element
        return 2 * math.prod(in_shape) * c_in_per_group * math.prod(kernel)
    return 2 * math.prod(out_shape) * c_in_per_group * math.prod(kernel)


def _convolution(node: torch.fx.Node) -> int:
    x, w = node.args[0], node.args[1]
    transposed = bool(node.args[6]) if len(node.args) > 6 else False
    return _conv_fwd_flops(_shape(node), _shape(w), transposed, _shape(x))


def _convolution_backward(node: torch.fx.Node) -> int:
    grad_out, x, w = node.args[0], node.args[1], node.args[2]
    # schema: grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    # output_padding, groups, output_mask
    transposed, mask = bool(node.args[7]), node.args[10]
    one = _conv_fwd_flops(_shape(grad_out), _shape(w), transposed, _shape(x))
    return one * int(bool(mask[0])) + one * int(bool(mask[1])) + math.prod(_shape(grad_out)) * int(bool(mask[2]))


def _attention_flops(q, k, causal: bool = False) -> int:
    """QK^T and PV: 2 matmuls of 2 * d FLOPs per (query, key) pair and batch-head; causal (``is_causal``:
    query i sees keys 0..i) computes only those pairs, about half."""
    *batch, s_q, d = _shape(q)
    s_k = _shape(k)[-2]
    if not causal:
        pairs = s_q * s_k
    elif s_q <= s_k:
        pairs = s_q * (s_q + 1) // 2
    else:
        pairs = s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return 4 * math.prod(batch) * pairs * d


def _is_causal(node: torch.fx.Node) -> bool:
    """The node's ``is_causal`` argument, by its name in the op's schema (its position differs per kernel)."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index("is_causal")
    return bool(node.args[i] if i < len(node.args) else node.kwargs.get("is_causal", False))


def _sdpa(node: torch.fx.Node) -> int:
    return _attention_flops(node.args[0], node.args[1], _is_causal(node))


def _sdpa_backward(node: torch.fx.Node) -> int:
    # args: grad_out, query, key, ...; dQ, dK, dV and the recomputed scores: 2.5x forward
    return 5 * _attention_flops(node.args[1], node.args[2], _is_causal(node)) // 2


FLOP_RULES: dict[object, Callable[[torch.fx.Node], int]] = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten._scaled_dot_product_efficient_attention.default: _sdpa,
    aten._scaled_dot_product_flash_attention.default: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa,
    aten._scaled_dot_product_efficient_attention_backward.default: _sdpa_backward,
    aten._scaled_dot_product_flash_attention_backward.default: _sdpa_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_backward,
    aten._scaled_dot_product_cudnn_attention.default: _sdpa,
    aten._scaled_dot_product_cudnn_attention_backward.default: _sdpa_backward,
}


def output_numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(v.numel() for v in vals if isinstance(v, torch.Tensor))


def node_flops(node: torch.fx.Node) -> int:
    """Estimated FLOPs of one call_function node (0 for placeholders, views, outputs)."""
    if node.op != "call_function" or node.target in _VIEW_OPS:
        return 0
    rule = FLOP_RULES.get(node.target)
    if rule is not None:
        flops = rule(node)
        return flops if isinstance(flops, torch.SymInt) else int(flops)  # symbolic batch: kept unguarded
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0  # getitem and other Python-level glue
    return output_numel(node)
