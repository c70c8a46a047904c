"""Simulated: long-context training with context parallelism, at the scale the seeds plan for.

    python benchmarks/bench_long_context.py [--layers 32] [--seqs 32768 65536 131072 262144]

A Llama-3-8B-class decoder (``zoo.models.Llama``: 32 layers, hidden 4096, 32 query and 8 key/value heads, SwiGLU
14336, vocabulary 128256) on one node of 8 H100 (``p5.48xlarge@2025``, today's preset), bf16, every layer
recomputed, the parameters sharded over the node (p = 8), 8 sequences per step. For each sequence length and
c = 1, 2, 4, 8 context ranks (Ulysses; ``mc.simulate`` on a trace of one context rank's tokens, s / c): the
predicted step, tokens per second per GPU, the peak memory per GPU and whether it fits the 80 GB. Then, per
attention layer and micro-batch, what each exchange costs at c = 8 (``cost_model.context_exchange``): the bytes a
rank sends forward and backward, their time, and what of it the attention waits for (the ring's hops hide behind
its blocks; the all-gather's and Ulysses' collectives do not). Takes about a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

import micscompile as mc
from micscompile.cost_model.context_exchange import EXCHANGES, AttentionShape, exchange_bytes, exchange_time_s
from micscompile.zoo.models import Llama, LlamaConfig, lm_loss

GIB = 1 << 30
SEQUENCES = 8
"""Sequences per optimizer step (the global batch)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    ap.add_argument("--cluster", default="p5.48xlarge@2025")
    args = ap.parse_args()
    cluster = mc.Cluster.preset(args.cluster, nodes=1)
    n = cluster.world_size
    print(f"Llama-3-8B-class, {args.layers} layers, on {n} x {cluster.gpu.name} ({args.cluster}), bf16, full "
          f"recomputation, p = {n}, {SEQUENCES} sequences per step; Ulysses context parallelism")
    print(f"{'seq':>7}{'cp':>4}{'step s':>9}{'tokens/s/GPU':>14}{'peak GiB':>10}{'fits':>6}{'exposed s':>11}{'sim s':>7}")
    for seq in args.seqs:
        cfg = LlamaConfig(vocab_size=128256, seq_len=seq, layers=args.layers, hidden=4096, heads=32, kv_heads=8,
                          ffn=14336)
        with torch.device("meta"):
            model = Llama(cfg)
        for c in (1, 2, 4, 8):
            t0 = time.perf_counter()
            x = torch.zeros(1, seq // c, dtype=torch.long)  # one context rank's tokens of a sample
            trace = mc.trace(model, (x, x), lm_loss, device="cuda", param_dtype=torch.bfloat16)
            plan = mc.Plan(partition_size=n, context_parallel_size=c, micro_batches=SEQUENCES * c // n,
                           checkpoint=True, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            pred = mc.simulate(trace, plan, cluster)
            tokens = SEQUENCES * seq / (n * pred.step_time_s)
            print(f"{seq:>7}{c:>4}{pred.step_time_s:>9.2f}{tokens:>14,.0f}{pred.peak_memory_bytes / GIB:>10.1f}"
                  f"{'yes' if pred.fits(cluster) else 'no':>6}{pred.exposed_comm_s:>11.3f}"
                  f"{time.perf_counter() - t0:>7.1f}")
    c = 8
    print(f"\nper attention layer and micro-batch at cp = {c}: bytes one rank sends (forward / backward), their time, "
          "and what the attention waits for")
    print(f"{'seq':>7}  {'exchange':<11}{'fwd MiB':>9}{'bwd MiB':>9}{'fwd ms':>8}{'bwd ms':>8}{'exposed ms':>11}"
          f"{'attention fwd ms':>17}")
    for seq in args.seqs:
        shape = AttentionShape(batch=1, sequence=seq, heads=32, kv_heads=8, head_dim=128)
        for kind in EXCHANGES:
            f, b = exchange_bytes(kind, shape, c)
            t = exchange_time_s(kind, shape, tuple(range(c)), cluster)
            print(f"{seq:>7}  {kind:<11}{f / 2 ** 20:>9.0f}{b / 2 ** 20:>9.0f}{t.forward_s * 1e3:>8.2f}"
                  f"{t.backward_s * 1e3:>8.2f}{(t.exposed_forward_s + t.exposed_backward_s) * 1e3:>11.2f}"
                  f"{t.attention_forward_s * 1e3:>17.1f}")


if __name__ == "__main__":
    main()
