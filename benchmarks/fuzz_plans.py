"""The plan fuzzer (issue 29 item 1, first version): random flat plans over the test models, each run
on 4 real gloo ranks in its own launch, classed as trained with parity, refused, or failed.

    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --n 200 --seed 0
    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --replay 17        # one case again, verbose

Case ``seed + i`` draws, from its own ``random.Random``:

- a model from ``tests/models.py``: the tied LM (a weight shared by the embedding and the head), the
  conv net (buffers, batch norm in eval) or the quirky graph (unused parameters, in-place ops,
  several inputs);
- a Plan over what a flat plan accepts: p, s, grad_sync, gpus_per_node and hierarchical gathers, a
  forced Prefetch (distance, keep-live, across micro-steps) or the default search, checkpointing
  (plain, selective, every 1-2 blocks, with offload), bf16 compute and reduction, the arena, a model
  built on meta, SGD or AdamW.

It runs ``tests/dist_cases.run_case`` (the parity suite's own case: 5 steps, against single-process
eager on the same global batch; mixed precision against ``train_reference_mixed``, which sums in
the same micro-batch order) and classes the outcome:

- **parity**: losses and the gathered state within docs/design.md's metric (1e-5; 2e-2 for mixed);
- **refused**: ``mc.compile`` raised the same error on every rank (it checks everything rank-locally
  before its first collective);
- **failed**: wrong numbers, another exception, or a hang past ``--timeout``.

Not drawn yet: pipelines, clipping, counted losses, fp16, Inductor, the Hugging Face models and
random graphs; those are the next steps of issue 29.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from dist_cases import LOCAL_BATCH, Case, run_case  # noqa: E402
from harness import launch  # noqa: E402
from models import MODELS  # noqa: E402

import micscompile as mc  # noqa: E402
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE  # noqa: E402

WORLD = 4
COMPILE = str(Path("micscompile", "runtime", "compile.py"))


def draw(seed: int) -> Case:
    """The case of ``seed``: the same on every machine and Python run."""
    rng = random.Random(seed)
    model = rng.choice(sorted(MODELS))
    p = rng.choice([1, 2, 4])
    s = rng.choice([d for d in (1, 2, 3, 4) if LOCAL_BATCH % d == 0])
    k = rng.choice([None, 2])
    checkpoint = rng.choice([False, False, True, "selective"])
    prefetch = None
    if rng.random() < 0.5:
        prefetch = mc.Prefetch(distance=rng.randint(0, 3), keep_live=rng.randint(0, 2),
                               across_micro_steps=s > 1 and rng.random() < 0.5)
    mixed = rng.random() < 0.25
    return Case(
        model, p, s, opt=rng.choice(["sgd", "adamw"]),
        grad_sync=rng.choice(["2hop", "2hop", "every_step"]),
        meta=rng.random() < 0.15,
        k=k, hierarchical=rng.choice(["auto", True, False]) if k and p > k else "auto",
        prefetch=prefetch, arena=rng.random() < 0.8,
        checkpoint=checkpoint, checkpoint_every=rng.choice([1, 2]) if checkpoint else 1,
        offload=bool(checkpoint) and rng.random() < 0.3,
        param_dtype=torch.bfloat16 if mixed else torch.float32,
        reduce_dtype=rng.choice([torch.bfloat16, torch.float32]) if mixed else torch.float32,
    )


def _one(rank: int, world: int, case: Case) -> dict:
    try:
        return {"result": run_case(case, rank, world)}
    except Exception as exc:  # noqa: BLE001 - the class and message are the outcome
        in_compile = any(f.name == "compile" and f.filename.endswith(COMPILE) for f in traceback.extract_tb(exc.__traceback__))
        return {"error": f"{type(exc).__name__}: {exc}", "in_compile": in_compile}


def classify(case: Case, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail) of one case on ``WORLD`` fresh gloo ranks."""
    try:
        values = launch(_one, WORLD, case, timeout_s=timeout_s, pg_timeout_s=min(60.0, timeout_s))
    except RuntimeError as exc:  # a rank crashed or hung
        return "failed", str(exc).splitlines()[0][:300]
    errors = [v for v in values if "error" in v]
    if errors:
        first = errors[0]["error"]
        if len(errors) == WORLD and all(e["in_compile"] and e["error"] == first for e in errors):
            return "refused", first[:300]  # mc.compile checks everything rank-locally before any collective
        return "failed", first[:300]
    tol = LOW_PRECISION_TOLERANCE if case.mixed else TOLERANCE
    worst = max(max(v["result"]["loss_err"], v["result"]["state_err"][0]) for v in values)
    if worst > tol:
        return "failed", f"parity: max error {worst:.2e} > {tol:.0e}"
    return "parity", f"max error {worst:.1e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="cases")
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (case i: seed + i)")
    ap.add_argument("--replay", type=int, default=None, help="run the one case of this seed")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a case counts as hung")
    args = ap.parse_args(argv)
    seeds = [args.replay] if args.replay is not None else range(args.seed, args.seed + args.n)
    outcomes: dict[int, tuple[str, str, Case]] = {}
    start = time.perf_counter()
    for i, seed in enumerate(seeds):
        case = draw(seed)
        outcome, detail = classify(case, args.timeout)
        outcomes[seed] = (outcome, detail, case)
        print(f"[{i + 1}/{len(seeds)}] seed {seed}: {outcome:<8} {case.id}  ({detail})  "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    counts = collections.Counter(o for o, _, _ in outcomes.values())
    print(f"\nseeds {seeds[0]}-{seeds[-1]}: {len(outcomes)} configurations, {counts['parity']} trained with parity, "
          f"{counts['refused']} refused before any collective, {counts['failed']} failed")
    for seed, (outcome, detail, case) in outcomes.items():
        if outcome == "failed":
            print(f"  FAILED seed {seed} {case.id}: {detail}\n    replay: OMP_NUM_THREADS=1 python "
                  f"benchmarks/fuzz_plans.py --replay {seed}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
