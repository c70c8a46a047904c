"""mc.autotune: symbolic-batch traces, repricing equal to mc.simulate, brute-force optimality and
measure mode on 4 gloo ranks (the thesis's paper-scale cases: benchmarks/bench_autotune.py)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch
from harness import launch

import micscompile as mc
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.pipeline import lower_pipeline
from micscompile.lowering.tensor_split import tensor_split
from micscompile.trace import META_BYTES, META_FLOPS, META_SHAPE
from micscompile.tune import repricing
from micscompile.tune.repricing import Pricer
from micscompile.tune.search_space import configs, prefetches
from micscompile.zoo.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=256, seq_len=32, layers=4, hidden=32, heads=2)


def _batch(b: int, cfg: GPTConfig = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)


@pytest.fixture(scope="module")
def model() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


@pytest.fixture(scope="module")
def symbolic(model) -> mc.TrainGraph:
    return mc.trace(model, _batch(2), lm_loss, symbolic_batch=True)


def _small_cluster(memory_bytes: int) -> mc.Cluster:
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    return dataclasses.replace(cl, gpu=dataclasses.replace(cl.gpu, memory_bytes=memory_bytes))


@pytest.mark.parametrize("b", [3, 5])
def test_symbolic_trace_evaluates_to_the_concrete_trace(model, symbolic, b):
    """at_batch(b) of one symbolic trace is, node for node, what tracing at b records."""
    got = [n for n in symbolic.at_batch(b).gm.graph.nodes]
    want = [n for n in mc.trace(model, _batch(b), lm_loss).gm.graph.nodes]
    assert len(got) == len(want)
    for a, w in zip(got, want):
        assert a.target == w.target
        assert (a.meta[META_BYTES], a.meta[META_FLOPS], a.meta[META_SHAPE]) == \
               (w.meta[META_BYTES], w.meta[META_FLOPS], w.meta[META_SHAPE]), a.format_node()
    assert symbolic.batch_size == 2 and symbolic.at_batch(b).batch_size == b


def test_symbolic_trace_refuses_size_one_examples(model):
    with pytest.raises(mc.TraceError, match="at least 2"):
        mc.trace(model, _batch(1), lm_loss, symbolic_batch=True)
    with pytest.raises(mc.TraceError, match="symbolic_batch=True"):
        mc.trace(model, _batch(2), lm_loss).at_batch(4)


PLANS = [
    mc.Plan(partition_size=1, micro_batches=3),
    mc.Plan(partition_size=4, micro_batches=4),
    mc.Plan(partition_size=16, micro_batches=2, hierarchical=False),
    mc.Plan(partition_size=16, micro_batches=5, checkpoint=True, offload_activations=True),
    mc.Plan(partition_size=8, micro_batches=2, checkpoint="selective"),
    mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=4),
    mc.Plan(partition_size=1, pipeline_stages=4, micro_batches=4, checkpoint=True),
    mc.Plan(partition_size=4, pipeline_stages=2, micro_batches=4, pipeline_schedule="interleaved", pipeline_chunks=2),
    mc.Plan(partition_size=2, pipeline_stages=4, micro_batches=2, checkpoint=True, offload_activations=True),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"S{p.pipeline_stages}-p{p.partition_size}-ck{p.checkpoint}")
def test_repricing_equals_simulate(symbolic, plan):
    """Lowered once per structure over all sizes, re-priced per p and b: mc.simulate's prediction."""
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    pricer = Pricer(symbolic, cl, [1, 2, 8])
    for b, pf in itertools.product((1, 8), (mc.Prefetch(distance=1), mc.Prefetch(distance=2))):
        got = pricer.predict(plan, b, pf)
        want = mc.simulate(symbolic.at_batch(b), plan, cl, prefetch=[pf], scaling=False)
        # a pipeline with offload: mc.simulate lowers the rank's own chunk again with its prefetch, where
        # the activation reloads split one compute run in two (one more per-run overhead, < 1e-4)
        rel = 1e-4 if plan.pipeline_stages > 1 and plan.offload_activations else 1e-9
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=rel)
        assert got.exposed_comm_s == pytest.approx(want.exposed_comm_s, rel=rel, abs=1e-12)
        assert got.peak_memory_bytes == want.peak_memory_bytes


def _deep_pricer(layers: int) -> tuple[mc.TrainGraph, mc.Cluster, Pricer]:
    """A symbolic trace of the test GPT with ``layers`` blocks, 2 p4d nodes, and a Pricer of sizes 1 and 4."""
    cfg = dataclasses.replace(CFG, layers=layers)
    with torch.device("meta"):
        deep = GPT(cfg)
    symbolic = mc.trace(deep, _batch(2, cfg), lm_loss, symbolic_batch=True)
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    return symbolic, cl, Pricer(symbolic, cl, [1, 4])


