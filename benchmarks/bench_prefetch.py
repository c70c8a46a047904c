"""Real step time of the schedule's choices on gloo ranks: no prefetch vs one-ahead vs scheduled.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_prefetch.py

Same GPT, plan and batches for every row; the rows are compiled once and then timed
step by step in turn, the first row rotating each round (``timing.interleaved_times_s``), so
that the machine's drift over minutes hits every row alike. Each row's figure is the median over steps of the
slowest rank's time. "scheduled" is what ``mc.compile`` picks: on the calibrated
local cluster (``local_cluster.json``, written by ``python -m micscompile calibrate``)
when there is one, else its default.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from timing import interleaved_times_s

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

ROWS = {
    "no prefetch": (mc.Prefetch(0),),
    "one ahead (FSDP default)": (mc.Prefetch(1),),
    "two ahead": (mc.Prefetch(2),),
    "one ahead, across micro-steps": (mc.Prefetch(1, 0, True),),
    "one ahead, 2 kept live": (mc.Prefetch(1, 2),),
    "scheduled": None,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--partition-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per row")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=args.seq, layers=args.layers, hidden=args.hidden)
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(4)]
    cluster = mc.Cluster.preset("local") if Path("local_cluster.json").exists() else None
    plan = mc.Plan(partition_size=args.partition_size, micro_batches=args.micro_batches)
    steps = {
        name: mc.compile(model, plan, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         example_inputs=batches[0], cluster=cluster, prefetch=prefetch)
        for name, prefetch in ROWS.items()
    }
    rounds = [batches[i % len(batches)] for i in range(2 + args.steps)]  # two warm-up steps per row
    medians = {name: statistics.median(ts) for name, ts in interleaved_times_s(steps, rounds, warmup=2).items()}
    if rank == 0:
        base = medians["no prefetch"]
        print(f"GPT {cfg.layers} layers h={cfg.hidden} seq {cfg.seq_len}, {dist.get_world_size()} gloo ranks, "
              f"p={args.partition_size} s={args.micro_batches}, {args.batch_per_rank} samples/rank; median of "
              f"{args.steps} interleaved steps, slowest rank; scheduled on "
              f"{cluster.name if cluster else 'no cluster (default)'}: {steps['scheduled'].program.prefetch}")
        print(f"{'schedule':<32}{'step':>10}{'/ no prefetch':>15}{'gathered peak':>15}")
        for name, t in medians.items():
            peak = steps[name].program.peak_gathered_bytes
            print(f"{name:<32}{t * 1e3:>7.1f} ms{t / base:>14.3f}x{fmt_bytes(peak):>15}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
