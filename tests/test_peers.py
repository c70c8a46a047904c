"""The peers priced on the same trace (micscompile/lowering/peers.py, docs/peer-models.md): each rule
of a peer's model changes the prediction the way its runtime does."""

import dataclasses

import pytest
import torch
from models import meta_lm_trace

import micscompile as mc
from micscompile.core.program import Kind, Prefetch
from micscompile.core.sharding import BucketLayout, ParamSlot
from micscompile.cost_model.collective_time import ALL_GATHER, collective_time_s
from micscompile.cost_model.simulator import RuntimeCosts, simulate_program
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.lowered import lower
from micscompile.lowering.peers import fetch_batches, peer, reduce_buckets


@pytest.fixture(scope="module")
def lm_trace():
    """Matrices above DeepSpeed's persistence threshold (1e5 elements), which it gathers."""
    return meta_lm_trace(vocab=512, h=512, layers=3, batch=8, seq=32)


def _layout(params: list[tuple[str, int]], dtype=torch.float16) -> BucketLayout:
    slots, offset = [], 0
    for name, numel in params:
        slots.append(ParamSlot(name, (numel,), numel, offset))
        offset += numel
    return BucketLayout(index=0, name="b", slots=tuple(slots), partition_size=1, row_numel=offset, dtype=torch.float32,
                        param_dtype=dtype)


def test_deepspeed_fetches_modules_in_batches_of_at_most_the_prefetch_bucket():
    """Modules (parameters grouped by owner) packed in order into batches of <= limit elements, a larger
    module alone, parameters at or under the persistence threshold left out; 16-bit bytes."""
    lay = _layout([("q.weight", 30), ("q.bias", 3), ("o.weight", 17), ("fc1.weight", 40), ("fc2.weight", 60),
                   ("ln.weight", 2)])
    assert fetch_batches(lay, limit=50, persistent=3) == (47 * 2, 40 * 2, 60 * 2)
    assert fetch_batches(lay, limit=50) == (50 * 2, 40 * 2, 60 * 2, 2 * 2)  # in order: ln after fc2
    # v0.5.x: one all-gather per parameter (_allgather_params_coalesced loops over them)
    assert fetch_batches(lay, limit=50, persistent=3, per_parameter=True) == (30 * 2, 17 * 2, 40 * 2, 60 * 2)


