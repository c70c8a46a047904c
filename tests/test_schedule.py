"""The schedule pass: prefetch distance under a memory budget, chosen with the simulator."""

import dataclasses
from collections import Counter

import pytest
import torch
from models import meta_lm_trace

import micscompile as mc
from micscompile.core import collectives as C
from micscompile.core.program import Kind, ProgramError
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.flat import lower_flat, with_keep_live, with_prefetch
from micscompile.lowering.groups import planned_groups
from micscompile.passes.context import make_context
from micscompile.passes.insert_collectives import insert_collectives_pass
from micscompile.zoo.models import GPT, GPTConfig
from micscompile.zoo.models import lm_loss as gpt_loss


@pytest.fixture(scope="module")
def lm_trace():
    return meta_lm_trace(vocab=256, h=32, layers=4, batch=4, seq=16)


def rewrite(tg, p, distance):
    ctx = make_context(tg, mc.Plan(partition_size=p).resolve(4), prefetch=mc.Prefetch(distance=distance))
    graph = insert_collectives_pass(tg.graph_copy(), ctx)
    graph.lint()
    return graph


def test_prefetch_distance_moves_issues_only(lm_trace):
    graphs = {d: rewrite(lm_trace, 2, d) for d in range(4)}
    counts = {d: Counter(n.target for n in g.nodes if n.op == "call_function") for d, g in graphs.items()}
    assert all(c == counts[0] for c in counts.values())
    for d, g in graphs.items():
        nodes = list(g.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        waits = [n for n in nodes if n.target is C.collective_wait and n.args[1].target is C.all_gather_issue]
        if d == 0:
            assert all(nodes[pos[w] - 1] is w.args[1] for w in waits)  # issued right before its wait
            continue
        # a gather issued d intervals ahead has the waits of d - 1 other gathers before its own
        waits_between = [sum(pos[w.args[1]] < pos[x] < pos[w] for x in waits) for w in waits]
        assert max(waits_between) == d - 1, (d, waits_between)
        assert any(nodes[pos[w] - 1] is not w.args[1] for w in waits)


@pytest.mark.parametrize("p", [2, 4])
def test_moving_issues_in_the_program_equals_lowering_at_that_distance(lm_trace, p):
    """The search moves issues in one Program; compile lowers the graph at the chosen distance."""
    rp = mc.Plan(partition_size=p, micro_batches=2).resolve(4)
    base = lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(0,)).program
    for keep in (0, 1, 2):
        for d in (0, 1, 2, 3):
            for across in (False, True):
                pf = mc.Prefetch(d, keep, across)
                lowered = lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(pf,))
                derived = with_prefetch(with_keep_live(base, keep), d, across).micro_step
                lowered.program.validate()
                assert lowered.prefetch == pf
                if keep == 0:
                    assert derived == lowered.program.micro_step, pf
                    continue
                # kept buckets: the same collectives; the compute lacks only the views not re-derived
                assert [a for a in derived if a.kind is not Kind.COMPUTE] == \
                       [a for a in lowered.program.micro_step if a.kind is not Kind.COMPUTE], pf
                flops = [sum(a.flops for a in steps) for steps in (derived, lowered.program.micro_step)]
                assert flops[0] == flops[1]


