"""Zero-bubble pipelines: micscompile's schedules against torch.distributed.pipelining's, and at scale.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_zero_bubble.py   # measured, 4 gloo ranks
    .venv/bin/python benchmarks/bench_zero_bubble.py --simulate                                   # BERT 104B, GPT-3 175B

Measured (one launch): one pipeline of S = 4 ranks (t = d = 1) trains the same residual-MLP stack (8 blocks,
hidden 256, global batch 32 of 16 tokens, m = 8 micro-batches, SGD) under 1F1B, interleaved 1F1B (v = 2),
ZB-H1, interleaved zero-bubble (v = 2) and ZB-V, each as micscompile compiles it and as
torch.distributed.pipelining runs it (``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` with one and with two stages per rank, ``ScheduleZBVZeroBubble``). The steps are
timed in alternation (``timing.interleaved_times_s``: every round times every row once, on the same batch): the
median of the slowest rank's time, and torch's over micscompile's for the same schedule (> 1: micscompile faster).
Every row's first-step loss is printed: the same model and batch, so the same number up to summation order.
Then micscompile's planned and measured peak activation memory per rank (arena plus what the ops allocate
outside it) under 1F1B and ZB-H1, the acceptance's table.

Simulated (``--simulate``): the same five schedules priced by ``mc.simulate`` on two of the seeds' plans, the
bubble fraction, step time and planned peak: BERT 104B at seq 4096 on 16 p4d (MiCS-Pipe S = 16, t = 8, b = 1,
G = 1024: thesis Fig. 4-13) and GPT-3 175B on 128 DGX A100 (autotune's pick: PTD-P t = 8 with sequence
parallelism, S = 16, b = 2, m = 96; docs/autotune.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import micscompile as mc

S, BLOCKS, H, SEQ, BATCH, M = 4, 8, 256, 16, 32, 8
SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("interleaved-zb", 2), ("zb-v", 2)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks=BLOCKS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _torch_step(model: Stack, kind: str, v: int, rank: int):
    """torch.distributed.pipelining's schedule over copies of the model's blocks: stage i holds blocks
    [i * n, (i + 1) * n) of S * v stages (V placement for ZBV: rank r holds stages r and 2S - 1 - r)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    n_stages = S * v
    per = BLOCKS // n_stages
    mine = [rank, 2 * S - 1 - rank] if kind == "zb-v" else [rank + S * j for j in range(v)]
    stages, params = [], []
    for i in mine:
        sub = nn.Sequential(*copy.deepcopy(list(model.layers[i * per:(i + 1) * per])))
        params += list(sub.parameters())
        stages.append(PipelineStage(sub, i, n_stages, torch.device("cpu")))
    cls = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zb-h1": ScheduleInterleavedZeroBubble,
           "interleaved-zb": ScheduleInterleavedZeroBubble, "zb-v": ScheduleZBVZeroBubble}[kind]
    sched = cls(stages[0] if cls is Schedule1F1B else stages, M, loss_fn=loss_fn)
    opt = torch.optim.SGD(params, lr=1e-2)
    first, last = 0 in mine, n_stages - 1 in mine

    def step(x, y):
        losses: list = []
        kwargs = ({"target": y, "losses": losses} if last else {})
        sched.step(*((x,) if first else ()), **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # (the last stage's; the others add zero)
        return loss
    return step


def measured(rounds: int) -> None:
    from timing import interleaved_times_s

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == S, f"run with --nproc-per-node {S}"
    torch.manual_seed(0)
    model = Stack()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, SEQ, H, generator=g), torch.randn(BATCH, SEQ, H, generator=g))
               for _ in range(rounds + 3)]
    steps, memory = {}, {}
    for kind, v in SCHEDULES:
        plan = mc.Plan(partition_size=1, pipeline_stages=S, micro_batches=M, pipeline_schedule=kind,
                       pipeline_chunks=v)
        step = mc.compile(copy.deepcopy(model), plan, loss_fn=loss_fn,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2),
                          example_inputs=batches[0])
        steps[f"micscompile {kind}"] = step
    for kind, v in SCHEDULES:
        steps[f"torch {kind}"] = _torch_step(model, kind, v, rank)
    first = {name: float(step(*batches[0]).detach()) for name, step in steps.items()}
    for kind in ("1f1b", "zb-h1"):  # (its second step, with every buffer allocated once)
        step = steps[f"micscompile {kind}"]
        step.track_memory = True
        step(*batches[1])
        st = step.memory_stats()
        memory[kind] = (st.arena_bytes + st.outside_planned_peak_bytes, st.arena_bytes + st.outside_measured_peak_bytes)
        step.track_memory = False
    times = interleaved_times_s(steps, batches[2:], warmup=1)
    mem = [None] * world
    dist.all_gather_object(mem, memory)
    if rank == 0:
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        print(f"S = {S} gloo ranks, {BLOCKS} residual MLP blocks (hidden {H}), global batch {BATCH} x {SEQ} tokens, "
              f"m = {M}; median step of {len(times[next(iter(times))])} rounds")
        print(f"{'schedule':<16}{'v':>2}{'micscompile ms':>16}{'torch ms':>10}{'torch/mc':>10}"
              f"{'loss mc':>11}{'loss torch':>11}")
        for kind, v in SCHEDULES:
            mine, theirs = med[f"micscompile {kind}"], med[f"torch {kind}"]
            print(f"{kind:<16}{v:>2}{mine * 1e3:>16.1f}{theirs * 1e3:>10.1f}{theirs / mine:>9.2f}x"
                  f"{first[f'micscompile {kind}']:>11.5f}{first[f'torch {kind}']:>11.5f}")
        print("\nmicscompile's peak activation memory per rank, KiB (arena + outside it): planned / measured")
        print(f"{'rank':<6}{'1f1b':>20}{'zb-h1':>20}")
        for r, m in enumerate(mem):
            print(f"{r:<6}" + "".join(f"{m[k][0] / 1024:>10.1f} / {m[k][1] / 1024:<7.1f}" for k in ("1f1b", "zb-h1")))
        for k in ("1f1b", "zb-h1"):
            print(f"peak over ranks {k}: planned {max(m[k][0] for m in mem) / 1024:.1f} KiB, measured "
                  f"{max(m[k][1] for m in mem) / 1024:.1f} KiB")
    dist.destroy_process_group()