def test_gather_pieces_price_each_piece_as_its_own_collective(lm_trace):
    """A gather issued as pieces costs the pieces' collectives one after the other on its stream."""
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    rp = mc.Plan(partition_size=16, micro_batches=1, hierarchical=False).resolve(16, 8)
    program = lower(lm_trace, rp, cluster, planned_groups(rp), prefetch=(Prefetch(distance=0),), need_graph=False).program
    whole = simulate_program(program, cluster, record=False)
    bucket = next(a for a in program.micro_step if a.kind is Kind.ALL_GATHER)
    halves = (bucket.tensor_bytes // 2, bucket.tensor_bytes - bucket.tensor_bytes // 2)
    split = simulate_program(program, cluster, record=False, runtime=RuntimeCosts(gather_pieces={bucket.bucket: halves}))
    ranks = program.groups["shard"].ranks
    n_gathers = sum(1 for a in program.issued_in(0) if a.kind is Kind.ALL_GATHER and a.bucket == bucket.bucket)
    extra = sum(collective_time_s(ALL_GATHER, b, ranks, cluster) for b in halves) - \
        collective_time_s(ALL_GATHER, bucket.tensor_bytes, ranks, cluster)
    assert extra > 0 and n_gathers >= 1
    assert split.stream_busy_s["comm:shard"] - whole.stream_busy_s["comm:shard"] == pytest.approx(n_gathers * extra)


def test_deepspeed_reduces_gradients_in_its_buckets():
    """Gradients fill 5e8-element buckets in backward order (last block first), reduced when the next
    block would overflow; blocks whose gradients wait reduce nothing; the first block the rest."""
    def lay(i, numel):
        return dataclasses.replace(_layout([(f"m{i}.weight", numel)]), index=i)
    layouts = [lay(0, 30), lay(1, 40), lay(2, 25), lay(3, 50)]  # backward: 3, 2, 1, 0
    assert reduce_buckets(layouts, limit=80) == {3: (), 2: (), 1: (75 * 4,), 0: (70 * 4,)}  # fp32 gradients
    assert reduce_buckets(layouts, limit=1000) == {3: (), 2: (), 1: (), 0: (145 * 4,)}
    assert sum(map(sum, reduce_buckets(layouts, limit=10).values())) == 145 * 4  # every gradient once
    # v0.5.x: a full bucket is reduce-scattered one parameter per call (_reduce_scatter_gradients)
    assert reduce_buckets(layouts, limit=80, per_parameter=True) == {3: (), 2: (), 1: (50 * 4, 25 * 4),
                                                                     0: (40 * 4, 30 * 4)}
    # gradients arrive per parameter (a hook each): a block larger than the bucket reduces inside itself
    big = [dataclasses.replace(_layout([(f"m{i}.a", a), (f"m{i}.b", b)]), index=i)
           for i, (a, b) in enumerate([(30, 30), (100, 100), (100, 100)])]
    assert reduce_buckets(big, limit=150) == {2: (100 * 4,), 1: (100 * 4, 100 * 4), 0: (130 * 4, 30 * 4)}
    assert reduce_buckets(big, limit=150, per_parameter=True) == {2: (100 * 4,), 1: (100 * 4, 100 * 4),
                                                                   0: (100 * 4, 30 * 4, 30 * 4)}


def test_deepspeed_zero3_v05_issues_a_collective_per_parameter(lm_trace):
    """The thesis's DeepSpeed (v0.5.x) all-gathers and reduce-scatters one parameter per call, each
    paying a collective's latency, where today's issues one per batch and per bucket: the same bytes,
    a busier stream and a longer step. Both prefetch one fetch."""
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    plan = mc.Plan(partition_size=16, micro_batches=2, hierarchical=False)
    small = {"reduce_bucket_size": 1}  # (a bucket per block: reductions during backward)
    old = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.5", peer_config=small)
    new = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3", peer_config=small)
    assert old.stream_busy_s["comm:shard"] > new.stream_busy_s["comm:shard"]
    assert old.step_time_s > new.step_time_s
    assert peer("deepspeed-zero3", plan, 16).prefetch == peer("deepspeed-zero3-v0.5", plan, 16).prefetch == \
        (Prefetch(distance=1),)
    assert peer("deepspeed-zero3-v0.5", plan, 16).per_parameter and not peer("deepspeed-zero3", plan, 16).per_parameter
    # v0.5.x's fetch ends in torch.cuda.synchronize(), which waits for the reductions in flight: without
    # it they would run beside the next block's compute
    # (released after use, so that backward fetches again)
    released = {**small, "stage3_max_reuse_distance": 0}
    synced = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.5", peer_config=released)
    unsynced = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.5", peer_config=released,
                           sync_at_fetch=False)
    assert synced.step_time_s > unsynced.step_time_s and synced.compute_s == unsynced.compute_s
    # today's copies each fetched parameter out of the gathered buffer (torch.cat per parameter); v0.5.x
    # all-gathered each parameter into its own storage
    assert peer("deepspeed-zero3", plan, 16).copy_out == "parameter" and peer("deepspeed-zero3-v0.5", plan, 16).copy_out is None
    assert new.compute_s > mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3", peer_config=small,
                                       copy_out_ops=None).compute_s


def test_deepspeed_keeps_gathers_live_within_its_reuse_distance(lm_trace):
    """stage3_max_reuse_distance: a block whose later blocks hold at most half of it keeps its forward
    gather into backward (gathered once per micro-step); the config is DeepSpeed's own keys."""
    def lay(i, numel):
        return dataclasses.replace(_layout([(f"m{i}.weight", numel)]), index=i)
    layouts = [lay(0, 30), lay(1, 40), lay(2, 25), lay(3, 50)]
    assert peer("deepspeed-zero3", mc.Plan(), 16).kept_live(layouts) == 4  # 1e9 keeps a small model
    tight = peer("deepspeed-zero3", mc.Plan(), 16, {"stage3_max_reuse_distance": 150})
    assert tight.kept_live(layouts) == 3  # 2 * (50 + 25) <= 150 < 2 * (50 + 25 + 40)
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    plan = mc.Plan(partition_size=16, micro_batches=2)
    kept = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3")
    released = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3", peer_config={"stage3_max_reuse_distance": 0})
    assert kept.stream_busy_s["comm:shard"] < released.stream_busy_s["comm:shard"]
    with pytest.raises(ValueError, match="peer_config takes DeepSpeed's"):
        mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3", peer_config={"stage3_max_live": 1})
    with pytest.raises(ValueError, match="for a DeepSpeed system"):
        mc.simulate(lm_trace, plan, cluster, system="fsdp2", peer_config={"reduce_bucket_size": 1})


