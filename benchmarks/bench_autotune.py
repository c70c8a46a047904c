"""mc.autotune at paper scale: how fast it searches, and what it picks for the thesis's cases.

    .venv/bin/python benchmarks/bench_autotune.py                 # all cases
    .venv/bin/python benchmarks/bench_autotune.py --case gpt3     # one of: gpt3 bert10b bert104b-4096 bert104b-1024
    .venv/bin/python benchmarks/bench_autotune.py --case gpt3 --tp 1   # tensor groups narrowed (default: 1 2 4 8, +-SP)
    .venv/bin/python benchmarks/bench_autotune.py --case gpt3 --workers 2   # the (t, SP) groups in two processes

One symbolic-batch meta trace per model, priced with the cost model only (no GPU needed).
gpt3: GPT-3 175B on 1024 A100-80GB, global batch 1536 (the search's speed target: >= 2000
candidates, the whole 3D space, in < 60 s including the trace: 48-49 s for 25,100 on two
processes, docs/autotune.md).
bert10b: thesis Table 3-I on 64 V100s, micro-batch 8
(MiCS partitions over one node). bert104b: thesis Table 4-I on 128 A100-40GB, seq 4096 (MiCS-Pipe
wins) and seq 1024 with a global batch of 1024 (pure MiCS wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import micscompile as mc
from micscompile.tune.search_space import tensor_choices
from micscompile.zoo.models import BERT_10B, GPTConfig, meta_gpt

BERT_104B = GPTConfig(vocab_size=50000, seq_len=4096, layers=128, hidden=8192, heads=64, causal=False)
CASES = {
    # name: (model config, param dtype, cluster preset, nodes, global batch, autotune options)
    "gpt3": (GPTConfig(vocab_size=51200, seq_len=2048, layers=96, hidden=12288, heads=96), torch.bfloat16,
             "p4de.24xlarge", 128, 1536, {}),
    "bert10b": (BERT_10B, torch.float16, "p3dn.24xlarge", 8, 2048, dict(micro_batch_sizes=(8,))),
    "bert104b-4096": (BERT_104B, torch.bfloat16, "p4d.24xlarge", 16, 512, dict(hierarchical=("auto",))),
    # the thesis's seq-4096 setup (Table 4-II): micro-batch 1, the only one its MiCS and MiCS-Pipe could run
    "bert104b-4096-b1": (BERT_104B, torch.bfloat16, "p4d.24xlarge", 16, 1024,
                         dict(hierarchical=("auto",), micro_batch_sizes=(1,))),
    "bert104b-1024": (GPTConfig(vocab_size=50000, seq_len=1024, layers=128, hidden=8192, heads=64, causal=False),
                      torch.bfloat16, "p4d.24xlarge", 16, 1024, dict(hierarchical=("auto",))),
}


def run(name: str, nic_efficiency: float = 1.0, tp: list[int] | None = None, workers: int = 1,
        exhaustive: bool = False) -> None:
    cfg, dtype, preset, nodes, batch, opts = CASES[name]
    t0 = time.perf_counter()
    trace = mc.trace(*meta_gpt(cfg, 2), param_dtype=dtype, symbolic_batch=True)
    t1 = time.perf_counter()
    cluster = mc.Cluster.preset(preset, nodes=nodes)
    if nic_efficiency != 1.0:  # a what-if: the preset's NIC rate (its measured efficiency) times this
        inter = dataclasses.replace(cluster.inter, bandwidth_bps=cluster.inter.bandwidth_bps * nic_efficiency)
        cluster = dataclasses.replace(cluster, inter=inter)
    print(f"\n== {name}: {trace.summary()}\n   on {cluster.world_size} x {cluster.gpu.name} (NICs at "
          f"{nic_efficiency:.0%} of the preset's rate), global batch {batch}; "
          f"traced in {t1 - t0:.1f} s")
    if tp is not None:
        opts = {**opts, "tensor": tensor_choices(tp)}
    ranked = mc.autotune(trace, cluster, global_batch_size=batch, workers=workers, exhaustive=exhaustive, **opts)
    t2 = time.perf_counter()
    best = ranked[0] if ranked[0].feasible else None
    print(f"   {len(ranked)} candidates in {t2 - t1:.1f} s of search ({t2 - t0:.1f} s with the trace, "
          f"{len(ranked) / (t2 - t0):.0f} per s); best: {best if best else 'none fits'}")
    if best is not None and best.why:
        print(f"   why: {best.why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=list(CASES), action="append")
    ap.add_argument("--nic-efficiency", type=float, default=1.0,
                    help="inter-node bandwidth collectives achieve, as a fraction of the NICs' line rate")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="tensor group sizes searched (default: 1 2 4 8)")
    ap.add_argument("--workers", type=int, default=1, help="processes pricing side by side (autotune(workers=))")
    ap.add_argument("--exhaustive", action="store_true", help="simulate every candidate (autotune(exhaustive=True))")
    args = ap.parse_args()
    for name in args.case or CASES:
        run(name, args.nic_efficiency, args.tp, args.workers, args.exhaustive)


if __name__ == "__main__":
    main()
