"""Exposed communication of the scheduled Program vs no prefetch and one-ahead (FSDP's default).

    .venv/bin/python benchmarks/bench_schedule.py

GPT 13B-class (40 layers, h 5120, seq 2048, micro-batch 1, 4 micro-batches), p = 8 on
16 p4d.24xlarge nodes, fp32 as the runtime runs it; then a sweep of memory budgets.
Simulated from one meta trace; no GPU needed.
"""

from __future__ import annotations

import argparse
import time

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.lowering.lowered import lower
from micscompile.zoo.models import GPTConfig, meta_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--nodes", type=int, default=16)
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=50304, seq_len=2048, layers=args.layers, hidden=5120, heads=40)
    t0 = time.perf_counter()
    trace = mc.trace(*meta_gpt(cfg, 1))
    print(f"GPT {args.layers} x h5120: {trace.summary()}; traced in {time.perf_counter() - t0:.1f} s")
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=args.nodes)
    plan = mc.Plan(partition_size=8, micro_batches=4)
    print(f"\n{'schedule':<24} {'exposed comm':>13} {'step':>10} {'gathered peak':>14}")
    rows = {}
    for name, distances in (("no prefetch", (0,)), ("one ahead (FSDP)", (1,)), ("scheduled", None)):
        program = lower(trace, plan.resolve(cluster.world_size, cluster.gpus_per_node), cluster=cluster,
                                   prefetch=distances, need_graph=False).program
        pred = program.predict()
        rows[name] = pred.exposed_comm_s
        print(f"{name:<24} {pred.exposed_comm_s * 1e3:>10.1f} ms {pred.step_time_s:>8.2f} s "
              f"{fmt_bytes(program.peak_gathered_bytes):>14}  {program.prefetch}")
    print(f"scheduled / no prefetch {rows['scheduled'] / rows['no prefetch']:.2f}, "
          f"scheduled / one ahead {rows['scheduled'] / rows['one ahead (FSDP)']:.2f}")

    print(f"\n{'budget':>12} {'chosen peak':>12} {'step':>9}  choice")
    rp = plan.resolve(cluster.world_size, cluster.gpus_per_node)
    layer = max(lay.full_bytes for lay in lower(trace, rp, prefetch=(0,), need_graph=False).program.layouts)
    for budget in (layer - 1, layer, 2 * layer, 3 * layer, 4 * layer, 6 * layer):
        p = mc.Plan(partition_size=8, micro_batches=4, memory_budget_bytes=budget)
        try:
            rp_b = p.resolve(cluster.world_size, cluster.gpus_per_node)
            program = lower(trace, rp_b, cluster=cluster, need_graph=False).program
            pred = program.predict()
            print(f"{fmt_bytes(budget):>12} {fmt_bytes(program.peak_gathered_bytes):>12} {pred.step_time_s:>7.2f} s"
                  f"  {program.prefetch}")
        except mc.PlanError as exc:
            print(f"{fmt_bytes(budget):>12} refused: {exc}")


if __name__ == "__main__":
    main()
