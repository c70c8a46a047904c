"""What context parallelism's attention exchanges cost: the bytes one rank sends per attention layer and micro-batch,
and their time on a cluster against the attention compute they can hide behind (the formulas: docs/design.md
"Glossary and formulas").

Terms: c context ranks share each sample, each holding t = b * s / c of its tokens (b samples of s tokens); the
attention has h query heads and g key/value heads of e elements each, in w-byte elements. Causal attention is
balanced across the ranks (rank r holds chunks r and 2c - 1 - r of 2c), so every rank computes 1/c of it.

* ``"ring"`` (ring attention; Liu et al. 2023, TransformerEngine's P2P mode): K and V travel around the group in
  c - 1 hops, each hop one block of attention against the rank's queries, merged by log-sum-exp. The backward sends
  K and V around again (c - 1 hops) and the fp32 dK, dV accumulators with them, home (c hops).
* ``"all-gather"`` (Llama 3's context parallelism, TransformerEngine's all_gather mode): K|V all-gathered once
  per layer, attention of the rank's queries against all of it; the backward gathers K|V again and
  reduce-scatters dK|dV.
* ``"ulysses"`` (DeepSpeed-Ulysses; Jacobs et al. 2023): all-to-alls turn the sequence split into a head split
  (each rank all of the sequence for h/c query heads, g/c key/value heads) and back: q, k, v in, the output out;
  the backward the same four. Needs c | h and c | g: the K/V heads are exchanged, not their expansion.

The ring's hops overlap its blocks: a hop hides where the block it carries computes at least as long as it
crosses the link (``exchange_time_s``); the all-gather's and Ulysses' collectives are exposed (the attention reads their
result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from micscompile.core.errors import InputError
from micscompile.cost_model.collective_time import ALL_GATHER, ALL_TO_ALL, P2P, REDUCE_SCATTER, collective_time_s
from micscompile.cost_model.specs import Cluster, GpuSpec

EXCHANGES = ("ring", "all-gather", "ulysses")
"""The ways context ranks exchange attention's operands (``Plan.context_parallel_exchange`` names them)."""
Exchange = Literal["ring", "all-gather", "ulysses"]
ACCUMULATOR_BYTES = 4
"""The ring's dK, dV accumulators travel in fp32 (summed over c hops in the compute dtype they would lose bits)."""
BACKWARD_FLOPS_RATIO = 2.5
"""Attention's backward against its forward: five matmuls against two (Dao, FlashAttention-2, 2023)."""


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer of a micro-batch, as context parallelism splits it."""

    batch: int
    """b: samples per micro-batch."""
    sequence: int
    """s: tokens per sample, the whole sequence."""
    heads: int
    """h: query heads."""
    kv_heads: int
    """g: key/value heads (g < h: grouped-query attention)."""
    head_dim: int
    """e: elements per head."""
    causal: bool = True
    element_bytes: int = 2
    """w: bytes per element of q, k, v and the output (2: bf16)."""

    def tokens(self, c: int) -> int:
        """t = b * s / c: the tokens one of c context ranks holds."""
        return self.batch * self.sequence // c

    def forward_flops(self, c: int) -> float:
        """One rank's attention core forward (QK^T and PV): 4 b s^2 h e / c, half of it where causal."""
        full = 4 * self.batch * self.sequence ** 2 * self.heads * self.head_dim / c
        return full / 2 if self.causal else full


def check_exchange(kind: str, shape: AttentionShape, c: int, balanced: bool = True) -> None:
    """Raise InputError unless ``kind`` can exchange ``shape``'s attention over ``c`` context ranks, naming what
    would: a sequence c (2c where causal attention is balanced) divides, heads Ulysses can split."""
    if kind not in EXCHANGES:
        raise InputError(f"unknown context exchange {kind!r}: valid are {', '.join(EXCHANGES)}")
    if not isinstance(c, int) or c < 1:
        raise InputError(f"the context group must be a positive number of ranks, got {c!r}")
    pieces = 2 * c if balanced and shape.causal else c
    if shape.sequence % pieces:
        what = f"2c = {pieces} balanced chunks" if pieces == 2 * c else f"c = {c} pieces"
        raise InputError(f"a sequence of {shape.sequence} tokens does not cut into {what}: use a sequence length "
                         f"that is a multiple of {pieces}")
    if kind == "ulysses" and (shape.heads % c or shape.kv_heads % c):
        ok = [q for q in range(2, c + 1) if shape.heads % q == 0 and shape.kv_heads % q == 0] or [1]
        raise InputError(f"'ulysses' splits the {shape.heads} query heads and {shape.kv_heads} key/value heads over "
                         f"the c = {c} context ranks: c must divide both (valid c: {', '.join(map(str, ok))}), or "
                         "use exchange 'ring'")


