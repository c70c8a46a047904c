"""One GPU, one rank: micscompile's step against torch.compile, DDP, FSDP2 and plain eager PyTorch on CUDA.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --tf32                  # the GPTs, fp32
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu.py --models llama-1b --micro-batches 1 --alone

What ``bench_peers.py`` measures on 4 gloo ranks, on the one GPU a rank owns (NCCL refuses two
ranks on one GPU, so p=1 and world 1): what each system's runtime costs on top of the same model's
compute, on the device it is built for. Same model, same batches (on the GPU before timing). The GPTs train in
fp32 (``--tf32``: TF32 matmuls); ``llama-1b`` (``zoo.models.LLAMA_1B``, Llama 3.2 1B's shape, 1.24B parameters,
seq 2048) in bf16: micscompile with ``Plan.param_dtype=torch.bfloat16`` (fp32 master weights), the others under
``torch.autocast`` (fp32 weights, bf16 matmuls; FSDP2 with its ``MixedPrecisionPolicy``). micscompile steps AdamW
by torch's fused kernel (``core.optim.prefer_fused``) and by default replays its step as one CUDA graph
(``Plan.cuda_graph="auto"``); "eager" and "torch.compile" step fused AdamW too (the floor: no wrapper, no
collective; ``torch.compile(model)``, Inductor's default mode), DDP and FSDP2 by torch's default (foreach on CUDA).
Every system is built first and then timed in alternation
(``timing.interleaved_times_s``: each round times every system once on the same batch; ``--alone``:
each system built, timed and freed in turn, no other system's memory or streams in the process: the 1B model's
five systems do not fit one GPU together), each
step from an idle device to its end (synchronized). Per (model, s): the median step, its ratio to
micscompile's, tokens/s, model FLOP utilization (MFU: 6 N + 12 l h s FLOPs per token, recomputation not counted,
over the GPU's dense peak in the run's precision: ``dense_peak``), the system's GPU memory at the peak of its first
step, and, for micscompile, whether a step makes the host
wait for the GPU (``torch.cuda.set_sync_debug_mode("error")`` around whole steps after warm-up).
Per system also the host's side of a step (``host_side``): the median time until the step returns
(its kernels queued, the device not waited for) and its share of the step, the aten ops it dispatches
(``OpCounter``) and the kernels it launches (``torch.profiler``: the runtime's and the driver's launch calls,
Triton's and a graph replay's included): what ``Plan.codegen="auto"`` must price on a host-bound GPU
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from bench_peers import Autocast, adamw, eager_step
from bench_peers import build as peer
from timing import interleaved_times_s

import micscompile as mc
from micscompile.core.launch import init_distributed
from micscompile.core.optim import prefer_fused
from micscompile.cost_model.specs import default_cluster
from micscompile.tune.profile import OpCounter
from micscompile.zoo.models import GPT, LLAMA_1B, GPTConfig, Llama, LlamaConfig, lm_batch, lm_loss

SYSTEMS = ["micscompile p=1", "eager (fused AdamW)", "torch.compile (fused AdamW)", "DDP (no_sync)", "FSDP2 (1 rank)"]


@dataclass(frozen=True)
class BenchModel:
    cfg: GPTConfig | LlamaConfig
    samples: int
    """Samples per optimizer step (split into the micro-batches)."""
    dtype: torch.dtype = torch.float32
    """The compute precision (bf16: fp32 master weights, bf16 matmuls)."""

    def build(self) -> torch.nn.Module:
        return (Llama if isinstance(self.cfg, LlamaConfig) else GPT)(self.cfg)


MODELS = {
    "small": BenchModel(GPTConfig(seq_len=64, layers=4, hidden=256), 8),  # bench_peers' CPU model: host-bound
    "gpt-350m": BenchModel(GPTConfig(seq_len=512, layers=24, hidden=1024), 16),  # (303M parameters)
    "llama-1b": BenchModel(LLAMA_1B, 4, torch.bfloat16),
}
def precision(dtype: torch.dtype, tf32: bool) -> str:
    return "bf16" if dtype == torch.bfloat16 else "tf32" if tf32 else "fp32"


def dense_peak(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """The GPU's dense peak FLOP/s in the run's precision, from the preset ``mc.compile`` prices it on (the vendors'
    sheets: ``specs.GpuSpec.peak_flops``); None for a GPU without one."""
    cluster = default_cluster("cuda", device_name, 1, 1)
    if cluster is None:
        return None
    return (cluster.gpu.with_tf32() if tf32 else cluster.gpu).flops(str(dtype).removeprefix("torch."))


def build(system: str, model: torch.nn.Module, s: int, example, device: torch.device, codegen: str,
          dtype: torch.dtype):
    """step(x, y) of one system."""
    if system.startswith("micscompile"):
        codegen = "inductor" if system.endswith("Inductor") else codegen
        plan = mc.Plan(partition_size=1, micro_batches=s, codegen=codegen, param_dtype=dtype,
                       cuda_graph=False if system.endswith("no graph") else "auto")
        step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=adamw, example_inputs=example)
        print(f"  {system}: {step.codegen_choice or 'codegen ' + codegen}; {step.cuda_graph_choice}", flush=True)
        return step
    if system.startswith("DDP"):
        return peer("DDP (no_sync)", model, 1, s, 1, example, len(example[0]), dtype)
    if system.startswith("FSDP2"):  # full shard over the one rank
        return peer("FSDP2 full shard", model, 1, s, 1, example, len(example[0]), dtype)
    model = copy.deepcopy(model).to(device)
    opt = adamw(model.parameters())
    prefer_fused(opt)
    run = torch.compile(model) if system.startswith("torch.compile") else model
    run = Autocast(run, dtype) if dtype != torch.float32 else run
    return lambda x, y: eager_step(run, opt, s, x, y)


def built(systems: list[str], model: torch.nn.Module, s: int, batch, device: torch.device, codegen: str,
          dtype: torch.dtype) -> tuple[dict, dict]:
    """name -> step(x, y) for every system, all built before any is timed; name -> its bytes at the
    peak of its first step (built from nothing: parameters, optimizer states, buffers and the step's own)."""
    steps, peaks = {}, {}
    for system in systems:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        steps[system] = build(system, model, s, batch, device, codegen, dtype)
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
    ap.add_argument("--no-graph", action="store_true",
                    help="also a micscompile row with cuda_graph=False (what replaying the step as one graph buys)")
    ap.add_argument("--alone", action="store_true",
                    help="build, time and free each system in turn (default: all built, timed in alternation)")
    args = ap.parse_args()
    systems = (SYSTEMS[:1] + ["micscompile p=1, Inductor"] * args.inductor + ["micscompile p=1, no graph"] * args.no_graph
               + SYSTEMS[1:])
    device = init_distributed(timeout=datetime.timedelta(seconds=300))
    if device.type != "cuda" or dist.get_world_size() != 1:
        raise SystemExit("bench_gpu.py runs one rank on one GPU: torchrun --nproc-per-node 1 on a CUDA machine")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dist.get_backend()}, "
          f"{'TF32' if args.tf32 else 'fp32'} matmuls, "
          f"AdamW; step = median of {args.steps} steps, systems timed "
          f"{'alone, one after another' if args.alone else 'in alternation'}", flush=True)
    head = (f"{'model':<10}{'s':>3} {'system':<28}{'step ms':>9}{'/mc':>7}{'tok/s':>9}{'MFU':>6}{'peak GiB':>10}"
            f"{'host ms':>9}{'host':>6}{'aten ops':>9}{'kernels':>8}  host syncs")
    rows = []
    for name in args.models:
        bench = MODELS[name]
        cfg, batch = bench.cfg, bench.samples
        torch.manual_seed(0)
        model = bench.build()
        n = sum(t.numel() for t in model.parameters())
        tokens = batch * cfg.seq_len
        flops = mc.model_flops_per_token(n, cfg.layers, cfg.hidden, cfg.seq_len) * tokens
        peak = dense_peak(torch.cuda.get_device_name(), bench.dtype, args.tf32)
        gen = torch.Generator().manual_seed(0)
        batches = [tuple(t.to(device) for t in lm_batch(cfg, batch, gen)) for _ in range(args.warmup + args.steps)]
        for s in args.micro_batches:
            print(f"{name} ({n / 1e6:.0f}M params, {cfg.layers} layers h={cfg.hidden} seq {cfg.seq_len}, {batch} "
                  f"samples, {precision(bench.dtype, args.tf32)}), s={s}; "
                  f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated before building", flush=True)
            # interleaved: all built, then timed in alternation; alone: each built, timed and freed in turn
            groups = [[system] for system in systems] if args.alone else [systems]
            measured = {}  # system -> (median step s, peak bytes, host s, aten ops, kernels, host syncs)
            for group in groups:
                steps, memory = built(group, model, s, batches[0], device, args.codegen, bench.dtype)
                times = interleaved_times_s(steps, batches, args.warmup)
                for system in group:
                    syncs = host_syncs(steps[system], batches[-1]) if system.startswith("micscompile") else ""
                    measured[system] = (statistics.median(times[system]), memory[system],
                                        *host_side(steps[system], batches[-5:]), syncs)
                del steps
                gc.collect()  # a step's reference cycles would keep its GPU memory into the next one
                torch.cuda.empty_cache()
            ours = measured["micscompile p=1"][0]
            for system, (t, mem, host, ops, launches, syncs) in measured.items():
                mfu = f"{flops / t / peak:>6.1%}" if peak else f"{'-':>6}"
                rows.append(f"{name:<10}{s:>3} {system:<28}{t * 1e3:>9.1f}{t / ours:>6.2f}x{tokens / t:>9.0f}{mfu}"
                            f"{mem / 2**30:>10.2f}{host * 1e3:>9.1f}{host / t:>6.0%}{ops:>9}{launches:>8}  {syncs}")
    print(head)
    print("-" * len(head))
    print("\n".join(rows))
    print("/mc > 1: the system is slower than micscompile. MFU: (6 N + 12 l h s) per token over the GPU's dense peak "
          "in the run's precision. peak GiB: the system's bytes at the peak of its first "
          "step, parameters, optimizer states and buffers included. host ms: until the step returns, "
          "its kernels queued, and its share of the step; aten ops and kernels: dispatched and launched per step.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