def test_chunks_of_one_shape_are_split_and_lowered_once(monkeypatch):
    """A 12-block stack cut many ways: chunks with equal keys (chunk_keys) are split and lowered once,
    and every cut still prices as the pipeline lowered for it does (mc.simulate's path)."""
    symbolic, cl, pricer = _deep_pricer(12)
    splits = []
    real = repricing.split
    monkeypatch.setattr(repricing, "split", lambda *a, **k: splits.append(k["only"]) or real(*a, **k))
    # units: tok, pos, blocks.0-11, ln_f, head; the middle chunks of three blocks repeat
    # (no chunk of more than depth.DEPTH[-1] blocks: those are priced from their line, the test below)
    cuts = [(0, 5, 8, 11), (0, 6, 9, 12), (0, 4, 7, 10), (0, 3, 6, 9, 11, 12, 13, 14), (0, 8), (0, 4, 8, 12)]
    pf = mc.Prefetch(distance=1)
    for starts, (t, b) in itertools.product(cuts, ((1, 1), (2, 4))):
        S = len(starts)
        plan = mc.Plan(partition_size=t, pipeline_stages=S, micro_batches=2 * S, checkpoint=True)
        rp = plan.resolve(cl.world_size, cl.gpus_per_node)
        monkeypatch.setattr(pricer, "_cuts", lambda rp, i, starts=starts: starts)
        got = pricer.predict(plan, b, pf)
        pp = lower_pipeline(symbolic.at_batch(b), rp, cl, planned_groups(rp), prefetch=[pf], starts=starts)
        want = pp.predict(cl)
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
        assert got.peak_memory_bytes == want.peak_memory_bytes
    keys = pricer._unit_analysis()[4]
    shapes = {k for starts in cuts for k in keys.of(starts)}
    assert None not in shapes and len(shapes) < sum(map(len, cuts))
    assert sum(map(len, splits)) == len(shapes)  # each chunk shape built once
    assert len(pricer._bases) == 2 * len(shapes)  # and lowered once per structure (t = 1 or not)


