"""Simulated at paper scale: MiCS vs MiCS-Pipe, BERT 52B / 104B on 128 A100-40GB (thesis 4.5.1).

    .venv/bin/python benchmarks/bench_pipeline.py                 # both models, both scenarios
    .venv/bin/python benchmarks/bench_pipeline.py --quick         # BERT 52B, G = 1024 only
    .venv/bin/python benchmarks/bench_pipeline.py --models 104B --no-interleaved

Models (thesis Table 4-I): hidden 8192, FFN 32768, 64 heads, vocab 50000, bidirectional
attention; BERT 52B has 64 layers, BERT 104B 128 ("doubles the number of transformer
layers": the table repeats 52B's row for 104B, a typo). Systems (Table 4-II) on 16
p4d.24xlarge nodes: MiCS p = 64 (52B) / 128 (104B); MiCS-Pipe t = 8 GPUs per stage,
S = 8 (52B, d = 2) / 16 (104B, d = 1) stages, synchronous 1F1B, m = G / (b * d * t)
micro-batches per pipeline (also interleaved 1F1B with v = 2 chunks per rank).

Scenario A (Fig. 4-13): seq 4096, micro-batch 1 for both systems, G in 512, 1024, 2048;
the thesis has MiCS-Pipe ahead from G = 1024 (up to 42% over MiCS for 104B).
Scenario B (Fig. 4-15): seq 1024, micro-batch 8 (MiCS) / 2 (MiCS-Pipe), G in 1024, 2048,
4096; the thesis has MiCS ahead (up to 32.5%).

16-bit mixed precision as the thesis trains (``Plan.param_dtype = reduce_dtype = bfloat16``, as
``reproduce_thesis.py`` prices p4d): compute at the A100's tensor-core peak, gathers and
reductions in 16 bits (fp32 would double every gather and make MiCS look gather-bound at seq
4096), and activation checkpointing only with
``--checkpoint``: peak memory is printed against the 40 GiB device, not enforced. TFLOP/s per
GPU by the thesis's formula (eq. 4.5, 96 B s l h^2 (1 + s/6h + V/16lh), which counts the recompute pass the simulation does not
run) over all G samples, divided by 128 GPUs and the step time. Each (model, seq,
micro-batch) is traced once, on the meta device, and reused for every G. No GPU needed.

When no cut of the model into S chunks fits the device (here: none, without checkpointing),
the split balances time alone and the peak column says how far over it is, as for MiCS.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

import micscompile as mc
from micscompile.zoo.models import GPTConfig, meta_gpt

GIB = 1 << 30
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    mics_p: int  # MiCS partition size (d = n / p)
    stages: int  # MiCS-Pipe S (t = 8)


MODELS = {"52B": Model("BERT 52B", 64, 64, 8), "104B": Model("BERT 104B", 128, 128, 16)}
HIDDEN, HEADS, VOCAB, T = 8192, 64, 50000, 8


@dataclass(frozen=True)
class Scenario:
    name: str
    seq: int
    mics_b: int
    pipe_b: int
    batches: tuple[int, ...]


SCENARIOS = (
    Scenario("A (Fig. 4-13)", 4096, 1, 1, (512, 1024, 2048)),
    Scenario("B (Fig. 4-15)", 1024, 8, 2, (1024, 2048, 4096)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["52B", "104B"])
    ap.add_argument("--quick", action="store_true", help="BERT 52B only, G = 1024 only, 1F1B only")
    ap.add_argument("--no-interleaved", action="store_true", help="skip the interleaved-1F1B (v = 2) rows")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing (every block) in both systems")
    args = ap.parse_args()
    models = ["52B"] if args.quick else args.models
    interleaved = not (args.quick or args.no_interleaved)
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=args.nodes)
    n, cap = cluster.world_size, cluster.gpu.memory_bytes
    print(f"{n} x {cluster.gpu.name} ({args.nodes} x p4d.24xlarge), 16-bit mixed precision ({DTYPE}), "
          f"capacity {cap / GIB:.0f} GiB per GPU")
    head = (f"{'model':<10}{'seq':>5}{'G':>6}  {'system':<30}{'b':>3}{'m':>5}{'step s':>9}{'TFLOP/s':>9}"
            f"{'bubble':>8}{'peak GiB':>10}{'fits':>5}{'Pipe/MiCS':>10}{'sim s':>7}")
    verdicts: dict[str, list[tuple[str, int, float]]] = {}  # scenario -> (model, G, Pipe/MiCS)
    t_start = time.perf_counter()
    for sc in SCENARIOS:
        batches = (1024,) if args.quick else sc.batches
        print(f"\nScenario {sc.name}: seq {sc.seq}, micro-batch {sc.mics_b} (MiCS) / {sc.pipe_b} (MiCS-Pipe)")
        for key in models:
            md = MODELS[key]
            cfg = GPTConfig(vocab_size=VOCAB, seq_len=sc.seq, layers=md.layers, hidden=HIDDEN, heads=HEADS,
                            causal=False)
            t0 = time.perf_counter()
            traces = {b: mc.trace(*meta_gpt(cfg, b), param_dtype=DTYPE) for b in dict.fromkeys((sc.mics_b, sc.pipe_b))}
            print(f"{md.name}: {traces[sc.mics_b].summary()}; traced {len(traces)} micro-batch size(s) in "
                  f"{time.perf_counter() - t0:.1f} s")
            print(head)
            d_pipe = n // (md.stages * T)
            for G in batches:
                # thesis eq. 4.5 over the global batch, per GPU: TFLOP/s = F / (n * step)
                flops = mc.transformer_flops(G, sc.seq, md.layers, HIDDEN, VOCAB) / n
                systems = [(f"MiCS p={md.mics_p}", sc.mics_b, None)]
                systems.append((f"MiCS-Pipe S={md.stages} t={T} 1f1b", sc.pipe_b,
                                dict(pipeline_schedule="1f1b")))
                if interleaved:
                    systems.append((f"MiCS-Pipe S={md.stages} t={T} intl v=2", sc.pipe_b,
                                    dict(pipeline_schedule="interleaved", pipeline_chunks=2)))
                mics_tflops = None
                for label, b, pipe in systems:
                    t1 = time.perf_counter()
                    if pipe is None:
                        m = G // (b * n)
                        assert m * b * n == G, (G, b, n)
                        plan = mc.Plan(partition_size=md.mics_p, micro_batches=m, checkpoint=args.checkpoint,
                                       param_dtype=DTYPE, reduce_dtype=DTYPE, optimizer_sharding="partition")
                    else:
                        m = G // (b * d_pipe * T)
                        assert m * b * d_pipe * T == G, (G, b, d_pipe)
                        plan = mc.Plan(partition_size=T, pipeline_stages=md.stages, micro_batches=m,
                                       checkpoint=args.checkpoint, param_dtype=DTYPE, reduce_dtype=DTYPE,
                                       optimizer_sharding="partition", **pipe)
                    pred = mc.simulate(traces[b], plan, cluster, flops_per_step=flops)
                    sim_s = time.perf_counter() - t1
                    tf = pred.tflops_per_gpu
                    ratio = ""
                    if pipe is None:
                        mics_tflops = tf
                    elif mics_tflops is not None:
                        ratio = f"{tf / mics_tflops:.3f}x"
                        if pipe["pipeline_schedule"] == "1f1b":
                            verdicts.setdefault(sc.name, []).append((md.name, G, tf / mics_tflops))
                    bubble = "-" if pred.bubble_fraction is None else f"{pred.bubble_fraction:.1%}"
                    peak = pred.peak_memory_bytes
                    print(f"{md.name:<10}{sc.seq:>5}{G:>6}  {label:<30}{b:>3}{m:>5}"
                          f"{pred.step_time_s:>9.2f}{tf:>9.1f}{bubble:>8}{peak / GIB:>10.1f}"
                          f"{'yes' if peak <= cap else 'no':>5}{ratio:>10}{sim_s:>7.1f}")

    print()
    for sc in SCENARIOS:
        rows = [r for r in verdicts.get(sc.name, []) if r[1] >= 1024]
        detail = ", ".join(f"{name} G={G}: {r:.3f}x" for name, G, r in rows)
        if sc.seq == 4096:
            ok = sum(r > 1 for _, _, r in rows)
            print(f"MiCS-Pipe faster at seq 4096, G >= 1024: {'yes' if rows and ok == len(rows) else 'no'} "
                  f"({ok}/{len(rows)} rows; Pipe/MiCS {detail})")
        else:
            ok = sum(r < 1 for _, _, r in rows)
            print(f"MiCS faster at seq 1024, G >= 1024: {'yes' if rows and ok == len(rows) else 'no'} "
                  f"({ok}/{len(rows)} rows; Pipe/MiCS {detail})")
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
