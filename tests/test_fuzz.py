"""Issue 29: a fixed slice of the plan fuzzer's seeds (``benchmarks/fuzz_plans.py``), each a random model
under a random Plan on 4 gloo ranks: every one trains with parity or is refused before any collective;
and the fuzzer's judge, which must class wrong numbers and stray errors as failures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