def test_deepspeed_zero3_shards_over_every_rank_whatever_the_plan(lm_trace):
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    a = mc.simulate(lm_trace, mc.Plan(partition_size=8, micro_batches=2), cluster, system="deepspeed-zero3")
    b = mc.simulate(lm_trace, mc.Plan(partition_size=16, micro_batches=2), cluster, system="deepspeed-zero3")
    assert a.step_time_s == b.step_time_s and a.static_memory_bytes == b.static_memory_bytes
    assert peer("deepspeed-zero3", mc.Plan(partition_size=8), 16).plan.partition_size == 16


def test_fsdp2_reduces_every_micro_batch_and_prefetches_one_unit(lm_trace):
    """FSDP2 full shard: micscompile's traffic at p = n, flat, one unit ahead, and a copy-out of every
    gathered unit on the compute stream (wait_for_unshard); HSDP all-reduces over the replicate group
    after every micro-batch's reduce-scatter."""
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    fsdp = peer("fsdp2", mc.Plan(partition_size=16, micro_batches=4), 16)
    assert fsdp.prefetch == (Prefetch(distance=1),) and fsdp.plan.hierarchical is False
    pred = mc.simulate(lm_trace, mc.Plan(partition_size=16, micro_batches=4), cluster, system="fsdp2")
    same = mc.simulate(lm_trace, mc.Plan(partition_size=16, micro_batches=4, hierarchical=False), cluster,
                       prefetch=(1,))
    no_copy = mc.simulate(lm_trace, mc.Plan(partition_size=16, micro_batches=4), cluster, system="fsdp2",
                          copy_out_ops=None)
    assert no_copy.step_time_s == same.step_time_s
    copies = [e for e in pred.events if e.track == "compute" and e.name.startswith("after ")]
    gathers = [e for e in pred.events if e.track.startswith("comm:") and e.name.startswith("AG")]
    assert len(copies) == len(gathers) > 0  # one copy-out per gather, each its unit's bytes read and written
    assert pred.compute_s - same.compute_s == pytest.approx(sum(e.end_s - e.start_s for e in copies))
    assert pred.step_time_s > same.step_time_s
    # HSDP: the replicate all-reduce after every micro-batch's reduce-scatter (4 of them), none at the
    # boundary; micscompile's 2-hop all-reduces once
    hsdp = mc.simulate(lm_trace, mc.Plan(partition_size=8, micro_batches=4), cluster, system="fsdp2")
    two_hop = mc.simulate(lm_trace, mc.Plan(partition_size=8, micro_batches=4, hierarchical=False), cluster,
                          prefetch=(1,))
    assert hsdp.stream_busy_s["comm:replicate"] == pytest.approx(4 * two_hop.stream_busy_s["comm:replicate"])
    assert hsdp.step_time_s > two_hop.step_time_s
    with pytest.raises(ValueError, match="looks ahead by its own rule"):
        mc.simulate(lm_trace, mc.Plan(partition_size=16), cluster, system="fsdp2", prefetch=(2,))
    with pytest.raises(ValueError, match="unknown system"):
        mc.simulate(lm_trace, mc.Plan(partition_size=8), cluster, system="zero-4")


def test_a_peers_runtime_on_the_host_is_spread_over_its_gathers_and_added_to_its_optimizer(lm_trace):
    """Where the host is the device (a CPU run), a peer's hooks and optimizer cost compute-stream time:
    per micro-step, spread over its gathers' waits (before the unit computes), and per step."""
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    plan = mc.Plan(partition_size=16, micro_batches=4)
    base = mc.simulate(lm_trace, plan, cluster, system="fsdp2")
    host = mc.simulate(lm_trace, plan, cluster, system="fsdp2", host_per_micro_step_s=0.01, host_per_step_s=0.02)
    assert host.compute_s - base.compute_s == pytest.approx(4 * 0.01 + 0.02)
    spread = [e for e in host.events if e.track == "compute" and e.name == "host"]
    waits = [e for e in host.events if e.track == "compute" and e.name.startswith("after W:AG")]
    assert len(spread) == len(waits) > 4 and sum(e.end_s - e.start_s for e in spread) == pytest.approx(0.04)
    assert host.step_time_s > base.step_time_s


