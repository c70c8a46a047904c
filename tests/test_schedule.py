"""The schedule pass: prefetch distance under a memory budget, chosen with the simulator."""

from collections import Counter

import pytest
import torch

import micscompile as mc
from micscompile import collectives as C
from micscompile.cost_model.specs import Cluster
from micscompile.models import GPT, GPTConfig
from micscompile.models import lm_loss as gpt_loss
from micscompile.passes.context import make_context
from micscompile.passes.insert_collectives import insert_collectives_pass
from micscompile.passes.schedule import schedule, with_prefetch
from micscompile.predict import planned_groups
from models import meta_lm_trace


@pytest.fixture(scope="module")
def lm_trace():
    return meta_lm_trace(vocab=256, h=32, layers=4, batch=4, seq=16)


def rewrite(tg, p, distance):
    ctx = make_context(tg, mc.Plan(partition_size=p).resolve(4), prefetch_distance=distance)
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
    base = schedule(lm_trace, rp, None, planned_groups(rp), distances=(0,)).program
    for d in (1, 2, 3):
        lowered = schedule(lm_trace, rp, None, planned_groups(rp), distances=(d,))
        assert with_prefetch(base, d).micro_step == lowered.program.micro_step, d
        assert lowered.distance == d


def test_deeper_prefetch_keeps_more_gathered(lm_trace):
    rp = mc.Plan(partition_size=4).resolve(4)
    peaks = [schedule(lm_trace, rp, None, planned_groups(rp), distances=(d,)).program.peak_gathered_bytes
             for d in range(4)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_budget_is_law(lm_trace):
    """Every budget from the minimum up gets a Program within it; below the minimum, a clear error."""
    cluster = Cluster.preset("p4d.24xlarge")
    rp_free = mc.Plan(partition_size=8).resolve(8)
    peaks = sorted({schedule(lm_trace, rp_free, cluster, planned_groups(rp_free), distances=(d,)).program.peak_gathered_bytes
                    for d in range(5)})
    for budget in [*peaks, *(a + (b - a) // 2 for a, b in zip(peaks, peaks[1:]))]:
        rp = mc.Plan(partition_size=8, memory_budget_bytes=budget).resolve(8)
        sched = schedule(lm_trace, rp, cluster, planned_groups(rp))
        assert sched.program.peak_gathered_bytes <= budget
        assert mc.simulate(lm_trace, rp.plan, cluster).peak_memory_bytes > 0
    rp = mc.Plan(partition_size=8, memory_budget_bytes=peaks[0] - 1).resolve(8)
    with pytest.raises(mc.PlanError, match=f"below {peaks[0]:,} bytes"):
        schedule(lm_trace, rp, cluster, planned_groups(rp))


def test_same_trace_and_plan_give_the_same_program():
    def program():
        tg = meta_lm_trace(vocab=128, h=16, layers=3, batch=2, seq=8)
        rp = mc.Plan(partition_size=4, micro_batches=2).resolve(8)
        return schedule(tg, rp, Cluster.preset("p3dn.24xlarge"), planned_groups(rp)).program

    a, b = program(), program()
    assert a.fingerprint() == b.fingerprint() and str(a) == str(b)


def test_schedule_hides_gathers_on_p4d():
    """GPT 13B-class layers (h 5120, seq 2048), p = 8 on 16 p4d nodes: the scheduled Program exposes at
    most half the communication of gathering at the use, and less than one-ahead prefetch."""
    cfg = GPTConfig(vocab_size=50304, seq_len=2048, layers=6, hidden=5120, heads=40)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    tg = mc.trace(model, (x, x), gpt_loss)
    cluster = Cluster.preset("p4d.24xlarge", nodes=16)
    plan = mc.Plan(partition_size=8, micro_batches=4)
    exposed = {d: mc.simulate(tg, plan, cluster, scaling=False, prefetch_distances=d).exposed_comm_s
               for d in ((0,), (1,), None)}
    assert exposed[None] <= 0.5 * exposed[(0,)]
    assert exposed[None] < exposed[(1,)]


def test_program_prints_predicted_times_and_exports_a_timeline(lm_trace, tmp_path):
    import json

    rp = mc.Plan(partition_size=4, micro_batches=2).resolve(8)
    program = schedule(lm_trace, rp, Cluster.preset("p4d.24xlarge"), planned_groups(rp)).program
    text = str(program)
    assert "predicted on p4d.24xlarge" in text and "start ms" in text
    spans = program.predict().action_spans
    assert len(spans) == len(program.micro_step) + len(program.boundary)
    assert all(end >= start >= 0 for start, end, _ in spans)
    starts = [start for start, _, _ in spans]
    assert starts == sorted(starts)  # actions start in Program order
    program.to_chrome_trace(tmp_path / "p.json")
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert {"compute", "comm:shard"} <= {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(e["ph"] == "C" for e in events)
    bare = schedule(lm_trace, rp, None, planned_groups(rp)).program
    assert "start ms" not in str(bare)
    with pytest.raises(ValueError, match="no cluster"):
        bare.predict()
