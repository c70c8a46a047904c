"""A soak run: the demo model trained for many steps, per step what could grow.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/soak.py [--steps 2000] [--plot docs/soak.png]

Two plans, one after the other in one launch: the demo's flat plan (p=2, s=4) for ``--steps`` steps,
then a pipeline plan (S=2, 1F1B, s=4) for half as many. Per step, on every rank:

- RSS: the process's resident memory (``/proc/self/statm``), after the step;
- step time: wall time of the step (barrier before it; the slowest rank's);
- bytes outside the arena: every ``--probe-every``-th step runs under ``memory.arena.OutsideArena``
  (a dispatch mode; such steps are not timed): the peak bytes ops allocated in it, and the bytes
  still alive after it (what a leak would leave);
- arena bytes: the planned arena, fixed at compile (printed once).

Growth: a least-squares line through RSS after ``--warmup`` steps, reported per 1,000 steps; "zero
within noise" when it is inside twice the residuals' standard deviation (RSS moves in steps as the C
heap grows and trims) or under one page. The same for the probes' live bytes after a step (tensors:
what a leak in the step would leave). ``--json`` keeps every step's figures.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.core.launch import init_distributed
from micscompile.memory.arena import OutsideArena
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def growth_per_1000(steps: list[int], values: list[float]) -> tuple[float, float]:
    """(slope per 1,000 steps of a least-squares line through the points, the noise: twice the
    residuals' standard deviation). RSS moves in steps as the C heap grows and trims, not as scatter
    about a line: a slope inside that band is not told apart from zero."""
    n = len(steps)
    if n < 3:
        return 0.0, math.inf
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    slope = sum((x - mx) * (y - my) for x, y in zip(steps, values)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(steps, values)]
    return slope * 1000, 2 * math.sqrt(sum(r * r for r in resid) / (n - 2))


def soak(name: str, plan: mc.Plan, steps: int, args, cfg: GPTConfig) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(16)]  # reused in turn: no data growth
    step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      example_inputs=batches[0])
    # (step, rss, seconds or nan, outside peak or nan, outside live or nan): allocated up front, so the
    # measurement itself grows nothing while it runs
    table = np.full((steps, 5), np.nan)
    start = time.perf_counter()
    for i in range(steps):
        batch = batches[i % len(batches)]
        probe = i % args.probe_every == args.probe_every - 1
        dist.barrier()
        t0 = time.perf_counter()
        if probe:
            with OutsideArena() as outside:
                loss = float(step(*batch))
            table[i, [0, 1, 3, 4]] = i, rss_bytes(), outside.peak_bytes, outside.live_bytes
        else:
            loss = float(step(*batch))
            table[i, :3] = i, rss_bytes(), time.perf_counter() - t0
        if rank == 0 and (i + 1) % max(1, steps // 10) == 0:
            print(f"  {name}: step {i + 1}/{steps}, loss {loss:.4f}, "
                  f"rss {fmt_bytes(table[i, 1])}, {time.perf_counter() - start:.0f} s", flush=True)
    rows = [(int(r[0]), int(r[1]), *(None if math.isnan(v) else float(v) for v in r[2:])) for r in table]
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    return {"name": name, "rows": everyone, "arena": step.memory_stats().arena_bytes, "plan": str(step.program.plan)}


def summary(result: dict, warmup: int) -> dict:
    """Per rank: RSS and live-after-step growth per 1,000 steps after warm-up; step times (slowest rank)."""
    out = {"name": result["name"], "plan": result["plan"], "arena": result["arena"], "ranks": []}
    for rows in result["rows"]:
        late = [r for r in rows if r[0] >= warmup]
        rss = growth_per_1000([r[0] for r in late], [r[1] for r in late])
        probes = [r for r in late if r[4] is not None]
        live = growth_per_1000([r[0] for r in probes], [r[4] for r in probes])
        out["ranks"].append({"rss_first": rows[warmup][1], "rss_last": rows[-1][1], "rss_growth": rss,
                             "live_growth": live, "outside_peak": max((r[3] for r in probes), default=0),
                             "live_after": [r[4] for r in probes][-1] if probes else 0})
    times = list(zip(*[[r[2] for r in rows] for rows in result["rows"]]))
    slowest = [max(t) for t in times if t[0] is not None]
    half = len(slowest) // 2
    out["time_first_half"] = sorted(slowest[:half])[half // 2] if half else float("nan")
    out["time_second_half"] = sorted(slowest[half:])[len(slowest[half:]) // 2] if slowest else float("nan")
    return out


def zero_within_noise(growth: tuple[float, float]) -> bool:
    slope, noise = growth
    return abs(slope) <= max(noise, PAGE)


def print_summary(s: dict, steps: int, warmup: int) -> None:
    print(f"\n{s['name']}: {s['plan']}, {steps} steps (growth fitted after step {warmup}); arena "
          f"{fmt_bytes(s['arena'])} (planned at compile, fixed)")
    print(f"{'rank':>4}  {'RSS at warm-up':>15}{'RSS at end':>12}{'RSS growth / 1000 steps':>32}"
          f"{'live after a step':>19}{'its growth / 1000':>26}{'outside peak':>14}")
    for r, x in enumerate(s["ranks"]):
        g, lg = x["rss_growth"], x["live_growth"]
        print(f"{r:>4}  {fmt_bytes(x['rss_first']):>15}{fmt_bytes(x['rss_last']):>12}"
              f"{fmt_bytes(g[0]):>14} +- {fmt_bytes(g[1]):>10} {'(0)' if zero_within_noise(g) else 'GROWS':>5}"
              f"{fmt_bytes(x['live_after']):>19}{fmt_bytes(lg[0]):>12} +- {fmt_bytes(lg[1]):>10}"
              f"{fmt_bytes(x['outside_peak']):>14}")
    print(f"step time (slowest rank, median): first half {s['time_first_half'] * 1e3:.1f} ms, second half "
          f"{s['time_second_half'] * 1e3:.1f} ms")


def plot(results: list[dict], warmups: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.2 * len(results)), squeeze=False)
    for (ax_mem, ax_time), res, warmup in zip(axes, results, warmups):
        for rank, rows in enumerate(res["rows"]):
            ax_mem.plot([r[0] for r in rows], [r[1] / 2**20 for r in rows], lw=0.8, label=f"rank {rank}")
        ax_mem.axvline(warmup, color="grey", ls=":", lw=0.8)
        ax_mem.set(title=f"{res['name']}: RSS", xlabel="step", ylabel="MiB")
        ax_mem.legend(fontsize="small")
        times = list(zip(*[[r[2] for r in rows] for rows in res["rows"]]))
        pts = [(i, max(t) * 1e3) for i, t in enumerate(times) if t[0] is not None]
        ax_time.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.5)
        ax_time.set(title=f"{res['name']}: step time (slowest rank)", xlabel="step", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="flat plan's steps (the pipeline runs half)")
    ap.add_argument("--warmup", type=int, default=200, help="steps before the growth fit (the pipeline: half)")
    ap.add_argument("--probe-every", type=int, default=10)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--plot", default=None, help="write the RSS and step-time picture here")
    ap.add_argument("--json", default=None, help="write every rank's per-step figures here")
    args = ap.parse_args()
    init_distributed(timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, seq_len=32, layers=2, hidden=128, heads=4)  # the demo's model
    runs = [("flat p=2 s=4", mc.Plan(partition_size=2, micro_batches=4), args.steps, args.warmup),
            ("pipeline S=2 1f1b s=4", mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=4),
             args.steps // 2, args.warmup // 2)]
    results = []
    for name, plan, steps, warmup in runs:
        res = soak(name, plan, steps, args, cfg)
        if dist.get_rank() == 0:
            print_summary(summary(res, warmup), steps, warmup)
        results.append(res)
    if dist.get_rank() == 0 and args.plot:
        plot(results, [run[3] for run in runs], args.plot)
    if dist.get_rank() == 0 and args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