def test_deeper_prefetch_keeps_more_gathered(lm_trace):
    rp = mc.Plan(partition_size=4).resolve(4)
    peaks = [lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(d,)).program.peak_gathered_bytes
             for d in range(4)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_budget_is_law(lm_trace):
    """Every budget from the minimum up gets a Program within it; below the minimum, a clear error."""
    cluster = Cluster.preset("p4d.24xlarge")
    rp_free = mc.Plan(partition_size=8).resolve(8)
    peaks = sorted({lower_flat(lm_trace, rp_free, cluster, planned_groups(rp_free), prefetch=(d,)).program.peak_gathered_bytes
                    for d in range(5)})
    for budget in [*peaks, *(a + (b - a) // 2 for a, b in zip(peaks, peaks[1:]))]:
        rp = mc.Plan(partition_size=8, memory_budget_bytes=budget).resolve(8)
        sched = lower_flat(lm_trace, rp, cluster, planned_groups(rp))
        assert sched.program.peak_gathered_bytes <= budget
        assert mc.simulate(lm_trace, rp.plan, cluster).peak_memory_bytes > 0
    rp = mc.Plan(partition_size=8, memory_budget_bytes=peaks[0] - 1).resolve(8)
    with pytest.raises(mc.PlanError, match=f"below {peaks[0]:,} bytes"):
        lower_flat(lm_trace, rp, cluster, planned_groups(rp))


def test_same_trace_and_plan_give_the_same_program():
    def program():
        tg = meta_lm_trace(vocab=128, h=16, layers=3, batch=2, seq=8)
        rp = mc.Plan(partition_size=4, micro_batches=2).resolve(8)
        return lower_flat(tg, rp, Cluster.preset("p3dn.24xlarge"), planned_groups(rp)).program

    a, b = program(), program()
    assert a.fingerprint() == b.fingerprint() and str(a) == str(b)


def test_schedule_hides_gathers_on_p4d():
    """GPT 13B-class layers (h 5120, seq 2048), p = 8 on 16 p4d nodes: the scheduled Program exposes at
    most half the communication of gathering at the use, and less than one-ahead prefetch (beside the
    boundary's replicate all-reduce, which nothing computes beside)."""
    cfg = GPTConfig(vocab_size=50304, seq_len=2048, layers=6, hidden=5120, heads=40)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    tg = mc.trace(model, (x, x), gpt_loss)
    cluster = Cluster.preset("p4d.24xlarge", nodes=16)
    plan = mc.Plan(partition_size=8, micro_batches=4)
    preds = {d: mc.simulate(tg, plan, cluster, scaling=False, prefetch=d) for d in ((0,), (1,), None)}
    exposed = {d: p.exposed_comm_s - p.stream_busy_s["comm:replicate"] for d, p in preds.items()}
    assert exposed[None] <= 0.5 * exposed[(0,)]
    assert exposed[None] < exposed[(1,)]


def test_program_prints_predicted_times_and_exports_a_timeline(lm_trace, tmp_path):
    import json

    rp = mc.Plan(partition_size=4, micro_batches=2).resolve(8)
    program = lower_flat(lm_trace, rp, Cluster.preset("p4d.24xlarge"), planned_groups(rp)).program
    text = str(program)
    assert "predicted on p4d.24xlarge" in text and "start ms" in text
    spans = program.predict().action_spans
    assert len(spans) == len(program.micro_step) + len(program.boundary)
    assert all(end >= start >= 0 for start, end, _ in spans)
    first = [program.issues(a, 0) for a in program.micro_step] + [True] * len(program.boundary)
    starts = [start for (start, _, _), f in zip(spans, first) if f]
    assert starts == sorted(starts)  # the first micro-step's actions, then the boundary's, start in Program order
    hops = [i for i, a in enumerate(program.micro_step) if a.kind is Kind.SECOND_HOP]
    assert len(hops) == len(program.layouts) and all(spans[i][0] > starts[-len(program.boundary) - 1] for i in hops)
    program.to_chrome_trace(tmp_path / "p.json")
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert {"compute", "comm:shard"} <= {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(e["ph"] == "C" for e in events)
    bare = lower_flat(lm_trace, rp, None, planned_groups(rp)).program
    assert "start ms" not in str(bare)
    with pytest.raises(ValueError, match="no cluster"):
        bare.predict()


def test_keep_live_trades_gathers_for_gathered_bytes(lm_trace):
    """Buckets kept live from forward into backward are gathered once per micro-step, not twice, and
    stay gathered across the forward/backward turn."""
    rp = mc.Plan(partition_size=4).resolve(4)
    programs = [lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(mc.Prefetch(1, k),)).program
                for k in range(4)]
    gathers = [sum(a.kind is Kind.ALL_GATHER for a in prog.micro_step) for prog in programs]
    assert gathers == [gathers[0] - k for k in range(4)]
    peaks = [prog.peak_gathered_bytes for prog in programs]
    # one ahead, the head's backward gather of the tied embedding was issued while its forward gather
    # was still live: keeping that one bucket live lowers the peak; keeping blocks live raises it
    assert peaks[1] < peaks[0] < peaks[3]
    with pytest.raises(mc.PlanError, match="keep_live=99"):
        lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(mc.Prefetch(1, 99),))


def test_across_micro_steps_carries_the_first_gathers(lm_trace):
    rp = mc.Plan(partition_size=4, micro_batches=3).resolve(4)
    for d in (1, 2, 3):
        prog = lower_flat(lm_trace, rp, None, planned_groups(rp), prefetch=(mc.Prefetch(d, 0, True),)).program
        nxt = [a.bucket for a in prog.micro_step if a.kind is Kind.ALL_GATHER_NEXT]
        carried = [a.bucket for a in prog.micro_step if a.carried]
        assert nxt == carried and len(nxt) == d
        assert prog.max_gathers_in_flight == d
        # the first micro-step issues every gather itself, the others skip the carried ones, the last
        # issues no next-gathers
        n = sum(a.kind is Kind.ALL_GATHER for a in prog.micro_step)
        assert [sum(a.kind is Kind.ALL_GATHER for a in prog.issued_in(mb)) for mb in range(3)] == [n, n - d, n - d]
        assert [sum(a.kind is Kind.ALL_GATHER_NEXT for a in prog.issued_in(mb)) for mb in range(3)] == [d, d, 0]
        assert len(prog.collective_order()) == 3 * sum(a.kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER)
                                                       for a in prog.micro_step) + len(prog.boundary) - 1
    single = mc.Plan(partition_size=4, micro_batches=1).resolve(4)
    prog = lower_flat(lm_trace, single, None, planned_groups(single), prefetch=(mc.Prefetch(2, 0, True),)).program
    assert not any(a.kind is Kind.ALL_GATHER_NEXT or a.carried for a in prog.micro_step)