def test_autotune_best_equals_brute_force(symbolic):
    """On a small space the best candidate is the brute-force minimum of mc.simulate over every
    (plan, micro-batch size, prefetch) that fits, tensor groups with and without sequence parallelism
    and zero-bubble pipelines included (each tensor-split candidate priced as mc.simulate prices it, each
    ZB-H1 with the deferral lower_pipeline picks); a device of the median peak makes half not fit."""
    opts = dict(partition_sizes=(1, 2, 8), pipeline_stages=(1, 2), micro_batch_sizes=(1, 4), checkpoint=(False, True),
                offload=(False,), tensor=((1, False), (2, True)), zero_bubble=(False, True))
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    space = configs(cl.world_size, cl.gpus_per_node, 32, len(symbolic.blocks), hierarchical=("auto", False), **opts)
    brute = []
    split = functools.cache(lambda b, t, sp: tensor_split(symbolic.at_batch(b), t, sp))  # (mc.simulate's first step)
    for cfg in space:
        plan = cfg.plan(mc.Plan())
        for pf in prefetches(cfg):
            pred = mc.simulate(split(cfg.micro_batch, cfg.tensor, cfg.sequence), plan, cl, prefetch=[pf], scaling=False)
            brute.append((pred.step_time_s, pred.peak_memory_bytes, plan, cfg.micro_batch, pf))
    capacity = sorted(x[1] for x in brute)[len(brute) // 2]
    cl = _small_cluster(capacity)
    ranked = mc.autotune(symbolic, cl, global_batch_size=32, verbose=False, progress=False, exhaustive=True, **opts)
    assert len(ranked) == len(brute)
    feasible = [x for x in brute if x[1] <= capacity]
    assert 0 < len(feasible) < len(brute)
    best = min(feasible, key=lambda x: x[0])
    top = ranked[0]
    assert top.feasible and top.step_time_s == pytest.approx(best[0], rel=1e-9)
    assert (top.plan, top.micro_batch_size, top.prefetch) == best[2:] or \
        ranked[1].step_time_s == pytest.approx(top.step_time_s, rel=1e-9)  # a tie
    assert sum(c.feasible for c in ranked) == len(feasible)
    # feasible first by predicted time, then the infeasible ones with their reason
    times = [c.step_time_s for c in ranked if c.feasible]
    assert times == sorted(times)
    assert all(c.feasible for c in ranked[:len(feasible)])
    assert all("exceeds" in c.reason or "model states" in c.reason for c in ranked[len(feasible):])
    assert all(c.why for c in ranked[:len(feasible) - 1])
    assert {c.family for c in ranked} == {"MiCS", "MiCS-Pipe", "PTD-P"}
    # every candidate is the simulation of its plan: the tensor-split ones too (mutation caught: the split's
    # per-size metadata left at the traced size)
    by = {(x[2], x[3], x[4]): x[0] for x in brute}
    assert all(c.step_time_s == pytest.approx(by[c.plan, c.micro_batch_size, c.prefetch], rel=1e-9)
               for c in ranked if c.prediction is not None)
    # best first (the default): the top 3 and each family's best are the exhaustive search's, with fewer simulations;
    # every floor, of a simulated candidate or of one it skipped, is below its step as mc.simulate predicts it
    # (mutations caught: a floor 20% higher; the pipelines' fill left out of... kept by the top-3 check)
    first = mc.autotune(symbolic, cl, global_batch_size=32, verbose=False, progress=False, top=3, **opts)
    skipped = [c for c in first if c.prediction is None and c.floor_s is not None]
    assert skipped and all("not simulated" in c.reason for c in skipped)
    # a pipeline whose planned peak is above the device is ruled out before its timeline: that peak is
    # mc.simulate's (mutation caught: pipeline_peak_bytes without the chunks' static bytes)
    peak = {(x[2], x[3], x[4]): x[1] for x in brute}
    over = [c for c in first if c.over_memory_bytes is not None]
    assert over and all(c.over_memory_bytes == peak[c.plan, c.micro_batch_size, c.prefetch] > capacity and
                        c.plan.pipeline_stages > 1 and not c.feasible for c in over)
    assert all(c.floor_s <= by[c.plan, c.micro_batch_size, c.prefetch] * (1 + 1e-9) for c in first
               if c.floor_s is not None)
    assert [(c.label(), c.step_time_s) for c in first[:3]] == [(c.label(), c.step_time_s) for c in ranked[:3]]
    for fam in ("MiCS", "MiCS-Pipe", "PTD-P"):
        assert next(c.label() for c in first if c.feasible and c.family == fam) == \
            next(c.label() for c in ranked if c.feasible and c.family == fam)


def test_meta_propagation_runs_each_distinct_call_once(symbolic, monkeypatch):
    """A tensor split's values are propagated on meta running each op once per distinct call (its arguments'
    shapes, strides, dtypes and values: the repeated blocks make the same calls), the repeats given fresh tensors
    like its results: node for node what running every op gives. Mutation caught: the key without the arguments'
    strides (a transpose of a transposed weight)."""
    from micscompile.lowering import tensor_split as ts

    ran = []
    plain = torch.fx.Interpreter.call_function
    monkeypatch.setattr(torch.fx.Interpreter, "call_function", lambda self, *a: ran.append(1) or plain(self, *a))
    tg = symbolic.at_batch(3)
    cached = ts.tensor_split(tg, 2, True)
    hits = sum(1 for n in cached.gm.graph.nodes if n.op == "call_function") - len(ran)
    monkeypatch.setattr(ts, "_call_key", lambda *a: None)
    every = ts.tensor_split(tg, 2, True)

    def value(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.stride(), v.dtype
        return tuple(map(value, v)) if isinstance(v, (tuple, list)) else v

    assert hits > (hits + len(ran)) / 5  # (a quarter of the calls repeat one before: the later blocks')
    pairs = list(zip(cached.gm.graph.nodes, every.gm.graph.nodes, strict=True))
    for x, y in pairs:
        assert x.target == y.target and value(x.meta.get("val")) == value(y.meta.get("val")), x.name
        assert {k: v for k, v in x.meta.items() if k != "val"} == {k: v for k, v in y.meta.items() if k != "val"}


@pytest.mark.parametrize("sequence", [False, True])
def test_one_tensor_split_evaluated_at_every_size_is_each_sizes_own_split(symbolic, sequence):
    """autotune splits a symbolic trace twice (its two smallest sizes above 1) and evaluates every byte, FLOP and
    shape count at the other sizes on the line through them: node for node what splitting at each size gives.
    Mutation caught: the counts left at the first size (every larger size's differ)."""
    from micscompile.lowering.tensor_split import tensor_split
    from micscompile.trace import META_BYTES, META_FLOPS, META_SHAPE
    from micscompile.tune.repricing import split_over_sizes

    sizes = [2, 3, 5, 8]
    over = split_over_sizes(symbolic, 2, sequence, sizes)
    assert over is not None and split_over_sizes(symbolic, 2, sequence, [1, 2, 3]) is None  # (a batch of 1: alone)
    for i, b in enumerate(sizes):
        own = tensor_split(symbolic.at_batch(b), 2, sequence)
        pairs = list(zip(over.gm.graph.nodes, own.gm.graph.nodes))
        assert len(pairs) == len(own.gm.graph.nodes)
        for x, y in pairs:
            for key in (META_BYTES, META_FLOPS):
                assert int(np.asarray(x.meta.get(key, 0)).reshape(-1)[i if np.ndim(x.meta.get(key)) else 0]) == \
                    y.meta.get(key, 0), (b, x.name, key)
            if y.meta.get(META_SHAPE) is not None:
                assert tuple(int(d[i]) if np.ndim(d) else d for d in x.meta[META_SHAPE]) == y.meta[META_SHAPE], x.name


@pytest.mark.parametrize("sequence", [False, True])
def test_a_symbolic_trace_at_a_size_splits_as_a_trace_made_at_that_size(model, symbolic, sequence):
    """Tensor parallelism splits a concrete trace; ``at_batch(b)`` of a symbolic one is one, and its split (the
    shapes it reads are the ones recorded at b, the token ids' (b, s) included) prices as a trace made at b."""
    cl = mc.Cluster.preset("p4d.24xlarge")
    plan = mc.Plan(tensor_parallel_size=2, sequence_parallel=sequence, micro_batches=2)
    for b in (1, 3):
        got = mc.simulate(symbolic.at_batch(b), plan, cl, scaling=False)
        want = mc.simulate(mc.trace(model, _batch(b), lm_loss), plan, cl, scaling=False)
        assert (got.step_time_s, got.peak_memory_bytes) == (want.step_time_s, want.peak_memory_bytes)
    assert not symbolic.at_batch(3).batch_symbols and symbolic.batch_symbols


def test_autotune_rejects_an_impossible_batch(symbolic):
    with pytest.raises(mc.PlanError, match="global batch"):
        mc.autotune(symbolic, mc.Cluster.preset("p4d.24xlarge", nodes=2), global_batch_size=3,
                    micro_batch_sizes=(2,), verbose=False, progress=False)
    # "auto" chooses inside one candidate; autotune prices each home as a candidate of its own
    with pytest.raises(ValueError, match="'partition' and/or 'world'"):
        mc.autotune(symbolic, mc.Cluster.preset("p4d.24xlarge", nodes=2), global_batch_size=16,
                    optimizer_sharding=("auto",), verbose=False, progress=False)


def _measure_worker(rank: int, world: int) -> list[tuple]:
    torch.manual_seed(0)
    model = GPT(CFG)
    trace = mc.trace(model, _batch(2), lm_loss, symbolic_batch=True)
    cluster = dataclasses.replace(mc.Cluster.preset("p4d.24xlarge"), nodes=1, gpus_per_node=world)  # 4 ranks
    ranked = mc.autotune(trace, cluster, global_batch_size=16, micro_batch_sizes=(2, 4), pipeline_stages=(1,),
                         checkpoint=(False,), offload=(False,), tensor=((1, False),), verbose=rank == 0, progress=False,
                         measure=True, model=model, loss_fn=lm_loss, make_batch=lambda n: _batch(n), top_k=3, steps=2)
    return [(c.label(), c.step_time_s, c.measured_step_s) for c in ranked[:4]]


@pytest.mark.multiproc
def test_measure_mode_reranks_the_top_candidates_on_4_gloo_ranks():
    """measure=True runs the top 3 for real on 4 gloo ranks and ranks them by measured time."""
    results = launch(_measure_worker, 4)
    assert all(r == results[0] for r in results[1:]) or all(
        [x[0] for x in r] == [x[0] for x in results[0]] for r in results)  # every rank agrees on the order
    top = results[0]
    measured = [m for _, _, m in top[:3]]
    assert all(m is not None and m > 0 for m in measured)
    assert measured == sorted(measured)
    assert top[3][2] is None  # the rest keep their predicted order, unmeasured


class _LongSkip(torch.nn.Module):
    """Six blocks; the first block's output skips to the end (an edge over four blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = h = self.blocks[0](x)
        for block in self.blocks[1:]:
            h = torch.relu(block(h))
        return h + first


def test_a_long_chunk_is_priced_from_three_shorter_ones(monkeypatch):
    """A chunk of more than depth.DEPTH[-1] repeated blocks is lowered and priced at 4, 5 and 6 of them (the line
    through two, checked at the third) and predicts what pricing it whole does: a 16-block stack cut in two, with
    checkpointing, a partition group, ZB-H1's split backward, and every prefetch distance's transient.
    Off its line a chunk is lowered whole. Mutations caught: the line taken from the second point instead of the first
    (`k - ka` as `k - kb`); a chunk off its line priced as its 6-block point."""
    from micscompile.tune import depth

    symbolic, cl, pricer = _deep_pricer(16)
    lines = []
    real = depth.on_line
    monkeypatch.setattr(repricing, "on_line", lambda points, k: lines.append(k) or real(points, k))
    for (schedule, ck, t), (b, d) in itertools.product(
            [("1f1b", False, 1), ("zb-h1", True, 2), ("1f1b", "selective", 2)], [(1, 0), (4, 1), (4, 3)]):
        plan = mc.Plan(partition_size=t, pipeline_stages=2, micro_batches=4, pipeline_schedule=schedule, checkpoint=ck)
        pf = mc.Prefetch(distance=d)
        got = pricer.predict(plan, b, pf)
        want = mc.simulate(symbolic.at_batch(b), plan, cl, prefetch=[pf], scaling=False)
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
        assert got.exposed_comm_s == pytest.approx(want.exposed_comm_s, rel=1e-9, abs=1e-12)
        assert got.peak_memory_bytes == want.peak_memory_bytes
        assert got.flops_per_step == want.flops_per_step
    assert lines and min(lines) > depth.DEPTH[-1]  # (both chunks were priced from their lines)
    units = pricer._unit_analysis()[0]
    split = [len(st.blocks) for st in pricer._stages.values()]  # (each chunk split is lowered)
    assert max(split) <= depth.DEPTH[-1] + 3 < len(units) // 2  # (no chunk of 8 blocks: the tied head's 3 units at most)
    # off its line, a chunk is lowered whole, and the prediction is still mc.simulate's
    monkeypatch.setattr(repricing, "on_line", lambda points, k: (_ for _ in ()).throw(depth.OffLine("bent")))
    got = pricer.predict(plan, b, pf)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9) and got.peak_memory_bytes == want.peak_memory_bytes
    assert max(len(st.blocks) for st in pricer._stages.values()) > depth.DEPTH[-1] + 3


def test_a_price_off_its_line_is_refused():
    """``depth.on_line`` extrapolates exact bytes and times, and refuses a third point off the line (the chunk is
    then lowered whole)."""
    from micscompile.cost_model.pipeline import ChunkPrice
    from micscompile.cost_model.simulator import Prediction
    from micscompile.tune import depth

    def price(k: int, bend: float = 0.0) -> ChunkPrice:
        pred = Prediction(step_time_s=0.5 + 0.25 * k + bend, compute_s=0.25 * k, exposed_comm_s=0.5,
                          stream_busy_s={"compute": 0.25 * k}, peak_memory_bytes=100 + 10 * k,
                          static_memory_bytes=7 * k, flops_per_step=3.0 * k, world_size=8)
        return ChunkPrice(pred, pred, pred, None, None, 5 * k, 0, 11 * k)

    got = depth.on_line([price(k) for k in depth.DEPTH], 40)
    want = price(40)
    assert got.forward.step_time_s == pytest.approx(want.forward.step_time_s, rel=1e-12)
    assert (got.forward.peak_memory_bytes, got.saved, got.flops) == (want.forward.peak_memory_bytes, 200, 440)
    with pytest.raises(depth.OffLine):
        depth.on_line([price(4), price(5), price(6, bend=1e-6)], 40)
    # a run bounded by other blocks on both sides (its neighbours would change) is not cut shorter
    sigs = [1, 2] + [7] * 10 + [9]
    assert depth.shortened((0, 4), 1, sigs) == (8, [(0, 8), (0, 7), (0, 6)])  # (the start moves along the run)
    assert depth.shortened((0, 2), 1, sigs) is None


def test_a_skip_connection_turns_chunk_keys_off_and_pipelines_still_price_exactly():
    """The skip's add runs outside every block, where its chunk depends on the cuts: no chunk gets a
    key (each is split and lowered for its own cut), and predictions stay mc.simulate's."""
    with torch.device("meta"):
        model = _LongSkip()
    x = torch.zeros(4, 16)
    symbolic = mc.trace(model, (x, x), torch.nn.functional.mse_loss, symbolic_batch=True)
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    pricer = Pricer(symbolic, cl, [2, 4])
    keys = pricer._unit_analysis()[4]
    assert not keys.usable and keys.of((0, 3)) == [None, None]
    plan = mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=4)
    for b in (2, 4):
        want = mc.simulate(symbolic.at_batch(b), plan, cl, prefetch=[mc.Prefetch(distance=1)], scaling=False)
        got = pricer.predict(plan, b, mc.Prefetch(distance=1))
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
        assert got.peak_memory_bytes == want.peak_memory_bytes


def _candidate(step_s: float, uncertainty: float):
    from micscompile.cost_model.simulator import Prediction
    from micscompile.tune.autotune import Candidate

    pred = Prediction(step_time_s=step_s, compute_s=step_s, exposed_comm_s=0.0, stream_busy_s={}, peak_memory_bytes=0,
                      static_memory_bytes=0, flops_per_step=1e12, world_size=8, uncertainty=uncertainty)
    return Candidate(mc.Plan(partition_size=8), 1, mc.Prefetch(), True, prediction=pred)


def test_candidates_within_each_others_interval_are_ties():
    """A prediction carries its cluster's held-out error; autotune calls candidates whose intervals
    overlap the best's ties (1.0 s and 1.25 s at +-14% overlap, 1.0 s and 1.5 s do not)."""
    from micscompile.tune.autotune import print_table, rank

    ranked = rank([_candidate(1.5, 0.14), _candidate(1.25, 0.14), _candidate(1.0, 0.14)])
    assert [c.step_time_s for c in ranked] == [1.0, 1.25, 1.5]
    assert [c.tie for c in ranked] == [False, True, False]
    assert "a tie" in ranked[0].why and "+-14%" in str(ranked[1]) and "a tie with the best" in str(ranked[1])
    assert not any(c.tie for c in rank([_candidate(1.0, 0.0), _candidate(1.01, 0.0)]))  # no interval: no ties
    import io
    out = io.StringIO()
    print_table(ranked, file=out)
    assert "+-14% (held-out error" in out.getvalue() and "1.2500~" in out.getvalue()


def test_a_prediction_carries_its_clusters_held_out_error():
    from models import meta_lm_trace

    tg = meta_lm_trace(vocab=128, h=16, layers=2, batch=2, seq=8)
    plan = mc.Plan(partition_size=8, micro_batches=2)
    p4d = mc.simulate(tg, plan, mc.Cluster.preset("p4d.24xlarge", nodes=2))
    err = mc.Cluster.preset("p4d.24xlarge").prediction_error
    assert p4d.uncertainty == err > 0 and f"+-{err:.0%}" in str(p4d)
    dgx = mc.simulate(tg, plan, mc.Cluster.preset("dgx-h100", nodes=2))
    assert dgx.uncertainty == 0 and "no held-out error" in str(dgx)
    pipe = mc.simulate(tg, mc.Plan(partition_size=4, pipeline_stages=2, micro_batches=2),
                       mc.Cluster.preset("p4d.24xlarge", nodes=1))
    assert pipe.uncertainty == p4d.uncertainty


def test_repricing_places_second_hops_for_each_partition_size(symbolic):
    """One Pricer, one structure lowered once, priced at p = n (no replicas: no second hop) and then at
    p < n (each bucket's all-reduce over the replicas in the last backward) and back: each equals
    mc.simulate, whichever partition size the structure was first lowered for."""
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    pricer = Pricer(symbolic, cl, [1, 2, 8])
    pf = mc.Prefetch(distance=1)
    for p in (16, 8, 16):
        plan = mc.Plan(partition_size=p, micro_batches=2, hierarchical=False)
        got = pricer.predict(plan, 2, pf)
        want = mc.simulate(symbolic.at_batch(2), plan, cl, prefetch=[pf], scaling=False)
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9), p
        assert got.exposed_boundary_s == pytest.approx(want.exposed_boundary_s, rel=1e-9, abs=1e-12), p


