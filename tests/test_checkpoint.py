"""The checkpoint pass: what it recomputes, where, and what it saves (no process group)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import micscompile as mc
from micscompile.core.program import REGION_BWD
from micscompile.lowering.flat import lower_flat
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.predict import step_buffers_of
from micscompile.passes.checkpoint import META_RECOMPUTE, checkpoint_pass
from micscompile.passes.context import make_context
from micscompile.trace import META_REGION
from micscompile.zoo.models import GPT, GPTConfig, lm_loss

WORLD = 4
CFG = GPTConfig(vocab_size=512, seq_len=128, layers=4, hidden=128, heads=4)


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(CFG)
    x = torch.zeros(4, CFG.seq_len, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss)


def _lowered(tg, **plan):
    rp = mc.Plan(partition_size=2, **plan).resolve(WORLD)
    return lower_flat(tg, rp, None, planned_groups(rp), prefetch=(1,))


def test_no_checkpoint_is_a_no_op(gpt):
    ctx = make_context(gpt, mc.Plan(partition_size=2).resolve(WORLD))
    graph = gpt.graph_copy()
    before = [n.format_node() for n in graph.nodes]
    assert [n.format_node() for n in checkpoint_pass(graph, ctx).nodes] == before


def test_recomputation_sits_in_backward_before_its_block_and_reuses_the_backward_gather(gpt):
    base, ckpt = _lowered(gpt), _lowered(gpt, checkpoint=True)
    copies = [n for n in ckpt.graph.nodes if n.meta.get(META_RECOMPUTE)]
    assert copies and all(n.meta[META_REGION] == REGION_BWD for n in copies)
    # every transformer block is recomputed (its forward ops copied), the loss is not
    blocks = Counter(n.meta.get("mc_fqn", "").split(".")[1] for n in copies if n.meta.get("mc_fqn", "").startswith("blocks."))
    assert set(blocks) == {str(i) for i in range(CFG.layers)}
    # no extra gather: the recomputation runs inside the block's backward use interval
    kinds = lambda s: Counter(a.kind for a in s.program.micro_step)  # noqa: E731
    assert kinds(ckpt)[mc.ir.Kind.ALL_GATHER] == kinds(base)[mc.ir.Kind.ALL_GATHER]
    # the extra work is forward work done again
    flops = lambda s: sum(a.flops for a in s.program.micro_step)  # noqa: E731
    assert flops(base) < flops(ckpt) < 1.4 * flops(base)


def test_checkpointing_lowers_the_planned_peak_and_selective_sits_between(gpt):
    L = {ck: mc.ir.plan_memory(step_buffers_of(gpt, mc.Plan(partition_size=2, checkpoint=ck), WORLD)).lower_bound_bytes
         for ck in (False, "selective", True)}
    assert L[True] < L["selective"] < L[False], L
    # without checkpointing every block keeps its activations until its backward; with it only the
    # block outputs (b*s*h per block) survive the forward: most of the saved bytes go
    b, s, h = 4, CFG.seq_len, CFG.hidden
    assert L[False] - L[True] > CFG.layers * (10 * b * s * h * 4 - b * s * h * 4), L


def test_random_ops_are_refused(gpt):
    class Dropping(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))])

        def forward(self, x):
            return self.blocks[0](x).sum(-1)

    model = Dropping()
    tg = mc.trace(model, (torch.zeros(4, 8), torch.zeros(4)), nn.functional.mse_loss)
    with pytest.raises(mc.PlanError, match="random op"):
        _lowered(tg, checkpoint=True)


# activation-heavy: long sequences, a narrow model, bf16 (what checkpointing and offload are for)
DEEP = GPTConfig(vocab_size=256, seq_len=256, layers=8, hidden=64, heads=4)
DEEP_BATCH = 8
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def deep_bf16():
    with torch.device("meta"):
        model = GPT(DEEP)
    x = torch.zeros(DEEP_BATCH, DEEP.seq_len, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss, param_dtype=BF16)


def _device_buffers(tg, **plan):
    from micscompile.memory.lifetimes import on_device

    return on_device(step_buffers_of(tg, mc.Plan(partition_size=2, param_dtype=BF16, **plan), WORLD))


def _peak(buffers) -> int:
    return mc.ir.plan_memory(buffers).lower_bound_bytes


def test_planned_peak_falls_by_the_activations_the_formula_says_checkpointing_drops(deep_bf16):
    """docs/design.md: a checkpointed layer keeps b*s*h*2 bytes; without checkpointing it keeps
    32 sbh 16-bit bytes plus the fused attention's log-sum-exp (Korthikanti et al., dropout-free,
    no probabilities kept: ``activation_bytes_per_layer``). All layers' activations are live at the
    end of forward without checkpointing; with it, every layer's input and one layer's recomputed
    activations at a time: the planned peak falls by at least (layers - 1) * full - layers * kept."""
    b, s, h, a, layers = DEEP_BATCH, DEEP.seq_len, DEEP.hidden, DEEP.heads, DEEP.layers
    full = mc.activation_bytes_per_layer(b, s, h, a, itemsize=2)
    kept = mc.activation_bytes_per_layer(b, s, h, a, itemsize=2, checkpoint=True)
    no, ckpt = _peak(_device_buffers(deep_bf16)), _peak(_device_buffers(deep_bf16, checkpoint=True))
    assert no - ckpt >= (layers - 1) * full - layers * kept, (no, ckpt, (layers - 1) * full - layers * kept)


def test_offload_moves_the_checkpointed_outputs_to_host_and_lowers_the_device_peak(deep_bf16):
    """The checkpointed outputs (docs/design.md's b*s*h*2 bytes per layer) go to host memory: the
    device keeps at most two of them (the one its backward reads and the one reloaded ahead), so
    the peak of saved activations falls by the other layers' outputs, and the planned peak falls."""
    ckpt = _device_buffers(deep_bf16, checkpoint=True)
    off = step_buffers_of(deep_bf16, mc.Plan(partition_size=2, param_dtype=BF16, checkpoint=True,
                                             offload_activations=True), WORLD)
    kept = mc.activation_bytes_per_layer(DEEP_BATCH, DEEP.seq_len, DEEP.hidden, DEEP.heads, checkpoint=True)
    host = [x for x in off if x.kind == "host"]
    # one host copy per segment output the backward reads (each block's b x s x h output)
    assert len(host) >= DEEP.layers - 1 and all(x.size == kept for x in host[:DEEP.layers - 1])
    off = [x for x in off if x.kind != "host"]
    saved = lambda bufs: _peak([x for x in bufs if x.kind == "activation"])  # noqa: E731
    assert saved(ckpt) - saved(off) >= (DEEP.layers - 2) * kept, (saved(ckpt), saved(off), kept)
    assert _peak(off) < _peak(ckpt)
    # reloads are issued in reverse forward order, each one segment before its wait
    reloads = [x for x in off if x.name.startswith("reload_issue")]
    assert len(reloads) == len(host)
    assert max(sum(1 for r in reloads if r.start <= t < r.end) for t in range(max(r.end for r in reloads))) == 2
    # the same collectives: offload only adds copies
    base = _lowered(deep_bf16, checkpoint=True, param_dtype=BF16).program.collective_order()
    assert _lowered(deep_bf16, checkpoint=True, offload_activations=True, param_dtype=BF16).program.collective_order() == base


def test_no_arena_slot_is_reused_while_an_offload_copy_may_read_it(deep_bf16):
    """On CUDA the offload copy reads its value on a side stream; the compute stream waits for it at
    ``offload_done`` (the next offload, the last at the end of forward). The value's buffer (an arena
    slot: ``out=`` written) must stay planned until there, so no later op is given its bytes. The
    lifetimes check it: a done that no longer holds the value fails the plan."""
    from micscompile.passes.offload import offload, offload_done

    lowered = _lowered(deep_bf16, checkpoint=True, offload_activations=True, param_dtype=BF16)
    buffers = lowered.rewrite_for_runtime(arena=True)
    nodes = [n for n in lowered.graph.nodes if n.op in ("call_function", "placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    done = [n for n in nodes if n.target is offload_done]
    assert len(done) == sum(n.target is offload for n in nodes) >= DEEP.layers - 1
    assert all(n.meta[META_REGION] != REGION_BWD for n in done)  # the forward waits, not the backward
    first = {}  # micro-step 0's buffer of each offloaded value
    for b in buffers:
        first.setdefault(b.name, b)
    in_arena = [n for n in done if "out" in n.args[1].args[1].kwargs]  # written out= into an arena slot
    assert len(in_arena) >= DEEP.layers - 2
    for n in in_arena:
        slot = first[n.args[1].args[1].kwargs["out"].args[1]]
        assert slot.name.startswith("out:") and slot.end > index[n], (slot, index[n])
    for n in done:  # without the value as an argument, its slot would be free at the offload
        n.args = n.args[:2]
    with pytest.raises(ValueError, match="while its offload copy may read it"):
        lowered.rewrite_for_runtime(arena=True)


def test_offload_waits_follow_the_offloads_order_when_two_values_die_at_one_node():
    """A skip connection: v1 and v2 both last used by add(v1, v2), so their offloads stand side by
    side in the order of insertion, not of the values. Each copy's wait must still come after its
    own offload (the graph lints) and before the next offload."""
    from types import SimpleNamespace

    import torch.fx

    from micscompile.core.program import REGION_FWD
    from micscompile.passes.offload import META_OFFLOAD, offload, offload_done, offload_pass

    g = torch.fx.Graph()
    g.placeholder("comm")
    x = g.placeholder("x")
    v1 = g.call_function(torch.ops.aten.relu.default, (x,))
    v2 = g.call_function(torch.ops.aten.neg.default, (v1,))
    s = g.call_function(torch.ops.aten.add.Tensor, (v1, v2))
    b1 = g.call_function(torch.ops.aten.mul.Tensor, (s, v2))
    b2 = g.call_function(torch.ops.aten.mul.Tensor, (b1, v1))
    g.output((s, b2))
    for n, region in ((v1, REGION_FWD), (v2, REGION_FWD), (s, REGION_FWD), (b1, REGION_BWD), (b2, REGION_BWD)):
        n.meta[META_REGION] = region
    v1.meta[META_OFFLOAD] = v2.meta[META_OFFLOAD] = True
    ctx = SimpleNamespace(plan=SimpleNamespace(plan=SimpleNamespace(offload_activations=True)))
    offload_pass(g, ctx)  # lints
    nodes = list(g.nodes)
    offs = [n for n in nodes if n.target is offload]
    done = [n for n in nodes if n.target is offload_done]
    assert len(offs) == len(done) == 2
    for d in done:
        assert nodes.index(d.args[1]) < nodes.index(d)
    assert nodes.index(done[0]) < nodes.index(offs[1])  # the first copy is waited at the second offload


@pytest.mark.hf
def test_attention_recomputation_drops_exactly_the_attention_probabilities(gpt):
    """checkpoint="attention" (Korthikanti et al.'s selective recomputation): with eager attention (Hugging
    Face GPT-2) one layer's saved activations fall by its probabilities, b a s^2 16-bit values, and nothing
    else; the recomputation is the scores and the softmax, in backward. The zoo GPT's fused attention keeps
    no sequence x sequence value: nothing changes."""
    import transformers as hf

    from micscompile.zoo import hf_models

    b, s = 2, 32

    def saved(layers: int, checkpoint) -> tuple[int, int]:
        cfg = hf_models.config("gpt2", seq_len=s, attention="eager")
        cfg.n_layer = layers
        with torch.device("meta"):
            model = hf.GPT2LMHeadModel(cfg)
        batch = hf_models.lm_batch(model, b, s, torch.Generator().manual_seed(1))
        tg = mc.trace(model, batch, hf_models.lm_loss, param_dtype=BF16)
        bufs = step_buffers_of(tg, mc.Plan(partition_size=1, param_dtype=BF16, checkpoint=checkpoint), 1)
        return mc.ir.plan_memory([x for x in bufs if x.kind == "activation"]).lower_bound_bytes, cfg.n_head

    (full3, heads), (full2, _) = saved(3, False), saved(2, False)
    attn3, attn2 = saved(3, "attention")[0], saved(2, "attention")[0]
    assert (full3 - full2) - (attn3 - attn2) == b * heads * s * s * 2
    assert not any(n.meta.get(META_RECOMPUTE) for n in _lowered(gpt, checkpoint="attention").graph.nodes)
