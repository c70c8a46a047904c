"""pipeline_split + phase_split on real values, the balance DP against brute force, pipeline simulation."""

from __future__ import annotations

import dataclasses
import itertools
import operator

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st
from models import MODELS, meta_lm_trace
from torch import nn

import micscompile as mc
from micscompile.core.pipeline_schedule import make_schedule
from micscompile.cost_model.pipeline import halves
from micscompile.cost_model.simulator import simulate_program
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.phase_split import split_chunk, split_phases
from micscompile.lowering.pipeline import lower_pipeline
from micscompile.lowering.pipeline_split import forward_units, split
from micscompile.lowering.stage_balance import balance


def _resolved(chunks: int, stages: int | None = None) -> mc.ir.ResolvedPlan:
    stages = stages or chunks
    v = chunks // stages
    plan = mc.Plan(partition_size=1, pipeline_stages=stages, pipeline_chunks=v,
                   pipeline_schedule="interleaved" if v > 1 else "1f1b", micro_batches=stages)
    return plan.resolve(stages, stages)


def _run_chunks(sp, params: dict, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every chunk's forward in order, then every backward in reverse, values passed by hand."""
    phases = []
    for stage in sp.stages:
        n = len(stage.graph.trainable)
        phases.append(split_phases(stage.graph.gm, [0, *range(1 + n, 1 + n + len(stage.send_act))]))
    saved, recv, loss = {}, [], None
    for stage, ph in zip(sp.stages, phases):
        g = stage.graph
        args = [params[n] for n in [*g.param_names, *g.buffer_names]] + [batch[i] for i in stage.batch_inputs]
        out = ph.forward(*args, *recv, *[None] * len(stage.recv_grad))
        loss = out[0] if stage.has_loss else loss
        saved[stage.chunk] = (args, recv, list(out[1 + len(stage.send_act):]))
        recv = list(out[1 : 1 + len(stage.send_act)])
        assert [tuple(t.shape) for t in recv] == [t.shape for t in stage.send_act]
    grads: dict[str, torch.Tensor] = {}
    back: list = []
    for stage, ph in reversed(list(zip(sp.stages, phases))):
        args, acts, kept = saved[stage.chunk]
        out = ph.backward([*args, *acts, *back, *kept])
        n = len(stage.graph.trainable)
        for name, g in zip(stage.graph.trainable, out[:n]):
            if g is not None:
                grads[name] = grads.get(name, 0) + g
        back = list(out[n:])
    return loss, grads


@pytest.mark.parametrize("model_name, chunks", [("tied_lm", 2), ("tied_lm", 4), ("tied_lm", 7), ("convnet", 2),
                                                ("convnet", 3)])
def test_chunks_run_in_turn_reproduce_the_joint_graph(model_name, chunks):
    """Forward chunk by chunk, backward in reverse, values handed over as the pipeline sends them:
    the same loss and every gradient (a tied weight's partial sums added) as the traced graph."""
    cls, make_loss, make_batches = MODELS[model_name]
    torch.manual_seed(0)
    model = cls(layers=4) if model_name == "tied_lm" else cls()
    batch = make_batches(1, 4)[0]
    tg = mc.trace(model, batch, make_loss(model))
    params = dict(model.named_parameters())
    ref_loss, *ref_grads = tg.gm(*[params[n] for n in tg.param_names], *dict(model.named_buffers()).values(), *batch)
    sp = split(tg, _resolved(chunks))
    buffers = dict(model.named_buffers())
    loss, grads = _run_chunks(sp, {**params, **buffers}, batch)
    assert torch.equal(loss, ref_loss)
    for name, g in zip(tg.trainable, ref_grads):
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7)
    if model_name == "tied_lm":  # the tied embedding: held by the first and the last chunk
        assert sp.tied == {"emb.weight": (0, chunks - 1)}
        vocab_bytes = tg.param_bytes("emb.weight")
        assert all(sum(t.nbytes for t in s.send_grad) < vocab_bytes for s in sp.stages)


def test_more_chunks_than_blocks_is_refused():
    tg = meta_lm_trace(vocab=29, h=8, layers=2, batch=2, seq=4)  # 5 blocks, the head reading the tied embedding
    with pytest.raises(mc.PlanError, match="only 5 of its 5 blocks read parameters"):
        split(tg, _resolved(6, 3))