def test_the_priced_partition_size_leaves_one_node_only_for_a_size_priced_5_percent_faster():
    """``micscompile plan`` without -p (tune.partition.pick): one node stays unless a size that fits
    is predicted at least PARTITION_TIE faster; then the smallest within the tie of the fastest (the
    thesis's smallest-group rule). Sizes that do not fit never win. Mutations: no tie (32 wins where
    16 and one node should), fit ignored (4 wins), one node not preferred (4 wins in a tie) fail."""
    from types import SimpleNamespace

    from micscompile.tune.partition import PricedSize, candidate_sizes, pick

    cluster = mc.Cluster.preset("p4d.24xlarge").with_nodes(4)

    def row(p: int, ms: float, fits: bool = True) -> PricedSize:
        return PricedSize(p, SimpleNamespace(step_time_s=ms / 1e3, fits=lambda _: fits))

    rows = [row(4, 50.0, fits=False), row(8, 100.0), row(16, 60.0), row(32, 59.0)]
    assert pick(rows, cluster, default=8).partition_size == 16  # 32 is 1.7% faster: a tie, the smaller
    assert pick(rows, cluster, default=8, tie=0.01).partition_size == 32
    assert pick(rows, cluster, default=4).partition_size == 16  # one node does not fit
    rows[1] = row(8, 61.5)
    assert pick(rows, cluster, default=8).partition_size == 8  # 4.2% slower than 32: one node stays
    assert pick([row(4, 60.0), row(8, 61.0)], cluster, default=8).partition_size == 8  # not the smaller one
    assert pick([row(8, 1.0, fits=False)], cluster, default=8) is None
    assert candidate_sizes(mc.Plan(), cluster) == [1, 2, 4, 8, 16, 32]
    assert candidate_sizes(mc.Plan(pipeline_stages=2), cluster) == [1, 2, 4, 8]  # a stage's group stays in a node


