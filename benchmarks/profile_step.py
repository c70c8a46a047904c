"""Where a step's time goes: micscompile p=1 against DDP, side by side under ``torch.profiler``.
Rank 0's profile of each system: the step phases micscompile labels
(``mc.micro_steps``, ``mc.boundary``, ``mc.scale_grads``, ``mc.optimizer``) and the top ops by self
CPU time.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/profile_step.py [--micro-batches 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from bench_peers import build
from torch.profiler import ProfilerActivity, profile

from micscompile.core.launch import init_distributed
from micscompile.zoo.models import GPT, GPTConfig, lm_batch

PHASES = ("mc.micro_steps", "mc.boundary", "mc.scale_grads", "mc.optimizer", "Optimizer.step#AdamW.step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    init_distributed(__import__("datetime").timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=256, seq_len=64, layers=4, hidden=256, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(t[rank * 8:(rank + 1) * 8] for t in lm_batch(cfg, 8 * world, gen)) for _ in range(args.steps + 3)]
    for system in ("micscompile p=1", "DDP (no_sync)"):
        step = build(system, model, 1, args.micro_batches, 2, batches[0], 8)
        for b in batches[:3]:
            step(*b)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for b in batches[3:]:
                step(*b)
            seconds = (time.perf_counter() - start) / args.steps
        if rank == 0:
            ka = prof.key_averages()
            print(f"\n=== {system}, s={args.micro_batches}: {seconds * 1e3:.1f} ms/step (profiled) ===")
            for e in ka:
                if e.key in PHASES or e.key.startswith("ProfilerStep"):
                    print(f"  {e.key:<30} {e.cpu_time_total / args.steps / 1e3:8.2f} ms/step total")
            print(ka.table(sort_by="self_cpu_time_total", row_limit=args.top))
        del step
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
