"""One GPU, one rank: micscompile's step against DDP, FSDP2 and plain eager PyTorch on CUDA.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py

What ``bench_peers.py`` measures on 4 gloo ranks, on the one GPU a rank owns (NCCL refuses two
ranks on one GPU, so p=1 and world 1): what each system's runtime costs on top of the same model's
compute, on the device it is built for. Same GPT, same batches (on the GPU before timing), fp32
(``--tf32``: TF32 matmuls) for all; micscompile steps AdamW by torch's fused kernel (``core.optim.prefer_fused``),
the peers by torch's default (foreach on CUDA), "eager" by the fused kernel as micscompile does (the
floor: no wrapper, no collective). Every system is built first and then timed in alternation
(``timing.interleaved_times_s``: each round times every system once on the same batch; ``--alone``:
each system built, timed and freed in turn, no other system's memory or streams in the process), each
step from an idle device to its end (synchronized). Per (model, s): the median step, its ratio to
micscompile's, the system's GPU memory at the peak of its first step, and, for micscompile, whether a step makes the host
wait for the GPU (``torch.cuda.set_sync_debug_mode("error")`` around whole steps after warm-up).
Per system also the host's side of a step (``host_side``): the median time until the step returns
(its kernels queued, the device not waited for), the aten ops it dispatches (``OpCounter``) and the
kernels it launches (``torch.profiler``: the runtime's and the driver's launch calls, Triton's
included): what ``Plan.codegen="auto"`` must price on a host-bound GPU (docs/performance.md).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import statistics
import time

import torch
import torch.distributed as dist
from bench_peers import adamw, eager_step
from bench_peers import build as peer
from timing import interleaved_times_s

import micscompile as mc
from micscompile.core.launch import init_distributed
from micscompile.core.optim import prefer_fused
from micscompile.tune.profile import OpCounter
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

SYSTEMS = ["micscompile p=1", "eager (fused AdamW)", "DDP (no_sync)", "FSDP2 (1 rank)"]
MODELS = {  # name -> (layers, hidden, seq, samples per step)
    "small": (4, 256, 64, 8),  # bench_peers' CPU model: the GPU idles, the host's launches are the step
    "gpt-350m": (24, 1024, 512, 16),
}


def build(system: str, model: GPT, s: int, example, device: torch.device, codegen: str):
    """step(x, y) of one system."""
    if system.startswith("micscompile"):
        codegen = "inductor" if system.endswith("Inductor") else codegen
        step = mc.compile(model, mc.Plan(partition_size=1, micro_batches=s, codegen=codegen), loss_fn=lm_loss,
                          optimizer=adamw, example_inputs=example)
        print(f"  {system}: {step.codegen_choice or 'codegen ' + codegen}", flush=True)
        return step
    if system.startswith("DDP"):
        return peer("DDP (no_sync)", model, 1, s, 1, example, len(example[0]))
    if system.startswith("FSDP2"):  # full shard over the one rank
        return peer("FSDP2 full shard", model, 1, s, 1, example, len(example[0]))
    model = copy.deepcopy(model).to(device)
    opt = adamw(model.parameters())
    prefer_fused(opt)
    return lambda x, y: eager_step(model, opt, s, x, y)


def built(systems: list[str], model: GPT, s: int, batch, device: torch.device, codegen: str) -> tuple[dict, dict]:
    """name -> step(x, y) for every system, all built before any is timed; name -> its bytes at the
    peak of its first step (built from nothing: parameters, optimizer states, buffers and the step's own)."""
    steps, peaks = {}, {}
    for system in systems:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        steps[system] = build(system, model, s, batch, device, codegen)
        steps[system](*batch)
        torch.cuda.synchronize()
        peaks[system] = torch.cuda.max_memory_allocated() - base
    return steps, peaks


def host_syncs(step, batch) -> str:
    """Whether a whole step makes the host wait for the GPU: CUDA's sync debug mode raises on the first
    synchronizing call (``.item()``, a device-to-host copy, a synchronize)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*batch)
        return "none"
    except RuntimeError as e:
        return f"SYNC: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def host_side(step, batches) -> tuple[float, int, int]:
    """(median seconds until a step returns, from an idle device; aten ops it dispatches; kernels it
    launches). On a host-bound step the first is close to the step's time, and over the launches it is
    the host's cost per kernel."""
    times = []
    for batch in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with OpCounter() as ops:
        step(*batches[0])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(*batches[0])
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key)
    return statistics.median(times), ops.total, launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--codegen", default="auto", choices=["auto", "eager", "inductor"],
                    help="Plan.codegen of the micscompile row")
    ap.add_argument("--tf32", action="store_true", help="fp32 matmuls in TF32 (PyTorch's default: off)")
    ap.add_argument("--inductor", action="store_true", help="also a micscompile row with codegen='inductor'")
    ap.add_argument("--alone", action="store_true",
                    help="build, time and free each system in turn (default: all built, timed in alternation)")
    args = ap.parse_args()
    systems = SYSTEMS[:1] + ["micscompile p=1, Inductor"] * args.inductor + SYSTEMS[1:]
    device = init_distributed(timeout=datetime.timedelta(seconds=300))
    if device.type != "cuda" or dist.get_world_size() != 1:
        raise SystemExit("bench_gpu.py runs one rank on one GPU: torchrun --nproc-per-node 1 on a CUDA machine")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dist.get_backend()}, "
          f"{'TF32' if args.tf32 else 'fp32'} matmuls, "
          f"AdamW; step = median of {args.steps} steps, systems timed "
          f"{'alone, one after another' if args.alone else 'in alternation'}", flush=True)
    head = (f"{'model':<10}{'s':>3} {'system':<26}{'step ms':>9}{'/mc':>7}{'peak GiB':>10}{'host ms':>9}"
            f"{'aten ops':>9}{'kernels':>8}  host syncs")
    rows = []
    for name in args.models:
        layers, hidden, seq, batch = MODELS[name]
        cfg = GPTConfig(seq_len=seq, layers=layers, hidden=hidden)
        torch.manual_seed(0)
        model = GPT(cfg)
        n = sum(t.numel() for t in model.parameters())
        gen = torch.Generator().manual_seed(0)
        batches = [tuple(t.to(device) for t in lm_batch(cfg, batch, gen)) for _ in range(args.warmup + args.steps)]
        for s in args.micro_batches:
            print(f"{name} ({n / 1e6:.0f}M params, {layers} layers h={hidden} seq {seq}, {batch} samples), s={s}; "
                  f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated before building", flush=True)
            # interleaved: all built, then timed in alternation; alone: each built, timed and freed in turn
            groups = [[system] for system in systems] if args.alone else [systems]
            measured = {}  # system -> (median step s, peak bytes, host s, aten ops, kernels, host syncs)
            for group in groups:
                steps, peaks = built(group, model, s, batches[0], device, args.codegen)
                times = interleaved_times_s(steps, batches, args.warmup)
                for system in group:
                    syncs = host_syncs(steps[system], batches[-1]) if system.startswith("micscompile") else ""
                    measured[system] = (statistics.median(times[system]), peaks[system],
                                        *host_side(steps[system], batches[-5:]), syncs)
                del steps
                gc.collect()  # a step's reference cycles would keep its GPU memory into the next one
                torch.cuda.empty_cache()
            ours = measured["micscompile p=1"][0]
            for system, (t, peak, host, ops, launches, syncs) in measured.items():
                rows.append(f"{name:<10}{s:>3} {system:<26}{t * 1e3:>9.1f}{t / ours:>6.2f}x"
                            f"{peak / 2**30:>10.2f}{host * 1e3:>9.1f}{ops:>9}{launches:>8}  {syncs}")
    print(head)
    print("-" * len(head))
    print("\n".join(rows))
    print("/mc > 1: the system is slower than micscompile. peak GiB: the system's bytes at the peak of its first "
          "step, parameters, optimizer states and buffers included. host ms: until the step returns, "
          "its kernels queued; aten ops and kernels: dispatched and launched per step.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
