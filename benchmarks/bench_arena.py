"""Measured: the static memory plan's arena vs allocating per use, same plan, same ranks.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 benchmarks/bench_arena.py

A small GPT (4 x h256, seq 64, 8 sequences per rank), p=2, s=2, SGD. The same model and
plan compiled twice: ``arena=True`` (collectives' buffers and ops' ``out=`` results at
planned offsets in one arena per rank) and ``arena=False`` (every buffer allocated per
use, as eager PyTorch does). Windows of 3 steps alternate between the two (the machine
drifts over minutes); per window the slowest rank's mean step time; the ratio of each
pair of windows, then the median. Also per rank: what ops allocated outside the arena at
once (counted over one step by a dispatch mode) against the lifetimes' plan, and the
arena against its lower bound. Parity of the two is a test (tests/test_multiproc.py:
bitwise equal), not repeated here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8, help="measurement windows per variant")
    ap.add_argument("--steps", type=int, default=3, help="steps per window")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=512, seq_len=64, layers=4, hidden=256, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = lm_batch(cfg, 8, torch.Generator().manual_seed(rank))
    plan = mc.Plan(partition_size=2, micro_batches=2)
    steps = {arena: mc.compile(model, plan, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                               example_inputs=batch, arena=arena) for arena in (True, False)}
    for step in steps.values():  # warm-up, and one counted step each
        step(*batch)
        step.track_memory = True
        step(*batch)
        step.track_memory = False
    means: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.windows):
        for arena, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(*batch)
            mine = torch.tensor([(time.perf_counter() - t0) / args.steps])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            means[arena].append(float(mine))
    if rank == 0:
        ratio = statistics.median(a / b for a, b in zip(means[True], means[False]))
        print(f"GPT 4 x h256, seq 64, 8 sequences per rank, p=2 s=2, {dist.get_world_size()} gloo ranks")
        print(f"{'':<12}{'step ms':>10}{'outside arena (planned / measured)':>38}{'arena (L)':>24}")
        for arena, step in steps.items():
            ms = step.memory_stats()
            outside = f"{fmt_bytes(ms.outside_planned_peak_bytes)} / {fmt_bytes(ms.outside_measured_peak_bytes)}"
            arena_col = f"{fmt_bytes(ms.arena_bytes)} ({fmt_bytes(ms.arena_lower_bound_bytes)})" if arena else "-"
            print(f"{'arena' if arena else 'per use':<12}{statistics.median(means[arena]) * 1e3:>10.1f}"
                  f"{outside:>38}{arena_col:>24}")
        print(f"arena / per-use step time: {ratio:.3f}x (median of {args.windows} paired windows)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