def exchange_bytes(kind: Exchange, shape: AttentionShape, c: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for one attention layer of one micro-batch (the module docstring's
    formulas; 0 for c = 1)."""
    check_exchange(kind, shape, c)
    if c == 1:
        return 0.0, 0.0
    t, e, w = shape.tokens(c), shape.head_dim, shape.element_bytes
    kv = 2 * t * shape.kv_heads * e  # one rank's K and V, elements
    if kind == "ring":
        return (c - 1) * kv * w, (c - 1) * kv * w + c * kv * ACCUMULATOR_BYTES
    if kind == "all-gather":
        return (c - 1) * kv * w, 2 * (c - 1) * kv * w
    moved = (c - 1) / c * t * e * (2 * shape.heads + 2 * shape.kv_heads) * w  # ulysses: q, k, v, out
    return moved, moved


@dataclass(frozen=True)
class ExchangeTime:
    """One rank's exchange for one attention layer and micro-batch, on a cluster."""

    forward_s: float
    """The exchange's own time in forward (its links busy)."""
    backward_s: float
    exposed_forward_s: float
    """What of it the attention waits for (the ring: the hops its blocks do not hide)."""
    exposed_backward_s: float
    attention_forward_s: float
    """The attention core's compute on this rank (what the ring's hops run beside)."""


def _matmul_s(flops: float, gpu: GpuSpec, dtype: str) -> float:
    return flops / (gpu.flops(dtype) * gpu.matmul_efficiency)


def exchange_time_s(kind: Exchange, shape: AttentionShape, ranks: tuple[int, ...], cluster: Cluster,
                    dtype: str = "bfloat16") -> ExchangeTime:
    """``kind``'s exchange over the context group ``ranks`` (consecutive in the ring's order) on ``cluster``, and
    what the attention waits for of it: the ring's hops overlap its blocks (each hides where its block computes
    at least as long; a hop that crosses nodes runs at the node's NICs), the collectives are exposed."""
    c = len(ranks)
    forward_bytes, backward_bytes = exchange_bytes(kind, shape, c)
    attention_s = _matmul_s(shape.forward_flops(c), cluster.gpu, dtype)
    if c == 1:
        return ExchangeTime(0.0, 0.0, 0.0, 0.0, attention_s)
    if kind == "ring":
        kv = forward_bytes / (c - 1) / shape.element_bytes  # one rank's K and V, elements

        def hop_s(nbytes: float) -> float:  # (each step waits for the ring's slowest pair)
            return max(collective_time_s(P2P, nbytes, [a, b], cluster) for a, b in zip(ranks, ranks[1:] + ranks[:1]))

        block_s = attention_s / c  # (balanced: every step's block the same area)
        forward_hops = [hop_s(kv * shape.element_bytes)] * (c - 1)
        # backward, c steps: K, V on to the next rank (not after the last) and the dK, dV accumulators with them
        backward_hops = [hop_s(kv * ACCUMULATOR_BYTES + (kv * shape.element_bytes if i < c - 1 else 0))
                         for i in range(c)]
        return ExchangeTime(sum(forward_hops), sum(backward_hops),
                            sum(max(0.0, h - block_s) for h in forward_hops),
                            sum(max(0.0, h - BACKWARD_FLOPS_RATIO * block_s) for h in backward_hops), attention_s)
    group = list(ranks)
    if kind == "all-gather":  # (the buffer: the gathered K|V, c times one rank's)
        gathered = c * forward_bytes / (c - 1)
        forward_s = collective_time_s(ALL_GATHER, gathered, group, cluster)
        backward_s = forward_s + collective_time_s(REDUCE_SCATTER, gathered, group, cluster)
        return ExchangeTime(forward_s, backward_s, forward_s, backward_s, attention_s)
    t, e, w = shape.tokens(c), shape.head_dim, shape.element_bytes
    buffers = (t * shape.heads * e * w, t * shape.kv_heads * e * w)  # ulysses: q (and out), k (and v)
    one = sum(collective_time_s(ALL_TO_ALL, nbytes, group, cluster) for nbytes in (buffers[0], buffers[1],
                                                                                   buffers[1], buffers[0]))
    return ExchangeTime(one, one, one, one, attention_s)


def activation_bytes_per_layer(shape: AttentionShape, c: int, hidden: int) -> dict[str, float]:
    """What of one layer's kept activations context parallelism divides by c, and what it adds: every token-wise
    activation is 1/c (a rank holds t = b s / c tokens: 32 t h 16-bit bytes in a dropout-free layer with fused
    attention, ``predict.activation_bytes_per_layer``'s terms); the ring keeps nothing more (each block's K, V
    are dropped after it), the all-gather keeps the gathered K|V (c times the rank's) for the backward."""
    t = shape.tokens(c)
    kept = 32 * t * hidden
    extra = {"ring": 0.0, "all-gather": (c - 1) * 2 * t * shape.kv_heads * shape.head_dim * shape.element_bytes,
             "ulysses": 0.0}
    return {"token-wise": kept, **{f"{k} extra": v for k, v in extra.items()},
            "log-sum-exp": 4 * shape.batch * shape.heads * math.ceil(shape.sequence / c)}
