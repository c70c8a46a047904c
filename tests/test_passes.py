"""insert_collectives and the pass runner on small traced graphs (no process group)."""

from collections import Counter

import pytest
import torch
import torch.fx
from models import ConvNet, TiedLM, cls_loss, lm_loss

import micscompile as mc
from micscompile.core import collectives as C
from micscompile.core.collectives import GroupInfo
from micscompile.core.program import Kind
from micscompile.core.sharding import unpack_param
from micscompile.lowering.build import build_program
from micscompile.passes.context import make_context
from micscompile.passes.insert_collectives import META_BUCKET, insert_collectives_pass
from micscompile.passes.manager import build_pass_list, run_passes
from micscompile.trace import META_REGION


def lm_trace():
    with torch.device("meta"):
        model = TiedLM()
    x = torch.zeros(4, 6, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss)


def rewrite(tg, p: int, **plan):
    ctx = make_context(tg, mc.Plan(partition_size=p, **plan).resolve(4))
    return insert_collectives_pass(tg.graph_copy(), ctx), ctx


def targets(graph) -> Counter:
    return Counter(n.target for n in graph.nodes if n.op == "call_function")


def test_counts_for_tied_lm():
    graph, ctx = rewrite(lm_trace(), 2)
    t = targets(graph)
    # 4 buckets (emb, blocks.0, blocks.1, ln); emb has 3 use intervals, the others 2
    assert [lay.name for lay in ctx.layouts] == ["emb", "blocks.0", "blocks.1", "ln"]
    assert t[C.all_gather_issue] == 9 and t[C.release] == 9
    assert t[C.reduce_scatter_issue] == 4
    assert t[C.collective_wait] == 9 + 4
    graph.lint()


def test_signature_is_comm_shards_buffers_inputs():
    graph, ctx = rewrite(lm_trace(), 2)
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    assert names[:5] == ["comm", "shard_0", "shard_1", "shard_2", "shard_3"] and len(names) == 7
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    assert len(out) == 1  # a flat graph outputs the loss: it accumulates its gradients itself


def test_each_reduced_shard_is_accumulated_then_its_second_hop_started():
    """Right after each reduce-scatter's wait: its accumulation, then (d = 2) its second hop; every
    bucket once, in the order the backward finishes them, the last before the output."""
    graph, ctx = rewrite(lm_trace(), 2)  # n = 4, p = 2: d = 2
    nodes = list(graph.nodes)
    waits = [i for i, n in enumerate(nodes) if n.target is C.collective_wait
             and n.args[1].target is C.reduce_scatter_issue]
    assert len(waits) == len(ctx.layouts)
    for i in waits:
        acc, hop = nodes[i + 1], nodes[i + 2]
        assert acc.target is C.accumulate and acc.args[2] is nodes[i]
        assert hop.target is C.second_hop and hop.args[1] == acc.args[1] == nodes[i].args[1].args[1]
    assert nodes[waits[-1] + 3].op == "output"
    one, _ = rewrite(lm_trace(), 4)  # p = n: no replicas, no second hop
    assert targets(one)[C.second_hop] == 0 and targets(one)[C.accumulate] == len(ctx.layouts)


def test_gathered_parameters_never_outlive_their_interval():
    """Every use of an unpacked parameter is in its interval's phase and before its release."""
    graph, _ = rewrite(lm_trace(), 4)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for rel in (n for n in graph.nodes if n.target is C.release):
        for unpacked in rel.args[2:]:
            assert unpacked.target is unpack_param
            users = [u for u in unpacked.users if u is not rel]
            assert users and all(order[u] < order[rel] for u in users)
            # the interval does not straddle forward and backward
            assert {u.meta[META_REGION] for u in users} == {unpacked.meta[META_REGION]}


def test_prefetch_issues_next_gather_right_after_previous_wait():
    graph, _ = rewrite(lm_trace(), 2)
    nodes = list(graph.nodes)
    waits = [i for i, n in enumerate(nodes) if n.target is C.collective_wait and n.args[1].target is C.all_gather_issue]
    for w in waits[:-1]:
        assert nodes[w + 1].target is C.all_gather_issue


