import dataclasses

import pytest
import torch

import micscompile as mc


def test_resolve_groups_follow_the_mesh_layout():
    rp = mc.Plan(partition_size=2).resolve(8, 4)
    assert (rp.partition_size, rp.replicas, rp.gpus_per_node) == (2, 4, 4)
    assert rp.partition_ranks(5) == (4, 5)
    assert rp.replication_ranks(5) == (1, 3, 5, 7)
    assert mc.Plan().resolve(8, 4).partition_size == 4  # default: one node


@pytest.mark.parametrize("p", [3, 5, 16])
def test_impossible_partition_size_lists_valid_ones(p):
    with pytest.raises(mc.PlanError, match="valid partition sizes: 1, 2, 4, 8"):
        mc.Plan(partition_size=p).resolve(8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_batches": 0}, "micro_batches must be a positive int"),
        ({"partition_size": -1}, "partition_size must be a positive int"),
        ({"grad_sync": "sometimes"}, "grad_sync must be"),
        ({"hierarchical": "yes"}, "hierarchical must be"),
        ({"pipeline_chunks": 2}, "'1f1b' runs one chunk per rank; chunks=2 needs kind 'interleaved'"),
        ({"pipeline_stages": 2, "pipeline_schedule": "interleaved", "pipeline_chunks": 1},
         "runs v > 1 chunks per rank, got pipeline_chunks=1: use pipeline_schedule='1f1b'"),
        ({"pipeline_stages": 2, "pipeline_schedule": "zb-v", "pipeline_chunks": 3}, "'zb-v' runs two chunks per rank"),
        ({"pipeline_stages": 2, "pipeline_schedule": "zigzag"}, "unknown pipeline schedule 'zigzag': valid kinds"),
        ({"pipeline_stages": 2, "grad_sync": "every_step"}, "syncs gradients in two hops"),
        ({"checkpoint": "yes"}, "Plan.checkpoint must be False, True, 'selective' or 'attention'"),
        ({"checkpoint_every": 0}, "Plan.checkpoint_every must be a positive int"),
        ({"offload_activations": True}, "set checkpoint=True"),
        ({"param_dtype": torch.int8}, "Plan.param_dtype must be one of torch.float32, torch.bfloat16"),
        ({"reduce_dtype": "bf16"}, "Plan.reduce_dtype must be one of"),
    ],
)
def test_bad_fields_are_refused_with_what_would_work(kwargs, message):
    with pytest.raises(mc.PlanError, match=message):
        mc.Plan(**kwargs)


def test_plan_is_frozen_and_replaceable():
    plan = mc.Plan(partition_size=2)
    with pytest.raises(AttributeError):
        plan.partition_size = 4
    assert plan.replace(micro_batches=4).micro_batches == 4


def test_gpus_per_node_must_divide_world():
    with pytest.raises(mc.PlanError, match="gpus_per_node=3"):
        mc.Plan().resolve(8, 3)
    with pytest.raises(mc.PlanError, match="gpus_per_node must be a positive number of ranks, got 0"):
        mc.Plan().resolve(8, 0)


def test_the_node_size_is_the_clusters_not_the_plans():
    """One place for k: a Plan has no gpus_per_node; mc.simulate plans for the cluster's nodes."""
    assert "gpus_per_node" not in {f.name for f in dataclasses.fields(mc.Plan)}
    with pytest.raises(TypeError):
        mc.Plan(gpus_per_node=2)
    assert mc.Plan(partition_size=4).resolve(8, 2).spans_nodes
    assert not mc.Plan(partition_size=4).resolve(8, 4).spans_nodes


def test_a_schedule_that_fixes_v_gives_it():
    """ZB-V's two chunks and 1F1B's one come from the schedule; an interleaved schedule's v is given once (or 2)."""
    assert [mc.Plan(pipeline_stages=2, micro_batches=4, pipeline_schedule=kind).chunks
            for kind in ("1f1b", "gpipe", "zb-h1", "zb-v", "interleaved", "interleaved-zb")] == [1, 1, 1, 2, 2, 2]
    plan = mc.Plan(pipeline_stages=2, micro_batches=4, pipeline_schedule="interleaved", pipeline_chunks=4)
    assert plan.chunks == 4 and "v=4" in str(plan.resolve(4))
    assert plan.replace(pipeline_schedule="zb-v", pipeline_chunks=None).chunks == 2


