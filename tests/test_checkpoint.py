"""The checkpoint pass: what it recomputes, where, and what it saves (no process group)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import micscompile as mc
from micscompile.models import GPT, GPTConfig, lm_loss
from micscompile.passes.checkpoint import META_RECOMPUTE, checkpoint_pass
from micscompile.passes.context import make_context
from micscompile.passes.schedule import schedule
from micscompile.predict import planned_groups, step_buffers_of
from micscompile.trace import META_REGION, REGION_BWD

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
    return schedule(tg, rp, None, planned_groups(rp), prefetch=(1,))


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
    assert kinds(ckpt)[mc.Kind.ALL_GATHER] == kinds(base)[mc.Kind.ALL_GATHER]
    # the extra work is forward work done again
    flops = lambda s: sum(a.flops for a in s.program.micro_step)  # noqa: E731
    assert flops(base) < flops(ckpt) < 1.4 * flops(base)


def test_checkpointing_lowers_the_planned_peak_and_selective_sits_between(gpt):
    L = {ck: mc.plan_memory(step_buffers_of(gpt, mc.Plan(partition_size=2, checkpoint=ck), WORLD)).lower_bound_bytes
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


def test_offload_moves_the_checkpointed_outputs_to_host_and_lowers_the_device_peak(gpt):
    from micscompile.lifetimes import on_device

    ckpt = step_buffers_of(gpt, mc.Plan(partition_size=2, checkpoint=True), WORLD)
    off = step_buffers_of(gpt, mc.Plan(partition_size=2, checkpoint=True, offload_activations=True), WORLD)
    host = [b for b in off if b.kind == "host"]
    b, s, h = 4, CFG.seq_len, CFG.hidden
    # one host copy per segment output the backward reads (each block's b x s x h output)
    assert len(host) >= CFG.layers and all(x.size == b * s * h * 4 for x in host[:CFG.layers])
    L = lambda bufs: mc.plan_memory(on_device(bufs)).lower_bound_bytes  # noqa: E731
    assert L(off) < L(ckpt)
    # the same collectives: offload only adds copies
    base = _lowered(gpt, checkpoint=True).program.collective_order()
    assert _lowered(gpt, checkpoint=True, offload_activations=True).program.collective_order() == base