def test_pricing_the_partition_size_of_a_pipeline_and_of_a_plan_nothing_fits(model):
    """tune.partition.choose_partition_size end to end: a 2-stage pipeline on one 8-GPU node prices
    t = 1, 2, 4 (a stage's ranks), takes one of them and resolves it; on a device too small for any
    shard every size is skipped with the reason and one node is taken, said so."""
    from micscompile.lowering.predict import concrete
    from micscompile.tune.partition import choose_partition_size, pick

    trace = concrete(mc.trace(model, _batch(2), lm_loss))
    cluster = mc.Cluster.preset("p4d.24xlarge")
    choice = choose_partition_size(trace, mc.Plan(pipeline_stages=2, micro_batches=2), cluster)
    assert [r.partition_size for r in choice.priced] == [1, 2, 4]
    assert all(r.prediction is not None for r in choice.priced), choice.table(cluster)
    assert choice.plan.stages == 2 and choice.plan.partition_size == pick(choice.priced, cluster, default=4).partition_size
    assert f"partition size {choice.plan.partition_size} (priced on p4d.24xlarge" in choice.why
    tiny = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, memory_bytes=1 << 10))
    choice = choose_partition_size(trace, mc.Plan(), tiny)
    assert choice.plan.partition_size == 8 and "none of 4 sizes fits" in choice.why, choice.why
    assert all(r.prediction is None and "alone are" in r.skipped for r in choice.priced)


