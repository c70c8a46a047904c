"""Small reference models used by the examples, benchmarks and tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    tie_embeddings: bool = True
    causal: bool = True
    """False: bidirectional attention (a BERT-style encoder with the same blocks)."""
    mlp_ratio: int = 4
    """The MLP's intermediate size over the hidden size (the thesis's wide BERT 10B, §3.5.1.3: 8)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.causal = cfg.causal
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TokenEmbedding(nn.Embedding):
    """nn.Embedding with GPT-2's N(0, 0.02) init (N(0, 1) makes tied logits explode)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class PositionalEmbedding(nn.Module):
    """Learned positions: its own block, with reset_parameters like nn.Embedding."""

    def __init__(self, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class GPT(nn.Module):
    """A small GPT-2-style decoder: token + position embedding, pre-LN blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = TokenEmbedding(cfg.vocab_size, cfg.hidden)
        self.pos = PositionalEmbedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.tok(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass(frozen=True)
class LlamaConfig(GPTConfig):
    """A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP of ``ffn`` (the
    GPT's sizes; its ``causal`` and ``mlp_ratio`` unused: always causal, the MLP sized by ``ffn``)."""

    layers: int = 2
    hidden: int = 128
    kv_heads: int = 2
    """Key/value heads: each serves ``heads // kv_heads`` query heads (grouped-query attention)."""
    ffn: int = 344
    rope_theta: float = 500000.0


LLAMA_1B = LlamaConfig(vocab_size=128256, seq_len=2048, layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192)
"""Llama 3.2 1B's shape (1.24B parameters, tied embeddings)."""


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim): each pair of halves turned by the
    position times its frequency."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., : dim // 2], x[..., dim // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * head_dim, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape
        d = h // cfg.heads
        q = _rotate(self.q(x).view(b, s, cfg.heads, d).transpose(1, 2), cfg.rope_theta)
        k = _rotate(self.k(x).view(b, s, cfg.kv_heads, d).transpose(1, 2), cfg.rope_theta)
        v = self.v(x).view(b, s, cfg.kv_heads, d).transpose(1, 2)
        rep = cfg.heads // cfg.kv_heads  # each key/value head repeated for its query heads: the fused kernels run
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden)
        self.attn = LlamaAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    """A Llama-style decoder (``LlamaConfig``) with the GPT's interface: ``blocks``, logits out, ``lm_loss``."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = TokenEmbedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_batch(cfg: GPTConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their shift-by-one targets."""
    tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def meta_gpt(cfg: GPTConfig, micro_batch: int) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor], Callable]:
    """A GPT of ``cfg`` built on the meta device (shapes, no values), a micro-batch of ``micro_batch`` sequences
    and the loss: ``mc.trace(*meta_gpt(cfg, b), ...)`` traces it for plans, pricing and search."""
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(micro_batch, cfg.seq_len, dtype=torch.long)
    return model, (x, x), lm_loss


def gpt_params(cfg: GPTConfig) -> int:
    """Parameter count (tied head counted once)."""
    h, v = cfg.hidden, cfg.vocab_size
    per_block = 12 * h * h + 13 * h
    return cfg.layers * per_block + v * h * (1 if cfg.tie_embeddings else 2) + cfg.seq_len * h + 2 * h




# Thesis Table 3-I (sequence length 512): BERT 10B = h 2560, 127 layers, 40 heads, vocab 32008
BERT_10B = GPTConfig(vocab_size=32008, seq_len=512, layers=127, hidden=2560, heads=40, causal=False)