def test_p1_is_plain_data_parallel_no_gathers():
    graph, ctx = rewrite(lm_trace(), 1)
    t = targets(graph)
    assert t[C.all_gather_issue] == t[C.release] == t[C.reduce_scatter_issue] == 0
    assert t[C.accumulate_local] == t[C.second_hop] == 1 and t[C.accumulate] == 0
    assert [lay.name for lay in ctx.layouts] == ["emb+blocks.0+blocks.1+ln"]  # DDP's 25 MiB buckets by default
    per_block, ctx = rewrite(lm_trace(), 1, bucket_bytes=1)
    assert len(ctx.layouts) == targets(per_block)[C.accumulate_local] == 4


def test_every_step_all_reduces_instead_of_reduce_scatter():
    graph, _ = rewrite(lm_trace(), 2, grad_sync="every_step")
    t = targets(graph)
    assert t[C.all_reduce_issue] == 4 and t[C.reduce_scatter_issue] == 0


def test_bucket_bytes_merges_consecutive_blocks():
    tg = lm_trace()
    _, ctx = rewrite(tg, 2, bucket_bytes=10**9)
    assert len(ctx.layouts) == 1
    assert ctx.layouts[0].name == "emb+blocks.0+blocks.1+ln"
    graph, _ = rewrite(tg, 2, bucket_bytes=10**9)
    assert all(n.meta[META_BUCKET] == 0 for n in graph.nodes if n.target is C.all_gather_issue)


def test_program_lowering_and_peak():
    tg = lm_trace()
    graph, ctx = rewrite(tg, 2)
    rp = ctx.plan
    groups = {g: GroupInfo(g, None, r, 0, False) for g, r in
              [("shard", (0, 1)), ("replicate", (0, 2)), ("world", (0, 1, 2, 3))]}
    prog = build_program(graph, rp, ctx.layouts, groups, rank=0)
    kinds = Counter(a.kind for a in prog.micro_step)
    assert kinds[Kind.ALL_GATHER] == 9 and kinds[Kind.REDUCE_SCATTER] == 4 and kinds[Kind.WAIT] == 13
    assert kinds[Kind.SECOND_HOP] == 4
    g2, ctx2 = rewrite(tg, 2, micro_batches=2)
    two = build_program(g2, ctx2.plan, ctx2.layouts, groups, rank=0)  # the second hop: last micro-step only
    assert [sum(a.kind is Kind.SECOND_HOP for a in two.issued_in(mb)) for mb in (0, 1)] == [0, 4]
    assert [str(a) for a in prog.boundary] == ["ARL", "W:SH3", "W:SH2", "W:SH1", "W:SH0", "OPT"]
    prog.validate()
    # with one-ahead prefetch at most two buckets are gathered at once
    sizes = sorted((lay.full_bytes for lay in ctx.layouts), reverse=True)
    assert sizes[0] <= prog.peak_gathered_bytes <= sizes[0] + sizes[1]
    assert prog.fingerprint() == build_program(rewrite(tg, 2)[0], rp, ctx.layouts, groups, 0).fingerprint()


def test_runner_times_lints_and_disables():
    tg = lm_trace()
    ctx = make_context(tg, mc.Plan(partition_size=2).resolve(4))
    logged = []
    out, records = run_passes(tg.graph_copy(), ctx, build_pass_list(ctx.plan.plan), log=logged.append)
    assert [r.name for r in records] == ["retarget_device", "insert_collectives"]
    assert records[0].op_delta == {}  # TiedLM creates no tensors: nothing to retarget
    assert records[1].op_delta["all_gather_issue"] == 9
    assert len(logged) == 4 and "all_gather_issue" in logged[3]
    _, only = run_passes(tg.graph_copy(), ctx, build_pass_list(ctx.plan.plan), disable=["insert_collectives"])
    assert [r.name for r in only] == ["retarget_device"]
    with pytest.raises(ValueError, match="unknown passes"):
        run_passes(tg.graph_copy(), ctx, build_pass_list(ctx.plan.plan), disable=["nope"])