def test_deepspeed_mics_keeps_the_plan_and_runs_hierarchical_stages_on_its_stream(lm_trace):
    """DeepSpeed-MiCS (what the thesis measured): the user's partition group and 2-hop sync, DeepSpeed's
    fetch granularity, and its hierarchical gather's three stages on the all-gather stream
    (mics.py), so the compute stream pays none of them."""
    cluster = Cluster.preset("p3dn.24xlarge", nodes=2)
    plan = mc.Plan(partition_size=16, micro_batches=2, hierarchical=True)
    other = peer("deepspeed-mics", plan, 16)
    assert other.plan.partition_size == 16 and other.plan.grad_sync == "2hop" and other.fetch_elements is not None
    ds = mc.simulate(lm_trace, plan, cluster, system="deepspeed-mics")
    on_compute = mc.simulate(lm_trace, plan, cluster, system="deepspeed-mics",
                             hierarchical_on_stream=False)  # (a cost given by the caller wins)
    assert ds.compute_s < on_compute.compute_s
    assert ds.stream_busy_s["comm:shard"] > on_compute.stream_busy_s["comm:shard"]


def test_deepspeed_2021_pays_its_hosts_loop_over_the_ranks_for_every_call(lm_trace):
    """The Megatron-LM paper's DeepSpeed (v0.3.12-v0.5.5): v0.5.x's per-parameter calls and synchronize, and the
    host's list-API loops over the group's ranks before every call (and over the persistent parameters after
    the step), on the compute stream: the host time a step pays grows with the world size, twice the ranks
    twice the time. Mutation caught: the host time not multiplied by the world size (equal at 8 and 16)."""
    plan = mc.Plan(micro_batches=2)
    host_s = {}
    for nodes in (1, 2):
        cluster = Cluster.preset("dgx-a100", nodes=nodes)
        old = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.3")
        bare = mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.3", host_per_call_s=(0.0, 0.0),
                           host_per_step_s=0.0)
        host_s[nodes] = old.compute_s - bare.compute_s
        assert old.step_time_s > mc.simulate(lm_trace, plan, cluster, system="deepspeed-zero3-v0.5").step_time_s
    assert host_s[1] > 0 and host_s[2] == pytest.approx(2 * host_s[1])
    ds = peer("deepspeed-zero3-v0.3", plan, 16)
    assert ds.per_parameter and ds.sync_at_fetch and ds.copy_out == "parameter"
    assert ds.host_per_call_s == pytest.approx((16 * 9e-6, 16 * 10e-6))


def test_megatron_keeps_the_plans_tensor_groups_unsharded_and_all_reduces_after_the_backward(lm_trace):
    """Megatron-LM v2.5 (the SC21 paper's): the plan's tensor groups and pipeline, nothing sharded, no sequence
    parallelism, and the data-parallel all-reduce once the rank's whole backward is done: a longer step than
    the same all-reduces started in the last backward (micscompile's second hops), in a flat plan and in a
    pipeline. Mutation caught: ``grad_sync_after_backward`` ignored (the same step)."""
    plan = mc.Plan(partition_size=4, tensor_parallel_size=2, sequence_parallel=True, micro_batches=2)
    megatron = peer("megatron", plan, 16)
    assert megatron.plan.partition_size == 1 and megatron.plan.tensor_parallel_size == 2
    assert not megatron.plan.sequence_parallel and megatron.grad_sync_after_backward
    assert peer("deepspeed-zero3", plan, 16).plan.tensor_parallel_size == 1  # (data parallelism alone)
    cluster = Cluster.preset("p4d.24xlarge", nodes=2)
    for stages in (1, 2):
        p = dataclasses.replace(plan, pipeline_stages=stages, micro_batches=2 * stages)
        after = mc.simulate(lm_trace, p, cluster, system="megatron")
        beside = mc.simulate(lm_trace, p, cluster, system="megatron", grad_sync_after_backward=False)
        assert after.step_time_s > beside.step_time_s, stages
        assert after.exposed_boundary_s > beside.exposed_boundary_s, stages
        assert after.compute_s == pytest.approx(beside.compute_s)
