"""What the GPU path depends on, checked on the CPU: attention traced as the target
device's fused kernel, meta models initialised on the CPU whatever the device, the optimizer
probe run on the compile device."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

import micscompile as mc
from micscompile.core.program import REGION_BWD, REGION_FWD
from micscompile.cost_model.node_cost import activation_bytes
from micscompile.passes.retarget_device import retarget_device
from micscompile.trace import META_FLOPS
from micscompile.zoo.models import GPT, GPTConfig, lm_loss

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class Attention(nn.Module):
    """One attention layer calling SDPA with the options the fused path must carry through."""

    def __init__(self, hidden=32, heads=4, kv_heads=4, mask=False, dropout=0.0, scale=None):
        super().__init__()
        self.heads, self.kv_heads, self.mask, self.dropout, self.scale = heads, kv_heads, mask, dropout, scale
        self.d = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.d)
        self.out = nn.Linear(hidden, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.mask else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, scale=self.scale,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.out(y.transpose(1, 2).reshape(b, s, -1)).mean(1)


def _targets(tg):
    return [n.target for n in tg.gm.graph.nodes if n.op == "call_function"]


def _run_traced(tg, model, batch):
    """The traced graph run on the CPU: (loss, grads)."""
    gm = torch.fx.GraphModule(tg.gm, retarget_device(tg.graph_copy(), torch.device("cpu")))
    params = dict(model.named_parameters())
    loss, *grads = gm(*[params[n] for n in tg.param_names], *dict(model.named_buffers()).values(), *batch)
    return loss, grads


def _eager(model, loss_fn, batch, names):
    model.zero_grad()
    loss = loss_fn(model(batch[0]), *batch[1:])
    loss.backward()
    params = dict(model.named_parameters())
    return loss.detach(), [params[n].grad for n in names]


@pytest.mark.parametrize("kind", ["gpt", "bool-mask+scale", "gqa"])
def test_sdpa_traces_as_the_fused_cpu_kernel_and_matches_eager(kind):
    torch.manual_seed(0)
    if kind == "gpt":
        model, loss_fn = GPT(GPTConfig(vocab_size=64, seq_len=12, layers=2, hidden=32, heads=2)), lm_loss
        x = torch.randint(64, (3, 12))
        batch = (x, x)
    else:
        model = Attention(mask=kind != "gqa", scale=0.3 if kind != "gqa" else None, kv_heads=2 if kind == "gqa" else 4)
        loss_fn = F.cross_entropy
        batch = (torch.randn(3, 16, 32), torch.randint(2, (3,)))
    tg = mc.trace(model, batch, loss_fn, device="cpu")
    targets = _targets(tg)
    # one fused op forward and its backward per layer, no L x S scores or their softmax
    layers = model.cfg.layers if kind == "gpt" else 1
    assert targets.count(CPU_FLASH) == targets.count(CPU_FLASH_BWD) == layers
    assert not {aten._safe_softmax.default, aten._softmax.default, aten._softmax_backward_data.default} & set(targets)
    seq = batch[0].shape[1]
    scores = [n for n in tg.gm.graph.nodes if len(n.meta["mc_shape"] or ()) == 4 and n.meta["mc_shape"][-2:] == (seq, seq)]
    assert not scores
    loss, grads = _run_traced(tg, model, batch)
    ref_loss, ref_grads = _eager(model, loss_fn, batch, tg.trainable)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.hf
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hf_sdpa_attention_traces_fused_and_matches_eager(family):
    hf = pytest.importorskip("transformers")
    from micscompile.zoo import hf_models

    cfg = hf_models.config(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = {"gpt2": hf.GPT2LMHeadModel, "llama": hf.LlamaForCausalLM, "bert": hf.BertForMaskedLM}[family](cfg)
    batch = hf_models.lm_batch(model, 2, 16, torch.Generator().manual_seed(0))
    tg = mc.trace(model, batch, hf_models.lm_loss, device="cpu")
    assert _targets(tg).count(CPU_FLASH) == _targets(tg).count(CPU_FLASH_BWD) == cfg.num_hidden_layers
    loss, grads = _run_traced(tg, model, batch)
    ref_loss, ref_grads = _eager(model, hf_models.lm_loss, batch, tg.trainable)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_sdpa_the_cpu_would_run_as_math_stays_math():
    model = Attention(dropout=0.1)  # CPU flash takes no dropout: eager runs the math path
    tg = mc.trace(model, (torch.randn(2, 8, 32), torch.randint(2, (2,))), F.cross_entropy, device="cpu")
    assert CPU_FLASH not in _targets(tg) and aten._safe_softmax.default in _targets(tg)


def test_fused_attention_flops_and_memory():
    cfg = GPTConfig(vocab_size=64, seq_len=1024, layers=1, hidden=64, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    tg = mc.trace(model, (x, x), lm_loss, device="cpu")
    fwd, bwd = (next(n for n in tg.gm.graph.nodes if n.target == op) for op in (CPU_FLASH, CPU_FLASH_BWD))
    b, h, t, d = 2, cfg.heads, cfg.seq_len, cfg.hidden // cfg.heads
    # causal: only the (query, key) pairs on and below the diagonal, t (t + 1) / 2 of them
    assert fwd.meta[META_FLOPS] == 4 * b * h * (t * (t + 1) // 2) * d and fwd.meta["mc_region"] == REGION_FWD
    assert bwd.meta[META_FLOPS] == 5 * fwd.meta[META_FLOPS] // 2 and bwd.meta["mc_region"] == REGION_BWD
    with torch.device("meta"):
        bidirectional = GPT(dataclasses.replace(cfg, causal=False))  # BERT-style: every pair
    full = next(n for n in mc.trace(bidirectional, (x, x), lm_loss, device="cpu").gm.graph.nodes if n.target == CPU_FLASH)
    assert full.meta[META_FLOPS] == 4 * b * h * t * t * d
    # nothing of T x T lives: the peak is well under one fp32 score matrix per head
    peak = max(activation_bytes(tg.gm.graph).values())
    assert peak < b * h * t * t * 4


def test_cuda_target_records_the_cuda_kernels_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("the rule for a missing GPU is what this checks")
    cfg = GPTConfig(vocab_size=64, seq_len=16, layers=1, hidden=64, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(2, 16, dtype=torch.long)
    fp32 = _targets(mc.trace(model, (x, x), lm_loss, device="cuda"))
    assert {aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_efficient_attention_backward.default} <= set(fp32)
    bf16 = mc.trace(model, (x, x), lm_loss, device="cuda", param_dtype=torch.bfloat16)
    flash = next(n for n in bf16.gm.graph.nodes if n.target == aten._scaled_dot_product_flash_attention.default)
    assert aten._scaled_dot_product_flash_attention_backward.default in _targets(bf16)
    assert flash.meta[META_FLOPS] == 4 * 2 * 2 * (16 * 17 // 2) * 32  # causal: the pairs on and below the diagonal
    masked = _targets(mc.trace(Attention(mask=True), (torch.randn(2, 8, 32), torch.randint(2, (2,))),
                               F.cross_entropy, device="cuda"))  # a mask: memory-efficient (flash takes none)
    assert aten._scaled_dot_product_efficient_attention.default in masked
    with pytest.raises(mc.TraceError, match="'cpu' or 'cuda'"):
        mc.trace(model, (x, x), lm_loss, device="mps")


# ---- meta models are initialised on the CPU, whatever the device ---------------------------------

def _meta_state(device, init_fn=None):
    """local_states of a meta TiedLM + Normalize buffers for one rank of one, from seed 0."""
    from models import Normalize, TiedLM

    from micscompile.core.sharding import build_layouts
    from micscompile.runtime.materialize import local_states

    with torch.device("meta"):
        model = nn.Sequential(TiedLM(), Normalize(3))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    layouts = build_layouts([("all", list(shapes))], shapes, 1)
    torch.manual_seed(0)
    return local_states(model, [tuple(layouts)], 0, torch.device(device), init_fn)[0]


def test_meta_model_is_initialised_on_the_cpu_for_any_device():
    from micscompile.runtime.materialize import default_init

    seen = []

    def init_fn(mod):
        seen.extend(t.device for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)])
        default_init(mod)

    # meta stands in for a GPU here: a device other than the CPU (it holds no values)
    shards, buffers = _meta_state("meta", init_fn)
    assert seen and set(seen) == {torch.device("cpu")}
    assert {t.device for t in [*shards, *buffers.values()]} == {torch.device("meta")}  # copied to the device


def test_meta_model_values_are_the_cpu_initialisation():
    from models import Normalize, TiedLM

    from micscompile.runtime.materialize import initialize

    shards, buffers = _meta_state("cpu")
    reference = nn.Sequential(TiedLM(), Normalize(3))
    torch.manual_seed(0)
    initialize(reference)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.equal(shards[0], expected)
    assert all(torch.equal(buffers[n], b) for n, b in reference.named_buffers())


# ---- the optimizer probe runs on the compile device ----------------------------------------------

class OnlyOn(torch.optim.SGD):
    """SGD that refuses parameters off one device (as fused CUDA kernels or capturable=True do)."""

    def __init__(self, params, device):
        params = list(params)
        wrong = [p.device for p in params if p.device != torch.device(device)]
        if wrong:
            raise RuntimeError(f"OnlyOn({device}) got parameters on {wrong[0]}")
        super().__init__(params, lr=0.1, momentum=0.9)


def test_optimizer_probe_steps_on_the_given_device():
    from micscompile.core.plan import PlanError
    from micscompile.runtime.optim_check import check_elementwise

    check_elementwise(lambda ps: OnlyOn(ps, "cpu"), "cpu")  # accepted where it runs
    seen = []

    def factory(ps):
        seen.extend(p.device for p in ps)
        return OnlyOn(ps, "cpu")

    # meta stands in for a GPU: the probe's tensors are made there, so a CPU-only optimizer is refused
    with pytest.raises(PlanError, match=r"on meta \(RuntimeError: OnlyOn\(cpu\) got parameters on meta"):
        check_elementwise(factory, "meta")
    assert seen == [torch.device("meta")]


# ---- on a GPU (skipped here): docs/gpu.md runs these with `pytest -q tests/test_target_device.py -k cuda` ----

def cuda(test):
    """A GPU check: deselected by default (pyproject's ``-m "not gpu"``); ``pytest -m gpu`` runs it."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@cuda
@pytest.mark.parametrize("kind", ["gpt-fp32", "gpt-bf16", "mask-fp32"])
def test_cuda_sdpa_traces_fused_and_matches_eager(kind):
    from micscompile.cost_model.flops import FLOP_RULES

    torch.manual_seed(0)
    dev = torch.device("cuda")
    if kind.startswith("gpt"):
        model, loss_fn = GPT(GPTConfig(vocab_size=64, seq_len=64, layers=2, hidden=128, heads=2)), lm_loss
        x = torch.randint(64, (3, 64), device=dev)
        batch = (x, x)
    else:
        model, loss_fn = Attention(hidden=64, heads=4, mask=True), F.cross_entropy
        batch = (torch.randn(3, 40, 64, device=dev), torch.randint(2, (3,), device=dev))
    model = model.to(dev, torch.bfloat16 if kind.endswith("bf16") else torch.float32)
    tg = mc.trace(model, batch, loss_fn, device="cuda")
    fused = [t for t in _targets(tg) if t in FLOP_RULES and "attention" in str(t)]
    assert len(fused) == 2 * (2 if kind.startswith("gpt") else 1), _targets(tg)
    assert aten._safe_softmax.default not in _targets(tg)
    gm = torch.fx.GraphModule(tg.gm, retarget_device(tg.graph_copy(), dev))
    params = dict(model.named_parameters())
    loss, *grads = gm(*[params[n] for n in tg.param_names], *dict(model.named_buffers()).values(), *batch)
    ref_loss, ref_grads = _eager(model, loss_fn, batch, tg.trainable)
    tol = dict(rtol=2e-2, atol=2e-2) if kind.endswith("bf16") else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)


