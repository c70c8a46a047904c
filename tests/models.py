"""Tiny models for the parity suite. Sizes are chosen so that p in {2, 4} needs padding."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLPBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 3 * h)
        self.fc2 = nn.Linear(3 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TiedLM(nn.Module):
    """Embedding -> 2 residual MLP blocks -> LayerNorm -> head tied to the embedding."""

    def __init__(self, vocab: int = 29, h: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(MLPBlock(h) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Normalize(nn.Module):
    """Fixed per-channel input normalisation held in buffers (set by reset_parameters)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.empty(channels, 1))
        self.register_buffer("inv_std", torch.empty(channels, 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.mean.copy_(torch.linspace(-0.5, 0.5, self.mean.shape[0]).unsqueeze(1))
            self.inv_std.copy_(torch.linspace(0.8, 1.2, self.inv_std.shape[0]).unsqueeze(1))

    def forward(self, x):
        return (x - self.mean) * self.inv_std


class ConvNet(nn.Module):
    """Buffers + Conv1d + Linear; every block re-reads its weight in backward."""

    def __init__(self, channels: int = 3, length: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.norm = Normalize(channels)
        self.conv1 = nn.Conv1d(channels, 6, 3, padding=1)
        self.conv2 = nn.Conv1d(6, 7, 3, padding=1)
        self.fc = nn.Linear(7 * length, classes)

    def forward(self, x):
        x = F.gelu(self.conv1(self.norm(x)))
        x = F.gelu(self.conv2(x))
        return self.fc(x.flatten(1))


class Quirky(nn.Module):
    """What eager handles implicitly: a parameter only the loss reads (``temp``), a parameter
    nothing reads (``unused``), in-place ops on activations."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)
        self.unused = nn.Linear(3, 3)
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = self.fc1(x) * 2
        h += 0.5  # in place on an activation whose producer's backward does not need it
        return self.fc2(F.relu(h, inplace=True))


def quirky_loss(model: Quirky):
    return lambda out, y: F.cross_entropy(out * model.temp, y)


def quirky_batches(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(4, (batch,), generator=g)) for _ in range(steps)]


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def meta_lm_trace(vocab: int, h: int, layers: int, batch: int, seq: int):
    """``mc.trace`` of a TiedLM built on the meta device (no values: shapes and costs only)."""
    import micscompile as mc

    with torch.device("meta"):
        model = TiedLM(vocab=vocab, h=h, layers=layers)
    x = torch.zeros(batch, seq, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss)


def cls_loss(out, y):
    return F.cross_entropy(out, y)


def lm_batches(steps: int, batch: int, seq: int = 6, vocab: int = 29, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def conv_batches(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, generator=g), torch.randint(5, (batch,), generator=g)) for _ in range(steps)]


MODELS = {  # name: (model class, model -> loss_fn, batches)
    "tied_lm": (TiedLM, lambda model: lm_loss, lm_batches),
    "convnet": (ConvNet, lambda model: cls_loss, conv_batches),
    "quirky": (Quirky, quirky_loss, quirky_batches),
}


class Branchy(ConvNet):
    """A ConvNet whose forward branches on a tensor's value: Dynamo breaks the graph there."""

    def forward(self, x):
        h = super().forward(x)
        if h.mean() > 0:  # a data-dependent jump: Dynamo's graph break
            h = h * 2
        return h


class Affine(nn.Module):
    """A fixed per-feature affine map held in buffers (``reset_parameters`` sets them: meta-ready)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(h))
        self.register_buffer("shift", torch.empty(h))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.7, 1.3, self.scale.shape[0]))
            self.shift.copy_(torch.linspace(-0.2, 0.2, self.shift.shape[0]))

    def forward(self, x):
        return x * self.scale + self.shift


class RandomBlock(nn.Module):
    """One block of a ``RandomNet``: ``kind`` is one of RandomNet.KINDS."""

    def __init__(self, kind: str, h: int, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 2 * h + 1), nn.Linear(2 * h + 1, h)
        elif kind == "shared":  # the weight of an earlier block, read again here (one parameter, two uses)
            self.fc = shared
        elif kind == "buffer":
            self.fc, self.affine = nn.Linear(h, h), Affine(h)
        elif kind == "unused":  # a parameter nothing reads
            self.fc = nn.Linear(h, h)
            self.spare = nn.Parameter(torch.empty(3, h))
            self.reset_parameters()
        else:  # "linear", "inplace"
            self.fc = nn.Linear(h, h)

    def reset_parameters(self) -> None:  # this block's own tensors only (its children reset theirs)
        if "spare" in self._parameters:
            with torch.no_grad():
                self.spare.normal_()

    def forward(self, x):
        if self.kind == "mlp":
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.kind == "buffer":
            return F.silu(self.affine(self.fc(x)))
        if self.kind == "inplace":  # in-place ops on a fresh activation
            h = self.fc(x)
            h.mul_(0.5)
            return F.relu(h, inplace=True) + x
        return torch.tanh(self.fc(x))  # "linear", "shared", "unused"


class RandomNet(nn.Module):
    """A graph drawn from ``seed`` for the plan fuzzer: odd sizes, 2-6 blocks of RandomNet.KINDS (an MLP,
    a weight shared with an earlier block, buffers, an unused parameter, in-place ops), skip connections
    from an earlier block's output, one or two inputs (the second joins mid-way), a classification head.
    ``forward(x[, x2])`` returns logits over ``self.classes``."""

    KINDS = ("mlp", "linear", "shared", "buffer", "unused", "inplace")

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        import random

        rng = random.Random(seed)
        self.d_in, h, self.classes = rng.choice([5, 6, 7, 9]), rng.choice([6, 7, 10, 11, 13]), rng.choice([3, 4, 5])
        self.inputs = rng.choice([1, 1, 2])
        self.inp = nn.Linear(self.d_in, h)
        self.inp2 = nn.Linear(3, h, bias=False) if self.inputs == 2 else None
        blocks: list[RandomBlock] = []
        for _ in range(rng.randint(2, 6)):
            linear = [b.fc for b in blocks if hasattr(b, "fc")]
            kind = rng.choice([k for k in self.KINDS if k != "shared" or linear])
            blocks.append(RandomBlock(kind, h, rng.choice(linear) if kind == "shared" else None))
        self.blocks = nn.ModuleList(blocks)
        self.skips = {i: rng.randrange(i - 1) for i in range(2, len(blocks)) if rng.random() < 0.4}
        """block i adds the output of block skips[i] (< i - 1) to its input"""
        self.join = rng.randrange(len(blocks)) if self.inputs == 2 else None
        self.head = nn.Linear(h, self.classes)

    def forward(self, x, x2=None):
        h = self.inp(x)
        outs = []
        for i, block in enumerate(self.blocks):
            if i == self.join:
                h = h + self.inp2(x2)
            if i in self.skips:
                h = h + outs[self.skips[i]]
            h = block(h)
            outs.append(h)
        return self.head(h)

    def batches(self, steps: int, batch: int, seed: int = 0, padded: bool = False):
        """(x[, x2], y) per step; ``padded``: about a quarter of the targets are -100 (ignored)."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(steps):
            xs = (torch.randn(batch, self.d_in, generator=g),)
            xs += (torch.randn(batch, 3, generator=g),) if self.inputs == 2 else ()
            y = torch.randint(self.classes, (batch,), generator=g)
            if padded:
                y = torch.where(torch.rand(batch, generator=g) < 0.25, -100, y)
            out.append((*xs, y))
        return out


class OutsideRMSNorm(nn.Module):
    """RMSNorm as many repositories write it: the weight multiplies first, the statistics after."""

    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class OutsideLlamaBlock(nn.Module):
    """A Llama-style block written outside this project: separate q, k, v Linears, grouped K/V heads,
    rotary positions by slice and cat, ``F.scaled_dot_product_attention``, SwiGLU."""

    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.norm1, self.norm2 = OutsideRMSNorm(h), OutsideRMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class OutsideLlama(nn.Module):
    def __init__(self, vocab: int = 64, h: int = 32, heads: int = 4, kv_heads: int = 4, ffn: int = 64,
                 layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(OutsideLlamaBlock(h, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = OutsideRMSNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        hd = h // heads
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32),
                            1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        return self.head(self.norm(x))