def test_a_block_without_parameters_is_never_a_chunk_of_its_own():
    """The conv net's input normalisation holds buffers only: cut alone, its rank's optimizer would get
    an empty parameter list (found by the plan fuzzer). It goes with the next block; 4 chunks are refused."""
    cls, make_loss, make_batches = MODELS["convnet"]
    model = cls()
    tg = mc.trace(model, make_batches(1, 4)[0], make_loss(model))
    assert forward_units(tg) == ["norm", "conv1", "conv2", "fc"]
    assert split(tg, _resolved(3)).starts == (0, 2, 3)
    with pytest.raises(mc.PlanError, match="only 3 of its 4 blocks read parameters.*use at most 3"):
        split(tg, _resolved(4))


def _brute_force(costs, chunks):
    n = len(costs)
    return min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), chunks - 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 100.0), min_size=2, max_size=9), st.integers(1, 5))
def test_balance_finds_the_best_split(costs, chunks):
    chunks = min(chunks, len(costs))
    starts = balance(costs, chunks)
    ends = (*starts[1:], len(costs))
    assert max(sum(costs[a:b]) for a, b in zip(starts, ends)) == pytest.approx(_brute_force(costs, chunks))


def test_balance_respects_the_memory_cap():
    costs, memory = [1.0, 1.0, 1.0, 5.0], [1.0, 1.0, 1.0, 3.0]
    assert balance(costs, 2) == (0, 3)
    assert balance(costs, 2, memory, lambda c: 3.5) == (0, 3)
    with pytest.raises(mc.PlanError, match="fits in memory"):
        balance(costs, 2, memory, lambda c: 2.5)


@pytest.mark.parametrize("stages", [2, 3])
def test_uneven_model_split_is_within_10_percent_of_the_best(stages):
    """A large embedding and LM head beside small blocks: the chosen split's slowest chunk, as the
    simulator prices the lowered chunks, against every possible split priced the same way."""
    tg = meta_lm_trace(vocab=4000, h=64, layers=4, batch=4, seq=32)
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=1)
    rp = mc.Plan(partition_size=2, pipeline_stages=stages, micro_batches=stages).resolve(2 * stages, 8)

    def slowest(starts=None) -> float:
        pp = lower_pipeline(tg, rp, cluster, planned_groups(rp), starts=starts)
        return max(sum(simulate_program(h, cluster, record=False).step_time_s for h in halves(pp.program(c))[:2])
                   for c in range(stages))

    units = len(split(tg, rp).units)
    best = min(slowest((0, *cuts)) for cuts in itertools.combinations(range(1, units), stages - 1))
    assert slowest() <= 1.10 * best


def test_simulated_pipeline_has_the_schedules_bubble():
    """Four identical blocks on four stages (no embedding): the simulated 1F1B bubble is the
    schedule's (S-1)/m up to the loss and the P2P hops; interleaving halves it."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    x = torch.zeros(64, 256)
    tg = mc.trace(model, (x, x), torch.nn.functional.mse_loss)
    cluster = dataclasses.replace(mc.Cluster.preset("p4d.24xlarge", nodes=1), gpus_per_node=4)
    pred = {v: mc.simulate(tg, mc.Plan(partition_size=1, pipeline_stages=4, micro_batches=8, pipeline_chunks=v,
                                       pipeline_schedule="interleaved" if v > 1 else "1f1b"), cluster)
            for v in (1, 2)}
    assert pred[1].bubble_fraction == pytest.approx(3 / 8, rel=0.1)
    assert pred[2].bubble_fraction == pytest.approx(3 / 16, rel=0.1)
    assert pred[2].step_time_s < pred[1].step_time_s


@pytest.mark.parametrize("distance", [1, 2, 3])
@pytest.mark.parametrize("model_name", ["tied_lm", "convnet"])
def test_chunk_gathers_never_stay_in_flight_between_forward_and_backward(model_name, distance):
    """Each chunk lowered with gathers ``distance`` ahead: the Program the search derives equals the
    lowered graph's (schedule checks it), and no gather issued in forward is waited in backward
    (phase_split checks it)."""
    cls, make_loss, make_batches = MODELS[model_name]
    model = cls()
    tg = mc.trace(model, make_batches(1, 4)[0], make_loss(model))
    rp = mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=2).resolve(4, 4)
    for rank in (0, 2):
        pp = lower_pipeline(tg, rp, None, planned_groups(rp, rank), rank, prefetch=[distance])
        for c in pp.my_chunks():
            sched, stage = pp.chunks[c], pp.split.stages[c]
            gm = torch.fx.GraphModule(stage.graph.gm, sched.graph)
            split_chunk(gm, len(stage.send_act))


def test_each_chunk_keeps_its_own_micro_batches_in_flight():
    from micscompile.core.pipeline_schedule import gpipe, interleaved_1f1b, one_f_one_b

    assert one_f_one_b(4, 8).chunk_in_flight == [4, 3, 2, 1]
    assert gpipe(2, 5).chunk_in_flight == [5, 5]
    per_chunk = interleaved_1f1b(4, 8, 2).chunk_in_flight
    assert [per_chunk[r] + per_chunk[r + 4] for r in range(4)] >= interleaved_1f1b(4, 8, 2).max_in_flight()


def _tied_buckets(lowered, sp_tied) -> dict[str, set[tuple]]:
    """For each tied parameter: the set of (its bucket's slots, partition size) over the chunks holding it."""
    return {name: {(tuple((s.name, s.numel) for s in ly.slots), ly.partition_size)
                   for c in holders for ly in lowered.chunks[c].program.layouts if name in {s.name for s in ly.slots}}
            for name, holders in sp_tied.items()}


def test_a_tied_weight_has_a_bucket_of_its_own_in_every_chunk_under_bucket_bytes():
    """bucket_bytes merges blocks into larger buckets; the embedding, tied to the head, must not merge (its
    partial gradients are summed piece by piece between its chunks): it was refused, now it stays alone."""
    tg = meta_lm_trace(vocab=29, h=8, layers=2, batch=2, seq=4)
    rp = mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=2, bucket_bytes=1 << 20).resolve(4, 4)
    lowered = lower_pipeline(tg, rp, None, planned_groups(rp))
    assert _tied_buckets(lowered, lowered.split.tied) == {"emb.weight": {((("emb.weight", 29 * 8),), 2)}}
    assert any(len(ly.slots) > 1 for ly in lowered.chunks[0].program.layouts)  # the others did merge


