"""Eager FX against Inductor-generated compute (``Plan.codegen``), same plan, same ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_codegen.py

Part 1, step time: the GPT example at each ``--hidden`` and ``--seq``, compiled twice with one Plan, once with
``codegen="eager"`` (the rewritten FX graph run op by op, ops writing into the arena) and once
with ``codegen="inductor"`` (every region between communication points compiled by Inductor:
C++ on CPU). ``step``: the median over ``--steps`` steps of the slowest rank; ``eager/inductor``
> 1: Inductor is faster, the median over rounds of eager's time over Inductor's in the same
round (the two steps are timed in alternation, one of each per round, so drift on the machine
reaches both); ``won``: the rounds in which Inductor was faster. ``param err``: the largest relative difference of the two
runs' parameters after the run (docs/design.md's metric). ``compile``: ``mc.compile``'s wall time, slowest rank, cold Inductor
caches (``torch._inductor.utils.fresh_cache``), after one warm-up compile in the process (the
one-time import and compiler start-up, reported separately).

Part 2, compile time against depth: the same GPT with ``--depths`` layers, inductor, cold caches.
Identical regions (the same layer at another depth) are compiled once, so the distinct compiles
and the compile time stay flat as the model gets deeper.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from timing import interleaved_times_s
from torch._inductor.utils import fresh_cache

import micscompile as mc
from micscompile.cli.parity import rel_error
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sgd(params):
    """SGD with momentum: the parity yardstick (AdamW turns the rounding noise of gradients that are
    mathematically zero, e.g. the attention key bias, into lr-sized steps; docs/design.md)."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def compiled(cfg: GPTConfig, plan: mc.Plan, example) -> tuple[mc.TrainStep, float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    with fresh_cache(delete=False):  # kept: a compiled step may still load from it (Triton autotuning)
        dist.barrier()
        start = time.perf_counter()
        step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=sgd, example_inputs=example)
        return step, slowest(time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description="micscompile codegen: eager FX vs Inductor step and compile time")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256],
                    help="128: the demo's GPT; 256: bench_peers' (the depth sweep uses the first)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--batch-per-rank", type=int, default=4)
    ap.add_argument("--partition-size", type=int, default=None, help="p (default: every rank)")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--steps", type=int, default=12, help="timed rounds (each times both codegens once)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    p = args.partition_size or world
    say = print if rank == 0 else (lambda *a, **k: None)

    warm_cfg = GPTConfig(seq_len=16, layers=1, hidden=32, heads=2, vocab_size=64)
    gen = torch.Generator().manual_seed(rank)
    _, warm_s = compiled(warm_cfg, mc.Plan(partition_size=p, codegen="inductor"), lm_batch(warm_cfg, 2, gen))
    say(f"warm-up compile (imports, compiler start-up; a 1-layer model): {warm_s:.2f} s", flush=True)

    rows = []
    for hidden, seq in [(h, q) for h in args.hidden for q in args.seq]:
        cfg = GPTConfig(seq_len=seq, layers=args.layers, hidden=hidden, heads=args.heads)
        batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(args.warmup + args.steps)]
        row, steps = {"seq": seq, "hidden": hidden}, {}
        for codegen in ("eager", "inductor"):
            steps[codegen], compile_s = compiled(cfg, mc.Plan(partition_size=p, codegen=codegen), batches[0])
            row[codegen] = [None, compile_s, steps[codegen].codegen]
        rounds = interleaved_times_s(steps, batches, args.warmup)
        for codegen, times in rounds.items():
            row[codegen][0] = statistics.median(times)
            say(f"  h={hidden} seq {seq} {codegen:<8}: {row[codegen][0]:.3f} s/step, compile {row[codegen][1]:.2f} s",
                flush=True)
        paired = [e / i for e, i in zip(rounds["eager"], rounds["inductor"])]
        row["won"] = (sum(r > 1 for r in paired), len(paired))
        row["ratio"] = statistics.median(paired)
        state = {k: steps[k].full_state_dict() for k in steps}
        row["param_err"] = max(rel_error(state["inductor"][n], state["eager"][n]) for n in state["eager"])
        rows.append(row)

    depth = {}
    for layers in args.depths:
        cfg = GPTConfig(seq_len=args.seq[0], layers=layers, hidden=args.hidden[0], heads=args.heads)
        step, compile_s = compiled(cfg, mc.Plan(partition_size=p, codegen="inductor"),
                                   lm_batch(cfg, args.batch_per_rank, gen))
        depth[layers] = (compile_s, step.codegen)
        say(f"  {layers} layers: compile {compile_s:.2f} s", flush=True)

    if rank != 0:
        dist.destroy_process_group()
        return
    print(f"\nGPT heads={args.heads} layers={args.layers} vocab {GPTConfig().vocab_size}, {args.batch_per_rank} "
          f"sequences per rank, "
          f"{world} gloo ranks, Plan(partition_size={p}), SGD; {args.steps} rounds; torch {torch.__version__}")
    print(f"{'h':>4} {'seq':>5} {'eager s/step':>13} {'inductor s/step':>16} {'eager/inductor':>15} {'won':>6} "
          f"{'compile eager':>14} "
          f"{'compile inductor':>17} {'regions':>8} {'distinct':>9} {'param err':>10}")
    for r in rows:
        (es, ec, _), (is_, ic, rep) = r["eager"], r["inductor"]
        won = f"{r['won'][0]}/{r['won'][1]}"
        print(f"{r['hidden']:>4} {r['seq']:>5} {es:>13.3f} {is_:>16.3f} {r['ratio']:>14.2f}x {won:>6} {ec:>13.2f}s "
              f"{ic:>16.2f}s "
              f"{len(rep.regions):>8} {len(rep.compiled):>9} {r['param_err']:>10.1e}")
    print(f"\ncompile time against depth (h={args.hidden[0]}, seq {args.seq[0]}, inductor, cold caches):")
    print(f"{'layers':>7} {'compile s':>10} {'regions':>8} {'run compiled':>13} {'distinct compiles':>18} "
          f"{'Inductor s':>11}")
    for layers, (s, rep) in depth.items():
        print(f"{layers:>7} {s:>10.2f} {len(rep.regions):>8} {sum(r.compiled for r in rep.regions):>13} "
              f"{len(rep.compiled):>18} {rep.compile_s:>11.2f}")
    lo, hi = min(args.depths), max(args.depths)
    ratio = depth[hi][0] / depth[lo][0]
    print(f"\ngoal: compile time of {hi} vs {lo} layers within 1.5x: {ratio:.2f}x "
          f"({'met' if ratio <= 1.5 else 'NOT met'})")
    for r in rows:
        if r["seq"] >= 128:
            won, n = r["won"]
            verdict = "met" if r["ratio"] > 1 and won > n / 2 else "NOT met"
            print(f"goal: Inductor faster than eager at h={r['hidden']} seq {r['seq']}: {r['ratio']:.2f}x, faster "
                  f"in {won} of {n} rounds ({verdict})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
