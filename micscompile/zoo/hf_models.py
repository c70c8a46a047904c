"""Hugging Face ``transformers`` models, built from a config with random weights (no downloads).

    model = build("llama", "tiny")                    # or "gpt2" (tied embeddings), "bert"
    step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=..., example_inputs=(ids, targets))

What micscompile supports in these models, and what anything else gets:

* training without a KV cache: ``build`` sets ``use_cache=False``; a model that still builds one
  is refused by ``mc.trace`` with a message saying to turn it off;
* dropout: ``build`` sets it to 0 so that runs compare with single-process eager; with it on,
  each rank draws its own masks (as under DDP), and checkpointing refuses it (recomputing a
  random op would draw again);
* the default attention (sdpa: the fused kernel the target device runs, which the cost model prices as
  attention), and the eager path (``attn_implementation="eager"``, plain tensor ops);
* tied input/output embeddings (GPT-2), grouped-query attention and rotary embeddings (Llama),
  learned positions and token types (BERT);
* outputs: a ``ModelOutput`` whose ``logits`` the loss reads (``lm_loss``).

``transformers`` is an optional dependency (the ``dev`` and ``hf`` extras).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from micscompile.core.errors import InputError

FAMILIES = ("gpt2", "llama", "bert")
SIZES = {
    # tiny: the test suite's (seconds on gloo); the rest: published shapes, for plan / simulate
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=128),
    "124m": dict(hidden=768, layers=12, heads=12, kv_heads=12, ffn=3072, vocab=50257),
    "1.5b": dict(hidden=1600, layers=48, heads=25, kv_heads=25, ffn=6400, vocab=50257),
    "7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3-70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}


def config(family: str, size: str = "tiny", *, seq_len: int = 16, attention: str | None = None):
    """The ``transformers`` config of ``family`` at ``size`` (see ``SIZES``), dropout off, no cache;
    ``attention``: the attention implementation ("eager", "sdpa"; None: the library's default, sdpa)."""
    import transformers as hf

    if family not in FAMILIES:
        raise InputError(f"unknown Hugging Face family {family!r}; known: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise InputError(f"unknown size {size!r} for {family}; known: {', '.join(SIZES)}")
    s = SIZES[size]
    cfg = _config(hf, family, s, seq_len)
    if attention is not None:
        cfg._attn_implementation = attention
    return cfg


def _config(hf, family: str, s: dict, seq_len: int):
    if family == "gpt2":
        return hf.GPT2Config(vocab_size=s["vocab"], n_positions=seq_len, n_embd=s["hidden"], n_layer=s["layers"],
                             n_head=s["heads"], n_inner=s["ffn"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0, use_cache=False)
    if family == "llama":
        return hf.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                              num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                              num_key_value_heads=s["kv_heads"], max_position_embeddings=seq_len,
                              use_cache=False)
    return hf.BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         max_position_embeddings=seq_len, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build(family: str, size: str = "tiny", *, seq_len: int = 16, attention: str | None = None) -> nn.Module:
    """A language-model head model (GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM) with random
    weights from the current device and seed (build it under ``torch.device("meta")`` for plans)."""
    import transformers as hf

    cls = {"gpt2": hf.GPT2LMHeadModel, "llama": hf.LlamaForCausalLM, "bert": hf.BertForMaskedLM}
    return cls[family](config(family, size, seq_len=seq_len, attention=attention))


def _tiny(cls_name: str, **fields):
    """A tiny config of ``transformers.<cls_name>`` as the library builds it by default (``use_cache``
    left as it comes), at the test suite's size."""
    def make():
        import transformers as hf

        return getattr(hf, cls_name)(**fields)
    return make


_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
ARCHITECTURES = {
    # name: (tiny config, the param_dtype it trains in: the MoE experts' grouped_mm needs bf16)
    "llama": (_tiny("LlamaConfig", **_DECODER), torch.float32),
    "mistral": (_tiny("MistralConfig", **_DECODER), torch.float32),
    "qwen2": (_tiny("Qwen2Config", **_DECODER), torch.float32),
    "qwen3": (_tiny("Qwen3Config", **_DECODER, head_dim=16), torch.float32),
    "gemma2": (_tiny("Gemma2Config", **_DECODER, head_dim=16), torch.float32),
    "gemma3": (_tiny("Gemma3TextConfig", **_DECODER, head_dim=16), torch.float32),
    "phi3": (_tiny("Phi3Config", **{**_DECODER, "num_key_value_heads": 4}, pad_token_id=0, bos_token_id=0,
                   eos_token_id=0), torch.float32),  # (Phi-3-mini's: as many K/V heads as heads)
    "olmo2": (_tiny("Olmo2Config", **_DECODER, pad_token_id=0, bos_token_id=0, eos_token_id=0), torch.float32),
    "granite": (_tiny("GraniteConfig", **_DECODER), torch.float32),
    "stablelm": (_tiny("StableLmConfig", **_DECODER, bos_token_id=0, eos_token_id=0), torch.float32),
    "starcoder2": (_tiny("Starcoder2Config", **_DECODER, bos_token_id=0, eos_token_id=0), torch.float32),
    "gpt2": (_tiny("GPT2Config", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0, bos_token_id=0,
                   eos_token_id=0), torch.float32),
    "opt": (_tiny("OPTConfig", vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0),
            torch.float32),
    "bloom": (_tiny("BloomConfig", vocab_size=128, hidden_size=64, n_layer=2, n_head=4), torch.float32),
    "gpt_neox": (_tiny("GPTNeoXConfig", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64), torch.float32),
    "falcon": (_tiny("FalconConfig", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_kv_heads=2), torch.float32),
    "mixtral": (_tiny("MixtralConfig", **_DECODER, num_local_experts=4, num_experts_per_tok=2), torch.bfloat16),
    "qwen3_moe": (_tiny("Qwen3MoeConfig", **_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64), torch.bfloat16),
}
"""More architectures, tiny, built from their default configs (``build_architecture``) and default attention
(sdpa): the Hugging Face tables (``examples/hf_table.py``) train each, with and without tensor parallelism."""
DENSE_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "stablelm",
                  "starcoder2", "gpt_neox", "gpt2", "opt", "bloom")
"""The decoders tensor parallelism splits (docs/tensor-parallel.md's table)."""


def build_architecture(name: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``ARCHITECTURES[name]``'s tiny config, random weights."""
    import transformers as hf

    return hf.AutoModelForCausalLM.from_config(ARCHITECTURES[name][0]())


def lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of a ``transformers`` output's logits against ``targets``."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_batch(model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets for ``model``'s vocabulary."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    return ids, torch.randint(0, vocab, (batch, seq_len), generator=generator)
