"""Small reference models used by the examples, benchmarks and tests."""

from __future__ import annotations

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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_batch(cfg: GPTConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their shift-by-one targets."""
    tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_params(cfg: GPTConfig) -> int:
    """Parameter count (tied head counted once)."""
    h, v = cfg.hidden, cfg.vocab_size
    per_block = 12 * h * h + 13 * h
    return cfg.layers * per_block + v * h * (1 if cfg.tie_embeddings else 2) + cfg.seq_len * h + 2 * h




# Thesis Table 3-I (sequence length 512): BERT 10B = h 2560, 127 layers, 40 heads, vocab 32008
BERT_10B = GPTConfig(vocab_size=32008, seq_len=512, layers=127, hidden=2560, heads=40, causal=False)
