"""Simulated: what checkpointing and offload buy at long sequences (thesis 4.3.4).

    .venv/bin/python benchmarks/bench_long_seq.py            # BERT 52B, seq 2048, 128 A100-40GB
    .venv/bin/python benchmarks/bench_long_seq.py --seq 4096

BERT 52B (thesis Table 4-I: 64 layers, hidden 8192, 64 heads, vocab 50000, bidirectional)
under MiCS p = 64 on 16 p4d.24xlarge (128 A100-40GB), fp16 compute, gathers and reductions
(Plan.param_dtype = reduce_dtype = float16; fp32 master shards and Adam state), global batch
G = 1024. For each memory option (none; checkpointing every block; checkpointing + offload
of the block outputs) and micro-batch b (micro-steps s = ceil(G / (128 b)), so G rounds up
when b does not divide 8), the trace of one micro-batch is lowered and simulated: the
largest b whose simulated peak fits the 40 GiB device, and its TFLOP/s per GPU by the
thesis's formula (eq. 4.5, recompute counted whether or not it runs: the same numerator
for every row, so the ratios are step-time ratios). Offload copies run on a copy stream;
the last column checks they hide: one block output over PCIe (25 GB/s) against one block's
simulated backward. No GPU needed; each b is traced once (meta device, ~5 s).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import micscompile as mc
from micscompile.zoo.models import GPTConfig, meta_gpt

GIB = 1 << 30
LAYERS, HIDDEN, HEADS, VOCAB, P = 64, 8192, 64, 50000, 64
PCIE_BPS = 25e9
OPTIONS = {"none": {}, "checkpoint": {"checkpoint": True},
           "checkpoint + offload": {"checkpoint": True, "offload_activations": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    args = ap.parse_args()
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=16)
    n, cap = cluster.world_size, cluster.gpu.memory_bytes
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=args.seq, layers=LAYERS, hidden=HIDDEN, heads=HEADS, causal=False)
    print(f"BERT 52B, seq {args.seq}, G >= {args.global_batch}, MiCS p={P} on {n} x {cluster.gpu.name} "
          f"({cap / GIB:.0f} GiB), fp16")
    head = f"{'option':<22}{'b':>3}{'s':>4}{'G':>6}{'peak GiB':>10}{'fits':>6}{'step s':>9}{'TFLOP/s/GPU':>13}{'copy/bwd':>10}"
    print(head + "\n" + "-" * len(head))
    best: dict[str, tuple[int, float]] = {}
    for b in args.micro_batches:
        start = time.perf_counter()
        tg = mc.trace(*meta_gpt(cfg, b), param_dtype=torch.float16)
        traced = time.perf_counter() - start
        s = math.ceil(args.global_batch / (n * b))
        G = n * b * s
        flops = mc.transformer_flops(G, args.seq, LAYERS, HIDDEN, VOCAB)
        for name, extra in OPTIONS.items():
            plan = mc.Plan(partition_size=P, micro_batches=s, param_dtype=torch.float16, reduce_dtype=torch.float16,
                           **extra)
            pred = mc.simulate(tg, plan, cluster, flops_per_step=flops, scaling=False)
            tflops = flops / n / pred.step_time_s / 1e12
            fits = pred.peak_memory_bytes <= cap
            if fits and (name not in best or tflops > best[name][1]):
                best[name] = (b, tflops)
            copy = ""
            if extra.get("offload_activations"):  # one block output over PCIe vs one block's backward
                block_bwd_s = pred.compute_s / s * (2 / 3) / LAYERS
                copy = f"{b * args.seq * HIDDEN * 2 / PCIE_BPS / block_bwd_s:.2f}"
            print(f"{name:<22}{b:>3}{s:>4}{G:>6}{pred.peak_memory_bytes / GIB:>10.1f}{'yes' if fits else 'no':>6}"
                  f"{pred.step_time_s:>9.2f}{tflops:>13.1f}{copy:>10}", flush=True)
        print(f"{'':<22}(traced b={b} in {traced:.1f} s)")
    print("\nlargest micro-batch that fits, and the best TFLOP/s per GPU among those that fit:")
    for name in OPTIONS:
        b, tflops = best.get(name, (0, 0.0))
        print(f"  {name:<22} b = {b or 'none'}" + (f", {tflops:.1f} TFLOP/s per GPU" if b else ""))


if __name__ == "__main__":
    main()