def test_hierarchical_needs_a_group_spanning_whole_nodes():
    rp = mc.Plan(partition_size=8, hierarchical=True).resolve(16, 2)
    assert rp.spans_nodes
    assert rp.inter_ranks(11) == (9, 11, 13, 15) and rp.intra_ranks(11) == (10, 11)
    with pytest.raises(mc.PlanError, match="valid: 4, 8, 16"):
        mc.Plan(partition_size=2, hierarchical=True).resolve(16, 2)
    assert not mc.Plan(partition_size=2).resolve(16, 2).spans_nodes


def test_pipeline_topology_follows_the_mesh_layout():
    """n = S * t * d: every S*t consecutive ranks one pipeline, every t inside it a stage's group."""
    rp = mc.Plan(partition_size=2, pipeline_stages=2).resolve(8, 8)
    assert (rp.stages, rp.partition_size, rp.replicas) == (2, 2, 2)
    assert [rp.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert rp.partition_ranks(3) == (2, 3)
    assert rp.pipe_ranks(3) == (1, 3) and rp.pipe_ranks(4) == (4, 6)
    assert rp.replication_ranks(3) == (3, 7)
    with pytest.raises(mc.PlanError, match="S \\* t \\* d = n.*valid partition sizes: 1, 2, 4"):
        mc.Plan(partition_size=3, pipeline_stages=2).resolve(8, 8)
    with pytest.raises(mc.PlanError, match="pipeline_stages=3 does not divide world size 8"):
        mc.Plan(pipeline_stages=3).resolve(8, 8)
    with pytest.raises(mc.PlanError, match="stays inside a node"):
        mc.Plan(partition_size=4, pipeline_stages=2).resolve(16, 2)


def test_resolve_refuses_a_world_without_ranks():
    """`micscompile plan --nodes 0` is refused in one line, not by a ZeroDivisionError from ``n % k``."""
    for n in (0, -8):
        with pytest.raises(mc.PlanError, match="the world size must be a positive number of ranks"):
            mc.Plan().resolve(n)
    with pytest.raises(mc.PlanError, match="interleaves 2 chunks per rank of a pipeline: set pipeline_stages > 1"):
        mc.Plan(pipeline_chunks=2, pipeline_schedule="interleaved")
    with pytest.raises(mc.PlanError, match=r"multiple of stages=2, got 3: use micro_batches in \[2, 4\]"):
        mc.Plan(pipeline_stages=2, pipeline_chunks=2, pipeline_schedule="interleaved", micro_batches=3).resolve(4)


def test_divisors_are_every_divisor_in_order():
    from micscompile.core.plan import divisors

    for n in (1, 2, 12, 36, 97, 1024, 5040):
        assert divisors(n) == [q for q in range(1, n + 1) if n % q == 0]
    assert divisors(0) == [] and len(divisors(2**40)) == 41


def _decisions(rank: int, world: int) -> tuple[list[str], str]:
    from models import MODELS

    torch.manual_seed(0)
    model = MODELS["tied_lm"][0]()
    batch = MODELS["tied_lm"][2](1, 4)[0]
    step = mc.compile(model, mc.Plan(), loss_fn=MODELS["tied_lm"][1](model),
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), example_inputs=batch)
    return step.decisions, str(step)


@pytest.mark.multiproc
def test_every_choice_an_auto_field_made_is_on_the_step_and_printed():
    """Plan() leaves the partition size, the codegen and the CUDA graph to mc.compile: each is one line of
    ``step.decisions`` with its reason, and ``print(step)`` shows them under the resolved plan."""
    from harness import launch

    decisions, shown = launch(_decisions, 2, timeout_s=120)[0]
    assert decisions[0].startswith("partition_size: 2 (the default")
    assert any(d.startswith("codegen: eager (auto: ") for d in decisions), decisions
    assert any(d.startswith("cuda_graph: off (") for d in decisions), decisions
    assert shown.startswith("TrainStep (") and all(f"  {d}" in shown for d in decisions)
