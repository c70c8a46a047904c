"""Step time of micscompile against FSDP2 (HSDP and full shard) and DDP, side by side.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_step.py

Same GPT, same ranks, same batches, same AdamW, one launch. Every system runs
``--warmup`` steps, then ``--steps`` timed steps (barrier before each); the table
shows the median step time and each peer's time divided by micscompile's (> 1: micscompile is faster).
Gradient accumulation for the peers is what their docs recommend: DDP skips the
all-reduce (``no_sync``) except on the last micro-batch; FSDP2 reduces every
micro-batch by default; the "HSDP 2-hop" row is FSDP2's own
``set_requires_all_reduce(False)`` until the last micro-batch, the same idea as MiCS's 2-hop sync.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import micscompile as mc
from micscompile.models import GPT, GPTConfig, lm_batch, lm_loss
from timing import median_step_s


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def eager_step(model, opt, micro_batches, x, y, *, sync_ctx=None, before_last=None):
    """One optimizer step with gradient accumulation for an eager (hook-based) peer."""
    xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
    total = 0.0
    for j, (xb, yb) in enumerate(zip(xs, ys)):
        last = j == micro_batches - 1
        if before_last is not None:
            before_last(last)
        ctx = sync_ctx() if (sync_ctx is not None and not last) else contextlib.nullcontext()
        with ctx:
            loss = lm_loss(model(xb), yb) / micro_batches
            loss.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def build(system: str, model: GPT, p: int, s: int, example):
    """Returns step(x, y) for one system."""
    world = dist.get_world_size()
    if system.startswith("micscompile"):
        step = mc.compile(model, mc.Plan(partition_size=p, micro_batches=s), loss_fn=lm_loss,
                          optimizer=adamw, example_inputs=example,
                          prefetch=(0,) if system == "micscompile no prefetch" else None)
        return lambda x, y: float(step(x, y))
    model = copy.deepcopy(model)
    if system == "DDP":
        ddp = DDP(model)
        opt = adamw(ddp.parameters())
        return lambda x, y: eager_step(ddp, opt, s, x, y, sync_ctx=ddp.no_sync)
    if system.startswith("FSDP2 HSDP"):
        mesh = init_device_mesh("cpu", (world // p, p), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())
    if system == "FSDP2 HSDP 2-hop":
        return lambda x, y: eager_step(model, opt, s, x, y, before_last=model.set_requires_all_reduce)
    return lambda x, y: eager_step(model, opt, s, x, y)


def global_mean(local_loss: float) -> float:
    """Peers return this rank's loss; micscompile returns the global mean: compare those."""
    t = torch.tensor([local_loss])
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def main() -> None:
    ap = argparse.ArgumentParser(description="micscompile vs FSDP2 / DDP step time")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--partition-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    p = args.partition_size
    cfg = GPTConfig(seq_len=args.seq, layers=args.layers, hidden=args.hidden)
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(args.warmup + args.steps)]
    systems = ["micscompile", "micscompile no prefetch", "FSDP2 HSDP", "FSDP2 HSDP 2-hop", "FSDP2 full shard", "DDP"]
    labels = {
        "micscompile": f"micscompile p={p} (2-hop)",
        "micscompile no prefetch": f"micscompile p={p}, no prefetch",
        "FSDP2 HSDP": f"FSDP2 HSDP {world // p}x{p}",
        "FSDP2 HSDP 2-hop": f"FSDP2 HSDP {world // p}x{p}, AR last",
        "FSDP2 full shard": f"FSDP2 full shard ({world})",
        "DDP": "DDP (no_sync)",
    }
    results: dict[tuple[str, int], tuple[float, float]] = {}
    for s in args.micro_batches:
        for system in systems:
            step = build(system, model, p, s, batches[0])
            t, loss = median_step_s(step, batches, args.warmup)
            results[(system, s)] = (t, loss if system.startswith("micscompile") else global_mean(loss))
            del step

    if rank == 0:
        n_params = sum(t.numel() for t in model.parameters())
        print(f"GPT {cfg.layers} layers h={cfg.hidden} seq {cfg.seq_len} ({n_params / 1e6:.1f}M params), "
              f"{world} gloo ranks (CPU), {args.batch_per_rank} samples/rank, AdamW; "
              f"median of {args.steps} steps after {args.warmup} warm-up, slowest rank")
        head = f"{'system':<30}" + "".join(f"{f's={s} step':>12}{'peer/mc':>9}" for s in args.micro_batches)
        print(head)
        print("-" * len(head))
        for system in systems:
            row = f"{labels[system]:<30}"
            for s in args.micro_batches:
                t, mc_t = results[(system, s)][0], results[("micscompile", s)][0]
                row += f"{t:>10.3f} s{t / mc_t:>8.2f}x"
            print(row)
        print("peer/mc > 1: micscompile is faster. Last-step global mean loss (sanity, same data): "
              + ", ".join(f"{labels[sy].split(' (')[0]} {results[(sy, args.micro_batches[-1])][1]:.4f}"
                          for sy in systems))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