def test_search_takes_each_knob_only_when_faster_and_caps_gathers_in_flight(lm_trace):
    cluster = Cluster.preset("p4d.24xlarge")
    rp = mc.Plan(partition_size=8, micro_batches=2).resolve(8)
    sched = lower_flat(lm_trace, rp, cluster, planned_groups(rp))
    times = [c.step_time_s for c in sched.candidates]
    chosen = next(c for c in sched.candidates if c.prefetch == sched.prefetch)
    assert chosen.step_time_s == min(times)
    assert {c.prefetch.across_micro_steps for c in sched.candidates} == {False, True}
    assert any(c.prefetch.keep_live for c in sched.candidates)
    for limit in (1, 2):
        capped = mc.Plan(partition_size=8, micro_batches=2, max_gathers_in_flight=limit).resolve(8)
        sched = lower_flat(lm_trace, capped, cluster, planned_groups(capped))
        assert sched.program.max_gathers_in_flight <= limit
        assert max(c.prefetch.distance for c in sched.candidates) <= limit


def test_validate_refuses_a_broken_program(lm_trace):
    rp = mc.Plan(partition_size=2, micro_batches=2).resolve(4)
    prog = lower_flat(lm_trace, rp, None, planned_groups(rp)).program
    prog.validate()
    steps = prog.micro_step
    first_wait = next(i for i, a in enumerate(steps) if a.kind is Kind.WAIT)
    first_release = next(i for i, a in enumerate(steps) if a.kind is Kind.RELEASE)
    broken = {
        "not issued": [a for a in steps if a.kind is not Kind.ALL_GATHER],
        "not gathered": steps[:first_wait] + steps[first_wait + 1:],
        "not waited": [a for i, a in enumerate(steps) if not (a.kind is Kind.WAIT and a.waits_for is Kind.REDUCE_SCATTER)],
        "not released": steps[:first_release] + steps[first_release + 1:],
    }
    for match, actions in broken.items():
        with pytest.raises(ProgramError, match=match):
            dataclasses.replace(prog, micro_step=actions).validate()


def test_second_hop_runs_under_the_last_backward(tmp_path):
    """The last micro-step starts each bucket's all-reduce over the replicas as soon as
    its reduce-scatter is done, under the rest of the backward: the boundary waits for under a third
    of their time (all of it, were they issued there)."""
    import json

    tg = meta_lm_trace(vocab=4096, h=1024, layers=8, batch=8, seq=512)
    rp = mc.Plan(partition_size=8, micro_batches=2).resolve(16)  # two p4d nodes: d = 2 across them
    program = lower_flat(tg, rp, Cluster.preset("p4d.24xlarge", nodes=2), planned_groups(rp), need_graph=False).program
    assert [a.kind for a in program.micro_step].count(Kind.SECOND_HOP) == len(program.layouts)
    hop = program.predict()
    busy = hop.stream_busy_s["comm:replicate"]
    assert 0 < hop.exposed_boundary_s < 0.3 * busy
    program.to_chrome_trace(tmp_path / "hop.json")
    events = json.loads((tmp_path / "hop.json").read_text())["traceEvents"]
    tid = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    backward_end = max(e["ts"] + e["dur"] for e in events if e.get("tid") == tid["compute"] and e["ph"] == "X"
                       and e["name"].startswith("bwd"))
    hops = [e for e in events if e.get("tid") == tid["comm:replicate"] and e["ph"] == "X"]
    assert len(hops) == len(program.layouts) and sum(e["ts"] < backward_end for e in hops) >= len(hops) - 2


@pytest.mark.hf
def test_two_buckets_whose_forward_ends_in_one_matmul_keep_live_as_the_search_chose():
    """BERT's MLM decoder reads the tied word embedding (bucket 0) and the head's bias in one addmm: both
    buckets' last forward use is that node. The search kept the one whose release the Program puts last, the
    pass the other, and compile refused a valid plan ("the lowered graph's collectives differ"; plan fuzzer
    seed 300018). Mutation: ordering the pass's candidates by their last node alone fails (keep=1)."""
    from micscompile.zoo import hf_models

    torch.manual_seed(0)
    model = hf_models.build("bert", seq_len=8)
    x, y = hf_models.lm_batch(model, 2, 8, torch.Generator().manual_seed(1))
    tg = mc.trace(model, (x, y), hf_models.lm_loss)
    rp = mc.Plan(partition_size=2, micro_batches=2).resolve(4)
    base = lower_flat(tg, rp, None, planned_groups(rp), prefetch=(0,)).program
    for keep in (1, 2):
        lowered = lower_flat(tg, rp, None, planned_groups(rp), prefetch=(mc.Prefetch(0, keep),))  # raised
        derived = with_keep_live(base, keep).micro_step
        assert [a for a in derived if a.kind is not Kind.COMPUTE] == \
               [a for a in lowered.program.micro_step if a.kind is not Kind.COMPUTE], keep
