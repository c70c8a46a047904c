"""Checkpoints through torch.distributed.checkpoint on 4 real gloo ranks (one launch): resume is
bitwise under the same plan, within rtol 1e-6 after resharding (p=2 -> p=4, S=1 -> S=2, S=2 -> S=1),
and a plain single-process model loads the parameters; plus the box decomposition DCP sees."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import launch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import MODELS, TiedLM

import micscompile as mc
from micscompile.cli.parity import TOLERANCE, rel_error, state_error, train_reference
from micscompile.runtime.state_dict import flat_boxes

WORLD, GLOBAL_BATCH, K, J = 4, 8, 3, 3
RESHARD_RTOL = 1e-6
PLANS = {  # name: Plan; the first saves the checkpoint every other plan resumes from
    "p2": mc.Plan(partition_size=2, micro_batches=2),
    "p4": mc.Plan(partition_size=4),
    "S2": mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=2),
    "S2t1": mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=4, pipeline_schedule="interleaved",
                    pipeline_chunks=2),
    # optimizer states over every rank: p=2 d=2, p=1 d=4, a pipeline's stage over t*d = 2
    "p2w": mc.Plan(partition_size=2, micro_batches=2, optimizer_sharding="world"),
    "p1w": mc.Plan(partition_size=1, optimizer_sharding="world"),
    "S2w": mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=2, optimizer_sharding="world"),
}


def _adamw(params):
    # foreach=False: an implementation that rounds every element alone. torch's fused kernel, which
    # micscompile steps when a factory leaves the choice to torch, rounds an element by its place in
    # its piece (vector body or scalar tail), and resuming under another optimizer split is checked
    # bitwise here.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _local(plan: mc.Plan, rank: int, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """This rank's slice of a global batch: one per data-parallel chain (every rank, or every
    pipeline chain: the ranks of one chain share it)."""
    rp = plan.resolve(WORLD, WORLD)
    chains = WORLD // rp.stages
    chain = rank // (rp.stages * rp.partition_size) * rp.partition_size + rank % rp.partition_size
    n = GLOBAL_BATCH // chains
    return tuple(x[chain * n : (chain + 1) * n] for x in batch)


def _compile(plan: mc.Plan, rank: int, batches, seed: int = 0):
    torch.manual_seed(seed)  # every rank the same weights; a resumed run starts from other ones
    model = TiedLM(layers=4)
    _, make_loss, _ = MODELS["tied_lm"]
    return model, mc.compile(model, plan, loss_fn=make_loss(model), optimizer=_adamw,
                             example_inputs=_local(plan, rank, batches[0]))


def _train(step, plan: mc.Plan, rank: int, batches) -> list[float]:
    return [float(step(*_local(plan, rank, b))) for b in batches]


def resume_cases(rank: int, world: int, root: str) -> dict:
    batches = MODELS["tied_lm"][2](K + J, GLOBAL_BATCH)
    base = PLANS["p2"]
    model, step = _compile(base, rank, batches)
    ref_losses, ref_state = train_reference(model, MODELS["tied_lm"][1](model), _adamw, batches)
    step.state_dict()  # before any step: the optimizer state it makes must not change training
    out: dict = {"losses": _train(step, base, rank, batches[:K])}
    dcp.save(step.state_dict(), checkpoint_id=os.path.join(root, "p2"))
    out["at_save"] = step.full_state_dict()
    out["losses"] += _train(step, base, rank, batches[K:])
    out["full"] = step.full_state_dict()
    out["eager_loss_err"] = max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(out["losses"], ref_losses))
    out["eager_state_err"] = state_error(out["full"], ref_state)
    out["saved_steps"] = K

    # a pipeline saves too (S=2 -> S=1 below)
    _, pipe = _compile(PLANS["S2"], rank, batches)
    _train(pipe, PLANS["S2"], rank, batches[:K])
    dcp.save(pipe.state_dict(), checkpoint_id=os.path.join(root, "S2"))
    out["pipe_tail"] = _train(pipe, PLANS["S2"], rank, batches[K:])
    out["pipe_full"] = pipe.full_state_dict()

    # and one with the optimizer states over the world (resumed in both modes below)
    _, world = _compile(PLANS["p2w"], rank, batches)
    _train(world, PLANS["p2w"], rank, batches[:K])
    dcp.save(world.state_dict(), checkpoint_id=os.path.join(root, "p2w"))
    out["world_tail"] = _train(world, PLANS["p2w"], rank, batches[K:])
    out["world_full"] = world.full_state_dict()

    resumed = {}
    for name, source in [*((n, "p2") for n in PLANS), ("p2<-S2", "S2"), ("p2w<-p2w", "p2w"), ("p2<-p2w", "p2w")]:
        plan = PLANS[name.split("<-")[0]]
        _, other = _compile(plan, rank, batches, seed=1)
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(root, source))
        other.load_state_dict(sd)
        resumed[name] = {"steps": other.steps, "losses": _train(other, plan, rank, batches[K:]),
                         "full": other.full_state_dict()}
    out["resumed"] = resumed

    # full tensors (a plain model's state dict, e.g. pretrained weights) load into any plan
    _, fresh = _compile(PLANS["S2"], rank, batches, seed=1)
    fresh.load_state_dict({"model": model.state_dict(), "optim": {"state": {}, "param_groups": []}, "steps": 0})
    out["from_full_err"] = state_error(fresh.full_state_dict(), model.state_dict())
    out["from_full_losses"] = _train(fresh, PLANS["S2"], rank, batches)
    out["ref_losses"] = ref_losses

    dist.barrier()
    if rank == 0:  # export: a plain model in this process, DCP without a process group
        torch.manual_seed(2)
        plain = TiedLM(layers=4)
        state = plain.state_dict()
        dcp.load({"model": state}, checkpoint_id=os.path.join(root, "p2"), no_dist=True)
        plain.load_state_dict(state)
        out["exported"] = {k: v.clone() for k, v in plain.state_dict().items()}
        out["exported_tied"] = plain.head.weight.data_ptr() == plain.emb.weight.data_ptr()
        out["files"] = sorted(os.listdir(os.path.join(root, "p2")))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(resume_cases, WORLD, str(tmp_path_factory.mktemp("dcp")), timeout_s=400)


@pytest.mark.multiproc
def test_training_around_a_checkpoint_matches_eager(results):
    """The run that saves (and called state_dict() before its first step) is plain parity."""
    for res in results:
        assert res["eager_loss_err"] <= TOLERANCE, res["eager_loss_err"]
        err, name = res["eager_state_err"]
        assert err <= TOLERANCE, (name, err)


@pytest.mark.multiproc
def test_resume_under_the_same_plan_is_bitwise(results):
    for res in results:
        again = res["resumed"]["p2"]
        assert again["steps"] == res["saved_steps"]
        assert again["losses"] == res["losses"][K:]
        for k, v in res["full"].items():
            assert torch.equal(again["full"][k], v), k


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["p4", "S2", "S2t1", "p2w", "p1w", "S2w"])
def test_resume_under_another_plan_reshards(results, name):
    for res in results:
        other = res["resumed"][name]
        assert other["steps"] == res["saved_steps"]
        for a, b in zip(other["losses"], res["losses"][K:]):
            assert math.isclose(a, b, rel_tol=RESHARD_RTOL), (name, other["losses"], res["losses"][K:])
        for k, v in res["full"].items():
            torch.testing.assert_close(other["full"][k], v, rtol=RESHARD_RTOL, atol=1e-7, msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.multiproc
def test_optimizer_states_over_the_world_resume_bitwise_in_either_mode(results):
    """Saved with optimizer_sharding="world" (each rank's Adam state a half-size row): resumed under the
    same plan and with the states over the partition group (p=2), bitwise both: at d=2 the replicas'
    reduce-scatter and all-reduce add the same two numbers, and the optimizer is elementwise."""
    for res in results:
        same, other = res["resumed"]["p2w<-p2w"], res["resumed"]["p2<-p2w"]
        assert same["steps"] == other["steps"] == res["saved_steps"]
        assert same["losses"] == other["losses"] == res["world_tail"]
        for k, v in res["world_full"].items():
            assert torch.equal(same["full"][k], v), k
            assert torch.equal(other["full"][k], v), k
        # and the other way: p=2's checkpoint resumed with the states over the world
        into_world = res["resumed"]["p2w"]
        assert into_world["losses"] == res["losses"][K:]
        for k, v in res["full"].items():
            assert torch.equal(into_world["full"][k], v), k


@pytest.mark.multiproc
def test_pipeline_checkpoint_resumes_flat(results):
    """Saved by S=2 (a tied weight in two chunks on two ranks), loaded by p=2."""
    for res in results:
        other = res["resumed"]["p2<-S2"]
        for a, b in zip(other["losses"], res["pipe_tail"]):
            assert math.isclose(a, b, rel_tol=RESHARD_RTOL), (other["losses"], res["pipe_tail"])
        for k, v in res["pipe_full"].items():
            torch.testing.assert_close(other["full"][k], v, rtol=RESHARD_RTOL, atol=1e-7)


@pytest.mark.multiproc
def test_full_tensors_load_into_a_pipeline_and_train_like_eager(results):
    for res in results:
        assert res["from_full_err"][0] == 0.0, res["from_full_err"]
        err = max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(res["from_full_losses"], res["ref_losses"]))
        assert err <= TOLERANCE, (res["from_full_losses"], res["ref_losses"])


@pytest.mark.multiproc
def test_plain_model_loads_the_checkpoint(results):
    res = results[0]
    assert res["exported_tied"]
    assert any(f.endswith(".distcp") for f in res["files"]) and ".metadata" in res["files"]
    assert set(res["exported"]) == set(res["at_save"])
    for k, v in res["exported"].items():  # the parameters when it was saved, bitwise
        assert torch.equal(v, res["at_save"][k]), k


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_boxes_cover_a_flat_range_exactly(shape, data):
    shape = tuple(shape)
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    marks = torch.zeros(shape, dtype=torch.long)
    flat_next = lo
    for offsets, sizes, start in flat_boxes(shape, lo, hi):
        assert start == flat_next  # in order, each box contiguous in flat order
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        marks[index] += 1
        flat_next += math.prod(sizes)
        ids = torch.arange(n).view(shape)[index].reshape(-1)
        assert torch.equal(ids, torch.arange(start, start + math.prod(sizes)))
    assert flat_next == hi
    expected = torch.zeros(n, dtype=torch.long)
    expected[lo:hi] = 1
    assert torch.equal(marks.reshape(-1), expected)
    assert len(flat_boxes(shape, lo, hi)) <= max(1, 2 * len(shape) - 1)
