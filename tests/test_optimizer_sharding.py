"""Asymmetric partitioning (the MiCS thesis's section 5.2.1) on 4 real gloo ranks, one launch:
``Plan(optimizer_sharding="world")`` keeps the parameters and gradients over the partition group and the
optimizer states over all p * d ranks. Each case trains the tied LM (a weight shared by the embedding and
the head) with AdamW in both modes: parity with single-process eager summed in the plan's micro-batch
order, the same wire bytes (within padding) as the program predicts, the optimizer state per rank divided
by d; clipping and fp16 loss scaling over the reduce-scattered rows; bad input refused first."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
from harness import launch, run_cases
from models import TiedLM, lm_batches, lm_loss

import micscompile as mc
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, rel_error, state_error, train_reference_mixed
from micscompile.core.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

WORLD, STEPS, LOCAL_BATCH = 4, 4, 6
pytestmark = pytest.mark.multiproc


@dataclass(frozen=True)
class Case:
    p: int
    s: int
    stages: int = 1
    clip: float | None = None
    param_dtype: torch.dtype = torch.float32

    @property
    def id(self) -> str:
        extra = (f"-S{self.stages}" if self.stages > 1 else "") + (f"-clip{self.clip}" if self.clip else "")
        return f"p{self.p}-s{self.s}{extra}" + ("" if self.param_dtype == torch.float32 else "-fp16")

    def plan(self, sharding: str) -> mc.Plan:
        return mc.Plan(partition_size=self.p, micro_batches=self.s, pipeline_stages=self.stages,
                       optimizer_sharding=sharding, param_dtype=self.param_dtype, codegen="eager")


CASES = [Case(2, 1), Case(2, 3), Case(1, 1), Case(1, 3),  # d = 2 and d = 4
         Case(1, 2, stages=2),  # a pipeline: each stage's t * d = 2 ranks
         Case(2, 3, clip=0.05), Case(2, 2, param_dtype=torch.float16)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def run_case(case: Case, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TiedLM(layers=4)
    rp = case.plan("world").resolve(world, world)
    chains = world // rp.stages
    batches = lm_batches(STEPS, LOCAL_BATCH * chains)
    ref_losses, ref_state = train_reference_mixed(copy.deepcopy(model), lambda m: lm_loss, _adamw, batches,
                                                  chains * case.s, case.param_dtype, max_grad_norm=case.clip)
    chain = rank // (rp.stages * rp.partition_size) * rp.partition_size + rank % rp.partition_size
    local = [tuple(x[chain * LOCAL_BATCH: (chain + 1) * LOCAL_BATCH] for x in b) for b in batches]
    out = {"d": rp.replicas}
    for sharding in ("partition", "world"):
        step = mc.compile(model, case.plan(sharding), loss_fn=lm_loss, optimizer=_adamw, example_inputs=local[0],
                          max_grad_norm=case.clip)
        losses = [float(step(*b)) for b in local]
        stats = step.comm_stats()
        out[sharding] = {
            "loss_err": max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)),
            "state_err": state_error(step.full_state_dict(), ref_state),
            "optimizer_bytes": _state_bytes(step.optimizer),
            "measured": {k: r.bytes for k, r in stats.rows.items()},
            "wire_bytes": {k: STEPS * v for k, v in step.program.wire_bytes().items()},
            "shards": rp.optimizer_shards, "skipped": step.skipped_steps,
            "program": str(step.program) if rank == 0 and case.stages == 1 else "",
        }
    return out


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    out = {}
    for name, kwargs in {"value": dict(optimizer_sharding="all"),
                         "every_step": dict(optimizer_sharding="world", grad_sync="every_step")}.items():
        try:
            mc.Plan(partition_size=2, **kwargs)
            out[name] = "NO EXCEPTION"
        except mc.PlanError as exc:
            out[name] = str(exc)
    # d = 1: changes nothing, and says so
    torch.manual_seed(0)
    model = TiedLM()
    x = lm_batches(1, LOCAL_BATCH)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mc.compile(model, mc.Plan(partition_size=4, optimizer_sharding="world"), loss_fn=lm_loss,
                          optimizer=_adamw, example_inputs=x)
    out["d1_warning"] = " | ".join(str(w.message) for w in caught if "optimizer_sharding" in str(w.message))
    out["d1_shards"] = str(step.program.plan.optimizer_shards)
    return out


@pytest.fixture(scope="module")
def results():
    return launch(run_cases, WORLD, bad_inputs, run_case, CASES, timeout_s=600)


def test_bad_input_is_refused_and_d1_is_a_no_op_that_says_so(results):
    bad = results[0]["bad_inputs"]
    assert "must be 'auto', 'partition' or 'world'" in bad["value"]
    assert "use grad_sync='2hop'" in bad["every_step"]
    assert "changes nothing" in bad["d1_warning"] and bad["d1_shards"] == "1"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_in_both_modes(results, case):
    tol = TOLERANCE if case.param_dtype == torch.float32 else LOW_PRECISION_TOLERANCE
    for rank, res in enumerate(results):
        for sharding in ("partition", "world"):
            r = res[case][sharding]
            assert r["loss_err"] <= tol, (rank, sharding, r["loss_err"])
            assert r["state_err"][0] <= tol, (rank, sharding, r["state_err"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_optimizer_state_per_rank_is_divided_by_d(results, case):
    for res in results:
        d = res[case]["d"]
        part, world = res[case]["partition"]["optimizer_bytes"], res[case]["world"]["optimizer_bytes"]
        assert res[case]["world"]["shards"] == d > 1
        # (each bucket's shard padded to a multiple of d elements: at most d - 1 elements of 8 bytes per bucket)
        assert abs(world * d - part) <= 8 * d * 16, (part, world, d)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_replicas_reduce_scatter_and_gather_the_bytes_of_one_all_reduce(results, case):
    """The same wire bytes within padding; the replicas' all-reduce split into its two halves; what the
    Program predicts is what the step moves."""
    for res in results:
        part, world = res[case]["partition"]["measured"], res[case]["world"]["measured"]
        assert (ALL_REDUCE, "replicate") in part and (ALL_REDUCE, "replicate") not in world
        assert (REDUCE_SCATTER, "replicate") in world and (ALL_GATHER, "replicate") in world
        if case.param_dtype == torch.float32:  # (fp16 here: the gradients reduce in fp32, the updates gather in fp16)
            total_part, total_world = sum(part.values()), sum(world.values())
            assert abs(total_world - total_part) <= 0.02 * total_part, (part, world)
        # (a pipeline's tied-weight all-reduce between its chunks is not in its Programs' wire bytes; a step
        # skipped on an fp16 overflow gathers no update)
        predicted = dict(res[case]["world"]["wire_bytes"])
        predicted[ALL_GATHER, "replicate"] = predicted[ALL_GATHER, "replicate"] * (STEPS - res[case]["world"]["skipped"]) // STEPS
        assert {k: v for k, v in world.items() if k[1] != "tied"} == predicted


def test_the_program_prints_the_boundary_it_runs(results):
    text = results[0][Case(2, 3)]["world"]["program"]
    assert "optimizer_sharding=world" in text
    assert "AGU" in text
