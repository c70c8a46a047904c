"""Issue 29: a fixed slice of the plan fuzzer's seeds (``benchmarks/fuzz_plans.py``), each a random
flat plan on 4 gloo ranks: every one trains with parity or is refused before any collective."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # (the spawned ranks inherit it)

import fuzz_plans  # noqa: E402

pytestmark = pytest.mark.multiproc
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_plan_trains_with_parity_or_is_refused(seed):
    case = fuzz_plans.draw(seed)
    outcome, detail = fuzz_plans.classify(case, timeout_s=180)
    assert outcome in ("parity", "refused"), (case.id, detail, f"replay: python benchmarks/fuzz_plans.py --replay {seed}")


def test_the_draw_is_a_function_of_the_seed():
    assert [fuzz_plans.draw(s) for s in range(20)] == [fuzz_plans.draw(s) for s in range(20)]
    assert len({fuzz_plans.draw(s).id for s in range(20)}) >= 15  # and the seeds spread over the options