class _BiasedEmbedding(nn.Module):
    def __init__(self, vocab: int, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, h))
        self.bias = nn.Parameter(torch.randn(h))

    def forward(self, idx):
        return torch.nn.functional.embedding(idx, self.weight) + self.bias


def test_a_tied_weight_whose_modules_other_parameter_is_not_tied_has_a_bucket_of_its_own():
    """The embedding's weight is the head's, its bias is not: the tied module was made a block, so the first
    chunk packed weight and bias together, the last the weight alone, and the plan was refused with advice
    that did not apply ("leave bucket_bytes unset"; the covering fuzzer's row 0 found the pattern)."""
    model = MODELS["tied_lm"][0](layers=2)
    model.emb = _BiasedEmbedding(29, 10)
    model.head.weight = model.emb.weight
    x, y = MODELS["tied_lm"][2](1, 4)[0]
    tg = mc.trace(model, (x, y), MODELS["tied_lm"][1](model))
    rp = mc.Plan(pipeline_stages=2, partition_size=2, micro_batches=2).resolve(4, 4)
    lowered = lower_pipeline(tg, rp, None, planned_groups(rp))
    assert lowered.split.tied == {"emb.weight": (0, 1)}
    assert _tied_buckets(lowered, lowered.split.tied) == {"emb.weight": {((("emb.weight", 290),), 2)}}


def test_a_module_shared_by_two_blocks_is_run_by_the_chunk_of_each_caller():
    """Block 1 calls block 0's Linear. Its second use belongs to block 1's chunk, which holds the Linear
    too (tied); nothing computed from the weight alone (its transpose) is sent through the pipeline. The
    trace had named both uses by the Linear's first name, so chunk 0 computed W^T for chunk 1 and sent it,
    with the release of W's gathered bucket placed after the graph's output (found by the covering fuzzer)."""
    model = MODELS["tied_lm"][0](layers=2)
    model.blocks[1].fc1 = model.blocks[0].fc1
    x, y = MODELS["tied_lm"][2](1, 4)[0]
    tg = mc.trace(model, (x, y), MODELS["tied_lm"][1](model))
    rp = mc.Plan(pipeline_stages=2, partition_size=1, micro_batches=2).resolve(2, 2)
    sp = split(tg, rp, starts=(0, 2))  # chunk 0: emb, blocks.0; chunk 1: blocks.1, ln, head
    assert sp.tied == {"emb.weight": (0, 1), "blocks.0.fc1.weight": (0, 1), "blocks.0.fc1.bias": (0, 1)}
    sent = [t.name for t in sp.stages[0].send_act]
    assert len(sent) == 1, sent  # the residual stream alone
    for rank in (0, 1):  # each rank's rewritten chunk ends with its output (no release after it)
        graph = lower_pipeline(tg, rp, None, planned_groups(rp, rank), rank, starts=(0, 2)).chunks[rank].graph
        assert list(graph.nodes)[-1].op == "output"


