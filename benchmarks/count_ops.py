"""The ops each system dispatches in one training step: host time on a GPU.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/count_ops.py

On a GPU a small model's step is the host dispatching ops (docs/gpu.md: on one H100 micscompile p=1
was 1.12-1.46x slower than DDP while it dispatched 2.5x eager PyTorch's ops). The count does not
depend on the device, so it is measured here: rank 0's dispatches (a ``TorchDispatchMode`` around
one step, after two) for bench_peers' systems on its GPT, and for eager PyTorch on one rank (the
same micro-batches, ``.grad`` accumulation, torch's fused AdamW): the floor without a wrapper.
"""

from __future__ import annotations

import argparse
import collections
import datetime

import torch
import torch.distributed as dist
from bench_peers import SYSTEMS, adamw, build, eager_step

from micscompile.core.optim import prefer_fused
from micscompile.tune.profile import OpCounter
from micscompile.zoo.models import GPT, GPTConfig, lm_batch


def counted(step, batches) -> collections.Counter:
    step(*batches[0])
    step(*batches[1])
    with OpCounter() as ops:
        step(*batches[2])
    return ops.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    cfg = GPTConfig(seq_len=64, layers=4, hidden=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(3)]
    rows = []
    for s in args.micro_batches:
        eager = GPT(cfg)
        eager.load_state_dict(model.state_dict())
        opt = adamw(eager.parameters())
        prefer_fused(opt)
        step = lambda x, y, m=eager, o=opt, s=s: eager_step(m, o, s, x, y)  # noqa: E731
        rows.append((s, "eager PyTorch (one rank)", 1, counted(step, batches)))
        for system, p in SYSTEMS:
            if world % p or system.startswith("DeepSpeed"):  # (DeepSpeed's hooks dispatch outside one step's window)
                continue
            rows.append((s, system, p, counted(build(system, model, p, s, args.gpus_per_node, batches[0],
                                                     args.batch_per_rank), batches)))
            dist.barrier()
    if dist.get_rank() == 0:
        print(f"GPT {cfg.layers} layers h={cfg.hidden} seq {cfg.seq_len}, {world} gloo ranks, "
              f"{args.batch_per_rank} samples/rank: ops rank 0 dispatches in one step")
        print(f"{'s':>2} {'system':<32}{'p':>3}{'ops':>7}  most dispatched")
        for s, system, p, count in rows:
            top = ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in count.most_common(4))
            print(f"{s:>2} {system:<32}{p:>3}{sum(count.values()):>7}  {top}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
