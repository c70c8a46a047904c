"""Simulated at paper scale: BERT 10B (thesis Table 3-I) on 16-128 V100s in p3dn.24xlarge nodes.

    .venv/bin/python benchmarks/bench_paper_scale.py

MiCS (p = 8, one node) against ZeRO-3 (p = n), micro-batch 8, 4 micro-steps, fp16
compute priced at the V100's tensor-core peak, throughput by the thesis's formula
(eq. 3.4). One meta trace serves every plan and cluster size. No GPU needed.
"""

from __future__ import annotations

import argparse
import time

import micscompile as mc
from micscompile.zoo.models import BERT_10B, GPTConfig, meta_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-steps", type=int, default=4)
    args = ap.parse_args()
    cfg = BERT_10B
    t0 = time.perf_counter()
    trace = mc.trace(*meta_gpt(cfg, args.micro_batch))
    print(f"BERT 10B: {trace.summary()}; traced in {time.perf_counter() - t0:.1f} s")
    flops = mc.transformer_flops(args.micro_batch * args.micro_steps, cfg.seq_len, cfg.layers, cfg.hidden,
                                 cfg.vocab_size)
    print(f"{'GPUs':>5} {'MiCS p=8 TFLOP/s':>17} {'ZeRO-3 TFLOP/s':>15} {'MiCS/ZeRO-3':>12} "
          f"{'MiCS scaling eff':>17} {'sim s':>6}")
    for nodes in args.nodes:
        cluster = mc.Cluster.preset("p3dn.24xlarge", nodes=nodes)
        n = cluster.world_size
        t0 = time.perf_counter()
        mics, zero3 = (
            mc.simulate(trace, mc.Plan(partition_size=p, micro_batches=args.micro_steps, hierarchical=hier), cluster,
                        flops_per_step=flops, compute_dtype="float16")
            for p, hier in ((8, "auto"), (n, False))  # DeepSpeed's ZeRO-3 gathers flat over all ranks
        )
        print(f"{n:>5} {mics.tflops_per_gpu:>17.1f} {zero3.tflops_per_gpu:>15.1f} "
              f"{mics.tflops_per_gpu / zero3.tflops_per_gpu:>11.2f}x {mics.scaling_efficiency:>16.1%} "
              f"{time.perf_counter() - t0:>6.1f}")

    # speed: GPT-3 175B (96 layers, h 12288, seq 2048) on 1024 A100-80GB, from a meta trace
    cfg = GPTConfig(vocab_size=51200, seq_len=2048, layers=96, hidden=12288, heads=96)
    t0 = time.perf_counter()
    gpt = meta_gpt(cfg, 1)
    t1 = time.perf_counter()
    trace = mc.trace(*gpt)
    t2 = time.perf_counter()
    pred = mc.simulate(trace, mc.Plan(partition_size=64, micro_batches=8), mc.Cluster.preset("p4de.24xlarge", nodes=128),
                       compute_dtype="bfloat16")
    t3 = time.perf_counter()
    print(f"\nGPT-3 175B on 1024 A100-80GB (p=64, 8 micro-batches of 1): build on meta {t1 - t0:.1f} s + trace "
          f"{t2 - t1:.1f} s + simulate {t3 - t2:.1f} s = {t3 - t0:.1f} s; "
          f"predicted {pred.tflops_per_gpu:.0f} TFLOP/s per GPU "
          f"(fp32 gathers, no checkpointing: peak {pred.peak_memory_bytes / 2**30:.0f} GiB, infeasible as planned)")


if __name__ == "__main__":
    main()
