"""A fixed slice of the plan fuzzer's seeds (``benchmarks/fuzz_plans.py``), each a random model
under a random Plan on 4 gloo ranks: every one trains with parity or is refused before any collective;
and the fuzzer's judge, which must class wrong numbers and stray errors as failures."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import micscompile as mc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # (the spawned ranks inherit it)

import fuzz_plans  # noqa: E402

SEEDS = (0, 4, 7, 69)
"""A RandomNet with a block reused by reference on meta, clipped, with the token-weighted loss (the trace
used to leave fake tensors in it); a 2-stage pipeline in fp16 with the token-weighted loss; 4 stages of a
conv net whose first block has no parameters (refused; it used to crash in the optimizer); a GPipe pipeline
of a RandomNet with a parameter nothing reads (no chunk held it: its state dict raised KeyError)."""


@pytest.mark.multiproc
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_plan_trains_with_parity_or_is_refused(seed):
    case = fuzz_plans.draw(seed)
    outcome, detail = fuzz_plans.classify(case, timeout_s=180)
    assert outcome in ("parity", "refused"), (case.id, detail, f"replay: python benchmarks/fuzz_plans.py --replay {seed}")


def test_the_draw_is_a_function_of_the_seed():
    assert [fuzz_plans.draw(s) for s in range(20)] == [fuzz_plans.draw(s) for s in range(20)]
    cases = [fuzz_plans.draw(s) for s in range(200)]
    assert len({c.id for c in cases}) == 200  # and the seeds spread over every family and option
    assert {c.model for c in cases} == set(fuzz_plans.FAMILIES)
    drawn = {k for c in cases for k in c.kwargs}
    assert any(c.gpus_per_node for c in cases)
    assert {"pipeline_stages", "pipeline_chunks", "checkpoint", "offload_activations", "param_dtype", "bucket_bytes",
            "memory_budget_bytes", "max_gathers_in_flight", "hierarchical", "grad_sync", "optimizer_sharding"} <= drawn
    assert {c.kwargs["codegen"] for c in cases} == {"eager", "auto", "inductor"}
    assert any(c.clip for c in cases) and any(c.counted for c in cases) and any(c.meta for c in cases)


def _rank(errors=(1e-7,), floor=(1e-7,), mixed=False):
    return {"errors": list(errors), "floor": list(floor), "names": [f"t{i}" for i in range(len(errors))], "mixed": mixed}


def test_the_judge_classes_parity_refusals_and_failures():
    judge = fuzz_plans.judge
    assert judge([_rank()] * 4)[0] == "parity"
    assert judge([_rank(errors=(3e-3,), mixed=True)] * 4)[0] == "parity"  # bf16 / fp16: 2e-2
    # above 1e-5 but within 4 x what reordering the reference's own sum moves that value: AdamW's noise
    assert judge([_rank(errors=(2e-5,), floor=(1e-5,))] * 4)[0] == "parity"
    outcome, detail = judge([_rank()] * 3 + [_rank(errors=(1e-7, 5e-5), floor=(1e-7, 1e-6))])
    assert outcome == "failed" and "t1 error 5.00e-05" in detail
    refusal = {"error": "PlanError: no", "stage": "compile", "ours": True}
    assert judge([refusal] * 4) == ("refused", "PlanError: no")
    for odd in ({**refusal, "stage": "steps"}, {**refusal, "ours": False}, {**refusal, "error": "PlanError: other"}):
        assert judge([refusal] * 3 + [odd])[0] == "failed", odd  # in a step, not ours, or ranks that disagree
    assert judge([refusal] + [_rank()] * 3)[0] == "failed"
    # ranks given the same input that compile different programs: micscompile's inconsistency, not bad input
    disagree = {**refusal, "error": "RuntimeError: ranks compiled different programs (model, plan or batch differ)"}
    assert judge([disagree] * 4)[0] == "failed"
    # an internal consistency check (seed 300018's "the lowered graph's collectives differ"): a failure too
    internal = {**refusal, "error": "ProgramError: the lowered graph's collectives differ from those the search chose"}
    assert judge([internal] * 4)[0] == "failed"


# ---- the covering design ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def covering():
    rows = fuzz_plans.covering_rows()
    return rows, [fuzz_plans.cover(i, row) for i, row in enumerate(rows)]


SUITE_ROWS = {
    "a meta model under an interleaved pipeline":
        lambda r: r["meta"] == "meta" and r["plan"] == "interleaved",
    "a Hugging Face model in 16 bits under AdamW (the rounding floor: attention key biases train on noise)":
        lambda r: r["model"].startswith("hf-") and r["precision"] != "fp32" and r["optimizer"] == "adamw",
}
"""The covering rows the suite runs end to end (the first row that matches each; the whole design, 60 rows in
about 14 minutes, is docs/reliability.md's run)."""


@pytest.mark.multiproc
@pytest.mark.parametrize("what", SUITE_ROWS)
def test_covering_rows_train_with_parity(covering, what):
    rows, cases = covering
    index = next(i for i, r in enumerate(rows) if SUITE_ROWS[what](r))
    outcome, detail = fuzz_plans.classify(cases[index], timeout_s=180)
    assert outcome == "parity", (cases[index].id, detail, f"replay: python benchmarks/fuzz_plans.py --cover-row {index}")


def test_the_covering_design_holds_every_pair_of_axis_values_not_excluded(covering):
    rows, _ = covering
    axes = fuzz_plans.AXES
    names = list(axes)
    assert all(set(row) == set(names) and all(row[a] in axes[a] for a in names) for row in rows)
    missing, held_excluded = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for x in axes[a]:
                for y in axes[b]:
                    held = any(r[a] == x and r[b] == y for r in rows)
                    if fuzz_plans.excluded(a, x, b, y):
                        held_excluded += [(a, x, b, y)] if held else []
                    elif not held:
                        missing.append((a, x, b, y))
    assert not missing and not held_excluded, (missing, held_excluded)
    assert ("meta", "interleaved") in {(r["meta"], r["plan"]) for r in rows}  # a pair that once failed
    assert len(rows) <= 60  # 47 value pairs of model x plan are allowed: near the fewest possible


def test_each_covering_case_is_its_row(covering):
    """The case built from a row holds what the row says (and is the same on every call)."""
    rows, cases = covering
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for i, (row, case) in enumerate(zip(rows, cases)):
        plan = mc.Plan(**case.kwargs)
        rp = plan.resolve(fuzz_plans.WORLD, case.gpus_per_node or fuzz_plans.WORLD)
        assert case == fuzz_plans.cover(i, row) and dict(case.row) == row
        kind = row["plan"]
        assert (rp.stages > 1) == (kind in fuzz_plans.PIPELINES), (i, case.id)
        if kind in fuzz_plans.PIPELINES:
            assert plan.pipeline_schedule == kind
        else:
            assert plan.grad_sync == ("every_step" if kind == "every_step" else "2hop")
            assert kind in ("every_step", f"flat p={rp.partition_size}"), (i, case.id)
        assert (rp.gpus_per_node == 2) == (row["nodes"] != "1x4") and (plan.hierarchical is True) == (
            row["nodes"] == "2x2 hierarchical")
        assert plan.param_dtype == dtype[row["precision"]] and plan.codegen == row["codegen"]
        assert plan.optimizer_sharding == row["optimizer_sharding"]
        assert {"none": False, "full": True, "selective": "selective", "attention": "attention",
                "offload": plan.checkpoint}[row["checkpoint"]] \
            == plan.checkpoint and plan.offload_activations == (row["checkpoint"] == "offload")
        assert (rp.tensor, plan.sequence_parallel) == {"tp=1": (1, False), "tp=2": (2, False),
                                                       "tp=2 sequence": (2, True)}[row["tensor"]]
        assert case.meta == (row["meta"] == "meta") and case.arena == (row["arena"] == "arena")
        assert case.counted == (row["loss"] == "token") and case.opt == row["optimizer"]
        assert (case.clip is None) == (row["clip"] == "none") and (case.clip == float("inf")) == (row["clip"] == "inf")
        assert row["model"] in (case.model, f"hf-{case.hf}")


def test_every_plan_field_is_set_by_some_covering_case(covering):
    """A new Plan field (a new parallelism, a new schedule's option) must join the covering design: it fails
    here until some covering case sets it, unless RANDOM_ONLY (or DEVICE_ONLY: a field the CPU cannot exercise)
    names it."""
    _, cases = covering
    fields = {f.name for f in dataclasses.fields(mc.Plan)}
    set_by_cases = {k for c in cases for k in c.kwargs}
    unset = fields - set_by_cases - set(fuzz_plans.DEVICE_ONLY)
    assert unset <= set(fuzz_plans.RANDOM_ONLY), unset - set(fuzz_plans.RANDOM_ONLY)
    assert set(fuzz_plans.RANDOM_ONLY) <= {k for s in range(200) for k in fuzz_plans.draw(s).kwargs}


def test_the_coverage_table_counts_each_pair_by_its_outcome(covering):
    rows, _ = covering
    outcomes = ["parity"] * len(rows)
    outcomes[0] = "failed"
    table = fuzz_plans.coverage_table(rows, outcomes)
    line = next(t for t in table if t.startswith("model x plan "))
    pairs, trained, refused, failed, excluded, uncovered = map(int, line.split()[3:])
    shut = sum(bool(fuzz_plans.excluded("model", m, "plan", p)) for m in fuzz_plans.AXES["model"]
               for p in fuzz_plans.AXES["plan"])
    assert shut == 4  # the conv net and the quirky graph cannot be cut into 4 chunks (interleaved, ZB-V)
    every = len(fuzz_plans.AXES["model"]) * len(fuzz_plans.AXES["plan"])
    assert (pairs, failed, excluded, uncovered) == (every, 1, shut, 0) and trained == every - shut - 1 and refused == 0
    assert fuzz_plans.coverage_table(rows[1:], outcomes[1:]) != table  # a row fewer: some pair uncovered
    assert any(int(t.split()[-1]) > 0 for t in fuzz_plans.coverage_table(rows[1:], outcomes[1:])[1:])


def test_the_references_skip_the_steps_they_are_told_and_compile_alike():
    """The judge's floors: a float64 reference skips the steps an fp16 one skipped (``skip_steps``), and a
    compiled reference trains as the eager one up to rounding."""
    import copy

    from models import MODELS

    from micscompile.cli.parity import train_reference_mixed

    model_cls, make_loss, make_batches = MODELS["tied_lm"]
    torch.manual_seed(0)
    model, batches = model_cls(), make_batches(3, 8)

    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1)

    def run(**kw):
        return train_reference_mixed(copy.deepcopy(model), make_loss, sgd, batches, 2, torch.float64, **kw)[1]

    every, skip_first = run(), run(skip_steps=[0])
    later = train_reference_mixed(copy.deepcopy(model), make_loss, sgd, batches[1:], 2, torch.float64)[1]
    assert all(torch.equal(skip_first[k], later[k]) for k in later)  # step 0 not taken: as if it never ran
    assert not all(torch.equal(skip_first[k], every[k]) for k in every)
    compiled = run(compiled=True)
    assert all(torch.allclose(compiled[k], every[k], rtol=1e-9, atol=1e-12) for k in every)