def simulated() -> None:
    from micscompile.zoo.models import GPTConfig, meta_gpt

    dtype = torch.bfloat16
    cases = [
        ("BERT 104B seq 4096, 16 p4d, MiCS-Pipe S=16 t=8 b=1 G=1024", mc.Cluster.preset("p4d.24xlarge", nodes=16),
         GPTConfig(vocab_size=50000, seq_len=4096, layers=128, hidden=8192, heads=64, causal=False), 1,
         dict(partition_size=8, pipeline_stages=16, micro_batches=1024 // 8)),
        ("GPT-3 175B, 128 DGX A100, PTD-P t=8 sp S=16 b=2 m=96", mc.Cluster.preset("dgx-a100", nodes=128),
         GPTConfig(vocab_size=51200, seq_len=2048, layers=96, hidden=12288, heads=96), 2,
         dict(partition_size=1, tensor_parallel_size=8, sequence_parallel=True, pipeline_stages=16, micro_batches=96)),
    ]
    for label, cluster, cfg, b, fields in cases:
        t0 = time.perf_counter()
        tg = mc.trace(*meta_gpt(cfg, b), param_dtype=dtype)
        print(f"\n{label} (traced in {time.perf_counter() - t0:.0f} s)")
        print(f"{'schedule':<16}{'v':>2}{'bubble':>8}{'step s':>9}{'vs 1f1b':>9}{'peak GiB':>10}{'sim s':>7}")
        base = None
        for kind, v in SCHEDULES:
            t1 = time.perf_counter()
            plan = mc.Plan(pipeline_schedule=kind, pipeline_chunks=v, param_dtype=dtype, reduce_dtype=dtype,
                           optimizer_sharding="partition", **fields)
            pred = mc.simulate(tg, plan, cluster)
            base = base or pred.step_time_s
            print(f"{kind:<16}{v:>2}{pred.bubble_fraction:>8.1%}{pred.step_time_s:>9.3f}"
                  f"{base / pred.step_time_s:>8.3f}x{pred.peak_memory_bytes / (1 << 30):>10.1f}"
                  f"{time.perf_counter() - t1:>7.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true", help="price the schedules at paper scale (no launch)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds (each times every row once)")
    args = ap.parse_args()
    if args.simulate:
        simulated()
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        measured(args.rounds)


if __name__ == "__main__":
    main()