@pytest.mark.parametrize("overhead", [0.0, 1e-3])
def test_coalesced_runs_price_as_their_actions(symbolic, overhead):
    """Without a timeline a run of compute and blocking tensor collectives is priced as one action
    (``simulator.coalesced``): the same step, exposed communication, compute, streams and peak as each action
    priced alone (the timeline's simulation), with collectives charged part of their time (overlap 0.4) and
    with a charge longer than a collective (1 ms of overhead each)."""
    from micscompile.cost_model.simulator import RUN, coalesced, simulate_program
    from micscompile.lowering.lowered import lower

    cluster = dataclasses.replace(mc.Cluster.preset("p4d.24xlarge"), nodes=1, gpus_per_node=4, overlap=0.4,
                                  collective_overhead_s=overhead)
    for sequence, ck in ((False, False), (True, "selective")):
        rp = mc.Plan(partition_size=2, tensor_parallel_size=2, sequence_parallel=sequence, micro_batches=3,
                     checkpoint=ck).resolve(4, 4)
        program = lower(tensor_split(symbolic.at_batch(2), 2, sequence), rp, cluster, planned_groups(rp),
                        need_graph=False).program
        runs = coalesced(program, cluster, "float32")
        assert sum(a.kind is RUN for a in runs) >= 4 and len(runs) < 0.6 * len(program.micro_step)
        each, one = simulate_program(program, cluster), simulate_program(program, cluster, record=False)
        for field in ("step_time_s", "exposed_comm_s", "compute_s", "comm_charged_s"):
            assert getattr(one, field) == pytest.approx(getattr(each, field), rel=1e-9), field
        assert one.peak_memory_bytes == each.peak_memory_bytes
        assert one.stream_busy_s == pytest.approx(each.stream_busy_s, rel=1e-9)


def test_a_pricer_over_sizes_prices_sequence_parallel_plans_as_simulate_does_every_time(symbolic):
    """The Pricer of a tensor split evaluated over several sizes (``split_over_sizes``: the counts are numpy
    arrays the lowering must not change in place) prices flat and pipelined sequence-parallel plans as
    ``mc.simulate`` prices each size's own split, and the same the second time (mutation caught: the lowering
    scaled a reduce-scatter's bytes by t in place, and each prediction grew t-fold on the last)."""
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    pricer = Pricer(symbolic, cl, [1, 2, 3])
    for stages, p in ((1, 2), (2, 1)):
        plan = mc.Plan(tensor_parallel_size=2, sequence_parallel=True, micro_batches=4, pipeline_stages=stages,
                       partition_size=p)
        want = mc.simulate(tensor_split(symbolic.at_batch(3), 2, True), plan, cl, prefetch=[mc.Prefetch(1)],
                           scaling=False).step_time_s
        for _ in range(2):
            assert pricer.predict(plan, 3, mc.Prefetch(1)).step_time_s == pytest.approx(want, rel=1e-9), stages


