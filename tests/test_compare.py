"""simulate --compare-peers: micscompile's best partition size against the peers, on one trace."""

import pytest
from models import meta_lm_trace

import micscompile as mc
from micscompile.tune.compare import compare_peers, format_table


@pytest.fixture(scope="module")
def lm_trace():
    return meta_lm_trace(vocab=512, h=64, layers=4, batch=8, seq=32)


def test_rows_per_cluster_size_and_the_best_partition_size(lm_trace):
    cluster = mc.Cluster.preset("p3dn.24xlarge")
    rows = compare_peers(lm_trace, cluster, [1, 4], mc.Plan(micro_batches=1))
    by = {(r.nodes, r.system): r for r in rows}
    assert set(by) == {(1, "micscompile"), (1, "deepspeed-zero3"), (1, "fsdp2"), (1, "megatron"),
                       (4, "micscompile"), (4, "deepspeed-zero3"), (4, "fsdp2"), (4, "fsdp2-hsdp"), (4, "megatron")}
    # micscompile's row is its fastest partition size and gathers across nodes that fit
    sizes = {(p, h): mc.simulate(lm_trace, mc.Plan(partition_size=p, hierarchical=h), cluster.with_nodes(4),
                                 scaling=False) for p in (8, 16, 32) for h in ("auto", False)}
    best = min(sizes, key=lambda ph: sizes[ph].step_time_s)
    assert by[4, "micscompile"].partition_size == best[0]
    assert by[4, "micscompile"].prediction.step_time_s == pytest.approx(sizes[best].step_time_s)
    # the peers are their own models: ZeRO-3 over every rank, HSDP sharded in a node
    z3 = mc.simulate(lm_trace, mc.Plan(), cluster.with_nodes(4), scaling=False, system="deepspeed-zero3")
    assert by[4, "deepspeed-zero3"].prediction.step_time_s == pytest.approx(z3.step_time_s)
    assert by[4, "fsdp2-hsdp"].partition_size == 8 and by[4, "fsdp2"].partition_size == 32
    # Megatron-LM: its fastest tensor group in a node (a small model: no pipeline), the same global batch
    tensor = {t: mc.simulate(lm_trace, mc.Plan(tensor_parallel_size=t, micro_batches=t), cluster.with_nodes(4),
                             scaling=False, system="megatron") for t in (1, 2, 4, 8)}
    t = min(tensor, key=lambda t: tensor[t].step_time_s)
    assert (by[4, "megatron"].tensor, by[4, "megatron"].stages) == (t, 1)
    assert by[4, "megatron"].prediction.step_time_s == pytest.approx(tensor[t].step_time_s)
    table = format_table(rows)
    assert table.count("\n") >= 4 and "x" in table.splitlines()[3]


def test_hsdp_with_several_micro_batches_is_priced_and_bad_sizes_are_refused(lm_trace):
    rows = compare_peers(lm_trace, mc.Cluster.preset("p4d.24xlarge"), [2], mc.Plan(micro_batches=2))
    hsdp = next(r for r in rows if r.system == "fsdp2-hsdp")
    assert hsdp.partition_size == 8 and hsdp.prediction.stream_busy_s["comm:replicate"] > 0
    with pytest.raises(ValueError, match="positive cluster sizes"):
        compare_peers(lm_trace, mc.Cluster.preset("p4d.24xlarge"), [0])