def test_micro_batches_in_flight_cost_only_what_their_forward_keeps():
    """1F1B keeps up to S micro-batches in flight on the first stage. Each costs the activations
    its chunk's forward leaves for the backward (here the two Linear inputs), not the forward's
    transient peak with the gathered weights: the predicted peak grows by at most (S-1) of them
    from m = 1 to m = 8."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    x = torch.zeros(64, 256)
    tg = mc.trace(model, (x, x), torch.nn.functional.mse_loss)
    cluster = dataclasses.replace(mc.Cluster.preset("p4d.24xlarge", nodes=1), gpus_per_node=8)
    plans = {m: mc.Plan(partition_size=2, pipeline_stages=4, micro_batches=m) for m in (1, 8)}
    peak = {m: mc.simulate(tg, plan, cluster).peak_memory_bytes for m, plan in plans.items()}
    kept = 2 * 64 * 256 * 4  # per micro-batch: the inputs of the chunk's two Linear layers
    rp = plans[8].resolve(8, 8)
    forward = halves(lower_pipeline(tg, rp, cluster, planned_groups(rp)).program(0))[0]
    transient = simulate_program(forward, cluster, record=False, accumulate=False)
    assert transient.peak_memory_bytes - transient.static_memory_bytes > 2 * kept  # gathered weights on top
    assert 0 < peak[8] - peak[1] <= 3 * kept


def test_pipeline_second_hops_run_under_the_schedule():
    """2-hop over d = 4 replicas (4 p4d nodes, S = 2, t = 4): each chunk's all-reduces over the replicas
    start in its last backward. The last stage's end before the first stage finishes its backward (under
    the drain); the first stage's overlap its last backward, so the boundary waits for less than their
    time (all of it, were they issued there)."""
    tg = meta_lm_trace(vocab=4096, h=1024, layers=8, batch=8, seq=512)
    pred = mc.simulate(tg, mc.Plan(partition_size=4, pipeline_stages=2, micro_batches=4),
                       mc.Cluster.preset("p4d.24xlarge", nodes=4))
    hops = {e.track: e for e in pred.events if e.track.endswith("replicate")}
    makespan = max(e.end_s for e in pred.events if e.track.startswith("stage") and e.track not in hops)
    assert set(hops) == {"stage 0 replicate", "stage 1 replicate"}
    assert hops["stage 1 replicate"].end_s < makespan
    assert 0 < pred.exposed_boundary_s < 0.8 * pred.stream_busy_s["comm:replicate"]


def test_a_parameter_nothing_reads_is_held_by_a_chunk():
    """Quirky's ``unused`` Linear never runs: it is still state (saved, exported), so a chunk holds it
    (found by the plan fuzzer: a pipeline's full_state_dict raised KeyError)."""
    cls, make_loss, make_batches = MODELS["quirky"]
    model = cls()
    tg = mc.trace(model, make_batches(1, 4)[0], make_loss(model))
    sp = split(tg, _resolved(2))
    held = [set(st.graph.param_names) for st in sp.stages]
    assert set().union(*held) == set(tg.param_names)
    assert {"unused.weight", "unused.bias"} <= held[-1]


def test_every_stage_fingerprints_the_pipeline_alike_with_offload():
    """A rank lowers only its own chunks' graphs; with offloaded activations the lowered Program cuts its
    compute around the copies, unlike the Program the search chose, so stage 0 and stage 1 disagreed and
    mc.compile refused a valid plan ("ranks compiled different programs"; found by the plan fuzzer)."""
    from micscompile.cost_model.specs import Cluster
    from micscompile.lowering.groups import planned_groups
    from micscompile.lowering.lowered import lower

    model, (x, y) = MODELS["tied_lm"][0](layers=6), MODELS["tied_lm"][2](1, 12)[0]
    tg = mc.trace(model, (x, y), MODELS["tied_lm"][1](model))
    rp = mc.Plan(pipeline_stages=2, partition_size=2, checkpoint="selective", checkpoint_every=2,
                 offload_activations=True, codegen="eager").resolve(4, 4)
    cluster = Cluster.preset("p4d.24xlarge")
    first, second = (lower(tg, rp, cluster, planned_groups(rp, r), r) for r in (0, 2))
    assert first.fingerprint() == second.fingerprint()
    assert first.collective_fingerprint() == second.collective_fingerprint()


def _zb_chunks(p: int, checkpoint: bool = False):
    """A tied LM lowered under ZB-H1 (S = 2, t = p): each rank's chunk's rewritten graph."""
    from models import TiedLM

    _, make_loss, make_batches = MODELS["tied_lm"]
    torch.manual_seed(0)
    model = TiedLM(layers=2)
    x, y = make_batches(1, 4)[0]
    tg = mc.trace(model, (x, y), make_loss(model))
    rp = mc.Plan(partition_size=p, pipeline_stages=2, micro_batches=2, pipeline_schedule="zb-h1",
                 checkpoint=checkpoint).resolve(2 * p, 2 * p)
    return [lower_pipeline(tg, rp, None, planned_groups(rp, r), r).chunks[rp.stage_of(r)]
            for r in (0, rp.world_size - 1)]


@pytest.mark.parametrize("p, checkpoint", [(1, False), (2, False), (2, True)])
def test_weight_split_puts_input_gradients_in_b_and_weight_gradients_in_w(p, checkpoint):
    """B is what the input gradients the chunk sends back are computed from (the weights' gathers
    included) and nothing else but releases; W the rest: every accumulation into a gradient bucket, its
    reduction and second hop, and the weight-gradient matmuls. The backward runs B then W, and W's
    values never feed B."""
    from micscompile.core import collectives as C
    from micscompile.passes.weight_split import backward_phases
    from micscompile.trace import META_REGION

    for chunk in _zb_chunks(p, checkpoint):
        graph = chunk.graph
        b, w = backward_phases(graph)
        bwd = [n for n in graph.nodes if n.op == "call_function" and n.meta.get(META_REGION) == "bwd"]
        assert bwd == b + w and w
        output = next(n for n in graph.nodes if n.op == "output")
        needed, todo = set(), [v for v in output.all_input_nodes if v in set(bwd)]
        while todo:
            n = todo.pop()
            if n not in needed and n in set(bwd):
                needed.add(n)
                todo += n.all_input_nodes
        # B: exactly the input gradients' ancestors, the releases, and the pieces of its multi-output ops (W reads
        # a layer norm backward's weight gradients as tensors, never the tuple: Inductor's regions need that)
        pieces = {n for n in b if n.target is operator.getitem and n.args[0] in needed and n not in needed}
        assert {n for n in b if n.target is not C.release} - pieces == needed
        assert not [n for n in w if n.target is operator.getitem and n.args[0] in set(b)]
        grads = (C.accumulate, C.accumulate_local, C.accumulate_mm, C.reduce_scatter_issue, C.second_hop)
        assert not [n for n in b if n.target in grads]
        assert [n for n in w if n.target in grads]
        mms = [n for n in w if n.target is torch.ops.aten.mm.default]
        assert mms, "W holds the weight-gradient matmuls"
        if p > 1 and needed:  # the weights B multiplies by are gathered (and released) in B
            assert [n for n in b if n.target is C.all_gather_issue] and [n for n in b if n.target is C.release]
        assert not any(u in set(b) for n in w for u in n.users)


def test_zero_bubble_prices_a_smaller_bubble_with_the_same_compute():
    """ZB-H1 against 1F1B on one plan: the same work (B and W are the backward cut in two, the gradients'
    accumulation priced once, in W), the same planned peak (its ranks defer only the W's 1F1B's peak leaves
    room for: ``memory_neutral``), a bubble cut by more than a third, a faster step. Every rank deferring
    its r W's (torch.distributed.pipelining's order) would cut the bubble further at a higher peak."""
    tg = meta_lm_trace(vocab=512, h=128, layers=8, batch=4, seq=64)
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=1)
    pred = {kind: mc.simulate(tg, mc.Plan(partition_size=1, pipeline_stages=4, micro_batches=8,
                                          pipeline_schedule=kind), cluster) for kind in ("1f1b", "zb-h1")}
    one, zb = pred["1f1b"], pred["zb-h1"]
    assert zb.compute_s == pytest.approx(one.compute_s, rel=1e-9)
    assert zb.peak_memory_bytes == one.peak_memory_bytes
    assert zb.bubble_fraction < 2 / 3 * one.bubble_fraction
    assert zb.step_time_s < one.step_time_s
    rp = mc.Plan(partition_size=1, pipeline_stages=4, micro_batches=8, pipeline_schedule="zb-h1").resolve(8, 8)
    pp = lower_pipeline(tg, rp, cluster, planned_groups(rp))
    torch_order = dataclasses.replace(pp, schedule=make_schedule("zb-h1", 4, 8, 1, (0, 1, 2, 3))).predict()
    assert torch_order.bubble_fraction < zb.bubble_fraction and torch_order.peak_memory_bytes > zb.peak_memory_bytes