@cuda
def test_cuda_rule_used_without_a_gpu_is_what_pytorch_picks():
    from micscompile.trace import _cuda_rule

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the rule describes sm80+")
    for dtype in (torch.float32, torch.bfloat16):
        for d in (64, 128):
            for masked in (False, True):
                q, k, v = (torch.randn(2, 4, 128, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                mask = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril() if masked else None
                picked = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False))
                rule = _cuda_rule(q, k, v, mask)
                # cuDNN where the rule says flash or memory-efficient: another fused kernel of the same cost
                assert picked == rule or (picked == SDPBackend.CUDNN_ATTENTION and rule != SDPBackend.MATH), \
                    (dtype, d, masked, picked, rule)


@cuda
def test_cuda_long_sequence_attention_peak_memory():
    """The figure docs/gpu.md quotes: one attention layer at T=4096 traced fused vs as math."""
    import sys

    trace_mod = sys.modules["micscompile.trace"]
    dev = torch.device("cuda")
    model = Attention(hidden=1024, heads=16).to(dev, torch.bfloat16)
    batch = (torch.randn(1, 4096, 1024, device=dev, dtype=torch.bfloat16), torch.randint(2, (1,), device=dev))
    peaks = {}
    for label in ("fused", "math"):
        with pytest.MonkeyPatch.context() as mp:
            if label == "math":
                mp.setattr(trace_mod._FusedAttention, "fused", lambda self, *a, **k: None)
            tg = mc.trace(model, batch, F.cross_entropy, device="cuda")
        gm = torch.fx.GraphModule(tg.gm, retarget_device(tg.graph_copy(), dev))
        params = dict(model.named_parameters())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        gm(*[params[n] for n in tg.param_names], *batch)
        torch.cuda.synchronize()
        peaks[label] = torch.cuda.max_memory_allocated() - base
    print(f"attention T=4096 bf16 peak above inputs: fused {peaks['fused'] / 2**20:.0f} MiB, "
          f"math {peaks['math'] / 2**20:.0f} MiB")
    assert peaks["fused"] * 4 < peaks["math"]


@cuda
def test_cuda_meta_init_is_the_cpu_init_bitwise():
    torch.cuda.manual_seed(123)  # the CUDA generator must play no part
    on_gpu, _ = _meta_state("cuda")
    on_cpu, _ = _meta_state("cpu")
    assert on_gpu[0].device.type == "cuda" and torch.equal(on_gpu[0].cpu(), on_cpu[0])


@cuda
@pytest.mark.parametrize("kw", [dict(capturable=True), dict(fused=True)])
def test_cuda_only_optimizers_pass_the_probe_on_the_gpu(kw):
    from micscompile.runtime.optim_check import check_elementwise

    check_elementwise(lambda ps: torch.optim.Adam(ps, lr=1e-3, **kw), "cuda")