def test_autotune_in_two_processes_ranks_what_one_process_ranks(symbolic):
    """``workers=2`` prices the (t, sequence parallelism) groups in forked processes: the same candidates, the same
    predictions, in the same order (mutation caught: the groups' results concatenated in the order they finish)."""
    opts = dict(partition_sizes=(1, 2), pipeline_stages=(1, 2), micro_batch_sizes=(2, 4), checkpoint=(False,),
                offload=(False,), tensor=((1, False), (2, False), (2, True)), verbose=False, progress=False)
    peaks = sorted(c.peak_memory_bytes for c in mc.autotune(symbolic, mc.Cluster.preset("p4d.24xlarge", nodes=2),
                                                            global_batch_size=32, exhaustive=True, **opts))
    cl = _small_cluster(peaks[len(peaks) // 2])  # half of them do not fit: listed after the rest, in priced order
    one, two = (mc.autotune(symbolic, cl, global_batch_size=32, workers=w, exhaustive=True, **opts) for w in (1, 2))
    assert [(c.label(), c.feasible, c.step_time_s, c.reason, c.why) for c in two] == \
        [(c.label(), c.feasible, c.step_time_s, c.reason, c.why) for c in one]
    # best first, the workers share what a candidate must beat: which others they simulate depends on who is first,
    # not the top ones
    one, two = (mc.autotune(symbolic, cl, global_batch_size=32, workers=w, top=3, **opts) for w in (1, 2))
    assert [(c.label(), c.step_time_s) for c in two[:3]] == [(c.label(), c.step_time_s) for c in one[:3]]
    assert len({c.plan.tensor_parallel_size for c in one}) == 2 and 0 < sum(c.feasible for c in one) < len(one)


def test_every_floor_is_below_its_step_and_near_it(symbolic):
    """``Pricer.floor`` (and a flat plan's Program floor) bounds the predicted step from below for every plan class
    (flat sharded or not; 1F1B, ZB-H1, interleaved and interleaved zero-bubble pipelines; every checkpointing; tensor
    groups with sequence parallelism), and on a model whose compute outweighs the per-op overhead comes near
    of it (30%) in each class: what lets mc.autotune skip most candidates. Mutations caught: the recomputation left out of
    the floors (full checkpointing fails); a pipeline's floor without its schedule's timeline (the sum
    of its busiest rank's work); the flat gathers left out, or the buckets Prefetch.keep_live keeps counted as
    gathered again (the slow network's rows); the per-operation overhead left out (the tiny model's row); a 1F1B or
    interleaved pipeline's second hops left out, or a zero-bubble one's (the slow replicas' rows); interleaved zero
    bubble's timeline left out (0.40 there), or its B counting every backward operation of the chunk (a floor above
    its step); a pipeline's gradient accumulation left out (the few tokens' rows: 0.75-0.79)."""
    cfg = GPTConfig(vocab_size=8192, seq_len=1024, layers=4, hidden=1024, heads=16)
    with torch.device("meta"):
        medium = GPT(cfg)
    tg = mc.trace(medium, _batch(2, cfg), lm_loss, symbolic_batch=True)
    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    opts = dict(partition_sizes=(1, 8, 16), pipeline_stages=(1, 2), micro_batch_sizes=(1, 4), offload=(False,),
                checkpoint=(False, True, "selective"), tensor=((1, False), (2, True)), zero_bubble=(False, True))
    space = configs(cl.world_size, cl.gpus_per_node, 32, len(tg.blocks), hierarchical=("auto",), **opts)
    pricer = Pricer(tg, cl, [1, 4])
    near: dict[tuple, float] = {}
    for c in space:
        plan = c.plan(mc.Plan())
        for pf in prefetches(c):
            low, step = pricer.floor(plan, c.micro_batch, pf), pricer.predict(plan, c.micro_batch, pf).step_time_s
            program = pricer.predict(plan, c.micro_batch, pf, above=0.0)  # (a flat one's Program floor, all above 0)
            for floor in (low, program) if isinstance(program, float) else (low,):
                assert floor <= step * (1 + 1e-9), (plan, c.micro_batch, pf)
            key = (plan.pipeline_schedule if c.stages > 1 else "flat", plan.checkpoint, c.partition if c.stages == 1 else 0)
            near[key] = max(near.get(key, 0.0), low / step)
    assert len(near) == 21 and min(near.values()) > 0.7, sorted(near.items(), key=lambda kv: kv[1])[:4]
    # a model so small its operations' overhead is most of its compute: counted (mutation caught: left out)
    tiny = Pricer(symbolic, cl, [2])
    plan = mc.Plan()
    assert 0.2 < tiny.floor(plan, 2) / tiny.predict(plan, 2, mc.Prefetch(distance=0)).step_time_s <= 1
    # where the network is slow, a sharded flat plan's gathers set its floor
    slow = dataclasses.replace(cl, inter=dataclasses.replace(cl.inter, bandwidth_bps=cl.inter.bandwidth_bps / 100))
    pricer = Pricer(tg, slow, [1, 4])
    plan = mc.Plan(partition_size=16, micro_batches=2)
    for pf in (mc.Prefetch(distance=1), mc.Prefetch(distance=2, keep_live=3)):  # (kept: not gathered again)
        low, step = pricer.floor(plan, 1, pf), pricer.predict(plan, 1, pf).step_time_s
        assert 0.7 * step < low <= step, pf
    # there the replicas' links are slow too: a pipeline's second hops over its 8 replicas after its chunks' last
    # backwards set its floor, on the timeline of 1F1B and interleaved, after a rank's work on any schedule
    piped = mc.Plan(pipeline_stages=2, micro_batches=4, partition_size=1)
    for plan in (piped, piped.replace(pipeline_schedule="zb-h1"),
                 piped.replace(pipeline_chunks=2, pipeline_schedule="interleaved"),
                 piped.replace(pipeline_chunks=2, pipeline_schedule="interleaved-zb")):
        low, step = pricer.floor(plan, 1), pricer.predict(plan, 1, mc.Prefetch(distance=0)).step_time_s
        assert 0.9 * step < low <= step, (plan.pipeline_schedule, low, step)
        assert pricer.floor(plan, 1, timeline=False) <= low  # (what autotune orders by: lower, without the timeline)
    # few tokens and wide blocks: each micro-batch's gradient accumulation is much of a chunk's backward, counted
    few = GPTConfig(vocab_size=8192, seq_len=8, layers=4, hidden=2048, heads=16)
    with torch.device("meta"):
        wide = GPT(few)
    pricer = Pricer(mc.trace(wide, _batch(2, few), lm_loss, symbolic_batch=True), cl, [1, 4])
    for plan in (piped, piped.replace(pipeline_schedule="zb-h1"),
                 piped.replace(pipeline_chunks=2, pipeline_schedule="interleaved"),
                 piped.replace(pipeline_chunks=2, pipeline_schedule="interleaved-zb")):
        low, step = pricer.floor(plan, 1), pricer.predict(plan, 1, mc.Prefetch(distance=0)).step_time_s
        assert 0.8 * step < low <= step, (plan.pipeline_schedule, low, step)


@pytest.mark.parametrize("tensor", [1, 2])
def test_each_chunks_b_and_w_floors_are_below_what_its_lowering_puts_there(tensor):
    """``floor.backward_phase_floors``: what is surely in a zero-bubble chunk's B and surely in its W, floored from the
    trace, is below each phase of the chunk as lowered and priced, chunk by chunk, on a model with a tied
    embedding (its head's gradient summed into the embedding's). Mutation caught: the tied gradient's sums taken as
    a path (the head's weight gradient counted in the last chunk's B)."""
    from micscompile.cost_model.pipeline import price_chunk
    from micscompile.tune.floor import backward_phase_floors

    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    plan = mc.Plan(pipeline_stages=2, pipeline_chunks=2, micro_batches=4,
                   pipeline_schedule="interleaved-zb", tensor_parallel_size=tensor, sequence_parallel=tensor > 1)
    rp = plan.resolve(cl.world_size, cl.gpus_per_node)
    cfg = GPTConfig(vocab_size=8192, seq_len=1024, layers=4, hidden=1024, heads=16)  # (compute outweighs overheads)
    with torch.device("meta"):
        medium = GPT(cfg)
    tg = mc.trace(medium, _batch(2, cfg), lm_loss)
    tg = tensor_split(tg, tensor, True) if tensor > 1 else tg
    pp = lower_pipeline(tg, rp, cl, planned_groups(rp), prefetch=[mc.Prefetch(distance=0)])
    pricer = Pricer(tg, cl, [2])
    units = pricer._unit_analysis()[0]
    ranks = planned_groups(rp)["tensor"].ranks if tensor > 1 else [0]
    to_b, to_w = backward_phase_floors(tg, units, cl, "float32", ranks, 1)
    starts = pp.split.starts
    assert starts == pricer._cuts(rp, 0)
    floors, phases = np.zeros(2), np.zeros(2)
    for c, (a, e) in enumerate(zip(starts, (*starts[1:], len(units)))):
        price = price_chunk(pp.program(c), cl)
        b, w = float(to_b[a:e, a, 0].sum()), float(to_w[a:e, a, 0].sum())
        assert b <= price.backward.step_time_s * (1 + 1e-9) and w <= price.weight.step_time_s * (1 + 1e-9), (c, b, w)
        floors += (b, w)
        phases += (price.backward.step_time_s, price.weight.step_time_s)
    assert (floors > 0.5 * phases).all(), (floors, phases)  # (near: the loss's backward, outside the units, is not)


def test_the_best_zero_bubble_pipelines_twin_is_simulated_where_its_floor_skipped_it(symbolic):
    """print_zero_bubble compares the best zero-bubble pipeline with the same plan under 1F1B: best first, that twin
    is simulated after the search where its floor had skipped it (mutation caught: ``_price_twin`` a no-op)."""
    from micscompile.tune.autotune import Candidate, _Job

    cl = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    pricer = Pricer(symbolic, cl, [2])
    zb = mc.Plan(pipeline_stages=2, micro_batches=4, pipeline_schedule="zb-h1")
    twin = dataclasses.replace(zb, pipeline_schedule="1f1b")
    pf = mc.Prefetch(distance=1)
    job = _Job(pricer, mc.Plan(), cl, 64, None, 1, top=1)
    out = [job._priced(zb, 2, pf, pricer.predict(zb, 2, pf), 0.0), Candidate(twin, 2, pf, False, "not simulated", floor_s=1.0)]
    job._price_twin(out)
    assert out[1].prediction is not None and out[1].step_time_s == pricer.predict(twin, 2, pf).step_time_s
    assert out[1].floor_s == 1.0 and out[1].feasible