def test_first_layer_weight_is_not_regathered_when_backward_does_not_read_it():
    """A Linear whose input needs no gradient never reads its weight in backward."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    tg = mc.trace(model, (torch.zeros(2, 4), torch.zeros(2, 3)), torch.nn.functional.mse_loss)
    graph, _ = rewrite(tg, 2)
    per_bucket = Counter(n.args[1] for n in graph.nodes if n.target is C.all_gather_issue)
    assert per_bucket == {0: 1, 1: 2}  # bucket '0' (first Linear) forward only; '2' forward + backward


def test_convnet_every_bucket_regathered_in_backward():
    tg = mc.trace(ConvNet(), (torch.zeros(4, 3, 8), torch.zeros(4, dtype=torch.long)), cls_loss)
    graph, ctx = rewrite(tg, 2)
    assert Counter(n.args[1] for n in graph.nodes if n.target is C.all_gather_issue) == {0: 2, 1: 2, 2: 2}


def test_retarget_device_moves_factory_ops_off_meta():
    from micscompile.passes.retarget_device import retarget_device_pass

    class Positions(torch.nn.Module):  # builds a tensor on its input's device, as a causal mask would
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x + torch.arange(x.shape[-1], device=x.device)).squeeze(-1)

    with torch.device("meta"):
        model = Positions()
    tg = mc.trace(model, (torch.zeros(2, 8), torch.zeros(2)), torch.nn.functional.mse_loss)

    def devices(graph):
        return [a for n in graph.nodes for a in [*n.args, *n.kwargs.values()] if isinstance(a, torch.device)]

    assert torch.device("meta") in devices(tg.gm.graph)  # the positions are built on meta
    ctx = make_context(tg, mc.Plan(partition_size=1).resolve(1), torch.device("cpu"))
    graph = retarget_device_pass(tg.graph_copy(), ctx)
    assert devices(graph) and set(devices(graph)) == {torch.device("cpu")}


def test_random_ops_on_parameters_are_not_redrawn_per_interval():
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            w = self.b.weight + 0.3 * torch.randn_like(self.b.weight)  # weight noise
            return torch.nn.functional.linear(self.a(x), w, self.b.bias)

    tg = mc.trace(Noisy(), (torch.zeros(2, 4), torch.zeros(2, 4)), torch.nn.functional.mse_loss)
    graph, _ = rewrite(tg, 2)
    draws = [n for n in graph.nodes if n.target == torch.ops.aten.randn_like.default]
    assert len(draws) == 1  # drawn once, shared by forward and backward


def test_unused_parameter_gets_no_reduction():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["used"](x)

    tg = mc.trace(Wrap(), (torch.zeros(2, 4), torch.zeros(2, 4)), torch.nn.functional.mse_loss)
    assert tg.unused_params == {"m.unused.weight", "m.unused.bias"}
    graph, ctx = rewrite(tg, 2)
    assert sum(1 for n in graph.nodes if n.target is C.reduce_scatter_issue) == 1


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


class _Body(torch.nn.Module):  # a wrapper as Hugging Face models have (GPT2Model, LlamaModel)
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))
        self.norm = torch.nn.LayerNorm(4)


def test_layers_under_a_wrapper_are_blocks():
    from micscompile.trace import find_blocks

    model = torch.nn.Module()
    model.body, model.head = _Body(), torch.nn.Linear(4, 5)
    # each layer's Sequential(Linear, GELU, Linear) holds leaves: not a layer stack, the layer stays a block
    assert find_blocks(model) == ["body.emb", "body.layers.0", "body.layers.1", "body.layers.2", "body.norm", "head"]


def test_fold_transposes_drops_transposes_of_transposes_and_keeps_values():
    """A traced linear's backward reads its weight as ``t(t(w))``: the runtime graph reads ``w`` and
    drops both transposes where nothing else uses the inner one (bench_peers' GPT: 102 -> 34 ``t``
    dispatches per micro-step, docs/gpu.md); an inner ``t`` still used elsewhere stays."""
    from micscompile.passes.fold_transposes import fold_transposes_pass
    from micscompile.passes.manager import runtime_pass_list

    t = torch.ops.aten.t.default
    g = torch.fx.Graph()
    w, x, v = g.placeholder("w"), g.placeholder("x"), g.placeholder("v")
    tw = g.call_function(t, (w,))
    y = g.call_function(torch.ops.aten.mm.default, (x, tw))  # the forward's t(w) has another user: kept
    dx = g.call_function(torch.ops.aten.mm.default, (y, g.call_function(t, (tw,))))
    tv = g.call_function(t, (g.call_function(t, (v,)),))  # used only by the outer t: both go
    g.output((y, dx, g.call_function(torch.ops.aten.add.Tensor, (tv, v))))
    ts = lambda: sum(n.target is t for n in g.nodes)  # noqa: E731
    assert ts() == 4
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = (torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 5))
    want = gm(*args)
    fold_transposes_pass(g, None)
    assert ts() == 1
    gm.recompile()
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), want))
    eager = mc.Plan(codegen="eager")
    assert [n for n, _ in runtime_pass_list(eager, False)] == ["fold_transposes", "accumulate_in_matmuls"]
    assert [n for n, _ in runtime_pass_list(eager, True)] == ["fold_transposes", "accumulate_in_matmuls", "out_variants"]
    assert runtime_pass_list(mc.Plan(codegen="inductor"), True) == []


def test_at_p1_weight_gradients_are_computed_into_their_accumulators():
    """At p = 1 each linear weight's gradient ``mm`` becomes ``accumulate_mm`` into its accumulator slot
    (``passes.accumulate_in_matmuls``), and ``accumulate_local`` leaves those slots to it: over three
    micro-steps the accumulator holds what copying and adding every gradient gave. A gradient of
    another dtype than the accumulator's (bf16 compute) or of another op stays as it was; at p = 2 the
    gradients are reduce-scattered and nothing changes."""
    import types

    from micscompile.core.sharding import build_layouts, flat_view
    from micscompile.passes.accumulate_in_matmuls import accumulate_in_matmuls_pass
    from micscompile.passes.fold_transposes import fold_transposes_pass

    mm = torch.ops.aten.mm.default
    graph, ctx = rewrite(lm_trace(), 1)
    graph = accumulate_in_matmuls_pass(fold_transposes_pass(graph, ctx), ctx)
    acc = next(n for n in graph.nodes if n.target is C.accumulate_local)
    fused = [n for n in graph.nodes if n.target is C.accumulate_mm]
    names = [ctx.layouts[0].slots[i].name for i in acc.kwargs["written"]]
    assert sorted(names) == sorted(f"blocks.{b}.{fc}.weight" for b in (0, 1) for fc in ("fc1", "fc2")), names
    assert sorted(n.args[2] for n in fused) == sorted(acc.kwargs["written"])
    assert all(acc.args[3 + i] is None for i in acc.kwargs["written"])
    assert not any(n.target is mm and acc in n.users for n in graph.nodes)
    emb = [s.name for s in ctx.layouts[0].slots].index("emb.weight")  # the tied head's mm + embedding's: kept
    assert acc.args[3 + emb].target is torch.ops.aten.add.Tensor

    def rewritten(tg, p, **plan):
        g, c = rewrite(tg, p, **plan)
        return [n for n in accumulate_in_matmuls_pass(fold_transposes_pass(g, c), c).nodes
                if n.target is C.accumulate_mm]

    bf16 = mc.trace(TiedLM().to("meta"), (torch.zeros(4, 6, dtype=torch.long),) * 2, lm_loss, param_dtype=torch.bfloat16)
    assert rewritten(bf16, 1, param_dtype=torch.bfloat16) == []  # bf16 gradients, fp32 accumulators
    assert rewritten(lm_trace(), 2) == []

    class Summed(torch.nn.Module):  # one mm is the gradient of two slots: both left to accumulate_local
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return x @ (self.w1 + self.w2).t()

    with torch.device("meta"):
        summed = Summed()
    assert rewritten(mc.trace(summed, (torch.zeros(2, 4), torch.zeros(2, 3)), torch.nn.functional.mse_loss), 1) == []

    # the ops themselves: a slot written by its matmul, one added, one without a gradient, padding
    shapes = {"w": (3, 4), "b": (4,), "unused": (2,)}
    layout = build_layouts([("all", list(shapes))], shapes, partition_size=1, row_multiple=8)[0]
    assert layout.padded_numel > layout.numel
    comm = types.SimpleNamespace(layouts=[layout], grads=[torch.full((layout.padded_numel,), float("nan"))])
    gen = torch.Generator().manual_seed(0)
    a, b, g = [torch.randn(3, 5, generator=gen) for _ in range(3)], [torch.randn(5, 4, generator=gen) for _ in range(3)], \
        [torch.randn(4, generator=gen) for _ in range(3)]
    for comm.micro_step in range(3):
        C.accumulate_mm(comm, 0, 0, a[comm.micro_step], b[comm.micro_step])
        C.accumulate_local(comm, 0, None, None, g[comm.micro_step], None, written=(0,))
    want = torch.zeros(layout.padded_numel)
    flat_view(want, 0, 12, (3, 4)).copy_(sum(x @ y for x, y in zip(a, b)))
    flat_view(want, 12, 4, (4,)).copy_(sum(g))
    torch.testing.assert_close(comm.grads[0], want)
