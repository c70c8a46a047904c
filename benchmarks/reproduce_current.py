"""Today's software, simulated: the current presets' fits and the public rows they are judged on.

    .venv/bin/python benchmarks/reproduce_current.py          # every held-out row (about 4 minutes here)
    .venv/bin/python benchmarks/reproduce_current.py --fit    # fit the links, then each GPU's compute

The presets named ``<machine>@<year>`` (micscompile/cost_model/specs.py, ``ERA_2023``) stand for 2023-25 software
(NCCL 2.18-2.27, PyTorch 2.x with flash attention, FSDP), where the presets without a year stand for the MiCS
thesis's 2021-22 stack. They are fitted by the thesis presets' protocol (``reproduce_thesis.py``): the
links on collective measurements only, each GPU's matmul efficiency on one end-to-end row with the links fixed,
every other row held out and no constant moved to make one pass.

Evidence (docs/cost-model.md "Which software a preset stands for"):
* links: nccl-tests on today's NCCL (the constants' docstrings in specs.py name each run);
* compute: llm-foundry's MPT training benchmarks (mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``,
  2023): MPT-7B at seq 2048 on one 8-GPU node without checkpointing, one row per GPU type, is the fit; the table's
  other rows are held out. Its A100 tables ran on "1600 Gbps node-node interconnect (RoCE)", DGX A100's 8 x 200
  Gb/s, so they are judged on ``dgx-a100@2023`` (the A100-40GB table with the 40 GB GPU); its H100 table names no
  interconnect, so only its one-node rows are judged, on ``p5.48xlarge@2025`` (one node: NVLink alone).

What a row assumes: MPT's shapes in the zoo's GPT (vocabulary 50368, MLP 4x; the zoo's biases and learned
positions add under 1% to MPT's parameters), FSDP's FULL_SHARD over every GPU priced as the FSDP2 peer (one unit
per block, prefetched one ahead: ``system="fsdp2"``, docs/peer-models.md), composer's mixed precision as its row
says (DEFAULT: bf16 gathers, fp32 reductions; PURE: both bf16), every block checkpointed where the row says so.
The figure is llm-foundry's MFU, its own formula: (6 N + 12 l h s) per token over the GPU's bf16 peak, N the
parameters, recomputation not counted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass

import torch

import micscompile as mc
from micscompile.cost_model.collective_time import ALL_GATHER, ALL_REDUCE, collective_time_s, tree_latency_s
from micscompile.cost_model.specs import A100_40GB_2023, GBPS_TO_BPS, Link
from micscompile.zoo.models import GPTConfig, meta_gpt

GIB = 2**30
MIB = 2**20

# ---- the links ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkEvidence:
    """One preset's collective measurements: the 8-byte all-reduce over 2 nodes that sets the LL network step,
    and the large-message figures that set the NICs' rate (and, where there is a node sweep, the Simple step);
    ``checks`` are measured figures left out of the fit."""

    preset: str
    small_us: float
    """An 8-byte all-reduce over 2 nodes (16 GPUs), microseconds."""
    large: tuple[tuple[str, int, float], ...]
    """(what, nodes, GB/s): "ar_busbw" a ring all-reduce's bus bandwidth at 1 GiB, "tree_algbw" the algorithm
    bandwidth of a 2-node all-reduce at 1 GiB, which NCCL runs as a tree (below), "ag_busbw" an all-gather's bus
    bandwidth at 1 GiB."""
    line_gbps: float
    """One NIC's line rate."""
    checks: tuple[tuple[str, int, int, float], ...] = ()
    """(what, nodes, bytes, microseconds): "ar_us" an all-reduce's time."""


LINKS = (
    LinkEvidence("dgx-a100@2023", 93.0, (("ar_busbw", 2, 192.0),), 200),
    LinkEvidence("p4de.24xlarge@2024", 164.0, (("tree_algbw", 2, 41.0),), 100),
    LinkEvidence("p5.48xlarge@2025", 70.0,
                 tuple(("ag_busbw", n, bw) for n, bw in ((2, 322), (4, 289), (8, 224), (16, 262), (32, 222))), 100,
                 checks=(("ar_us", 2, MIB, 123.0),)),
)
"""dgx-a100: NVIDIA/nccl#812 (192 GB/s all-reduce bus bandwidth on 8 x 200 Gb/s; 93 us for 8 bytes on 2 nodes).
p4de: aws-samples/awsome-distributed-training, 2024-04, NCCL 2.20.3 on 2 nodes: NCCL all-reduces with a tree
there, whose algorithm bandwidth is the NICs' rate (bus bandwidth above line rate), where the collective model's tree
charges 2 N over them (docs/cost-model.md: its trees are priced for the thesis's rings). p5: the all-gather sweep of
crazyguitar/aws-gpu-communication-benchmark (NCCL 2.27.7), 2 x p5's all-reduce with NCCL 2.20.3 (65-75 us for 8
bytes, the middle taken; 123 us for 1 MiB, a check) from awsome-distributed-training (commit 88c2e71b)."""


def with_links(cluster: mc.Cluster, nic_efficiency: float, simple_s: float, ll_s: float,
               line_gbps: float) -> mc.Cluster:
    return dataclasses.replace(cluster, inter=Link(bandwidth_bps=line_gbps * GBPS_TO_BPS * nic_efficiency,
                                                   latency_s=simple_s, ll_latency_s=ll_s))


def figure(cluster: mc.Cluster, what: str, nodes: int, nbytes: int = GIB) -> float:
    """A collective figure of ``cluster`` over ``nodes`` nodes: GB/s, or microseconds for "ar_us"."""
    c = cluster.with_nodes(nodes)
    g = c.world_size
    ranks = tuple(range(g))
    if what == "ar_busbw":
        return 2 * (g - 1) / g * nbytes / collective_time_s(ALL_REDUCE, nbytes, ranks, c, algorithm="ring") / 1e9
    if what == "tree_algbw":  # each byte crosses a node's NICs once each way, up and down the tree at once
        return nbytes / (tree_latency_s(g, nodes, c) + nbytes / c.node_bandwidth_bps) / 1e9
    if what == "ag_busbw":
        return (g - 1) / g * nbytes / collective_time_s(ALL_GATHER, nbytes, ranks, c) / 1e9
    if what == "ar_us":
        return collective_time_s(ALL_REDUCE, nbytes, ranks, c) * 1e6
    raise ValueError(what)


def _bisect(f, target: float, lo: float, hi: float, tol: float = 0.0) -> float:
    """The x in [lo, hi] where the increasing f(x) meets target: to ``tol``, or 60 halvings."""
    for _ in range(60):
        if hi - lo <= tol:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def fit_links(ev: LinkEvidence) -> tuple[float, float, float]:
    """(NIC efficiency, Simple network step, LL network step) of one preset. The LL step is set by the 8-byte
    all-reduce; with one large figure the Simple step is taken equal to it (the least NCCL allows: Simple's
    latency is never below LL's) and the NICs' rate meets the figure; with a node sweep, a grid over the rate
    and the Simple step (at or above the LL step) minimizes the squared log errors."""
    base = mc.Cluster.preset(ev.preset)
    ll = _bisect(lambda a: figure(with_links(base, 0.8, a, a, ev.line_gbps), "ar_us", 2, 8), ev.small_us, 1e-7, 2e-3)
    if len(ev.large) == 1:
        (what, nodes, measured), = ev.large
        eta = _bisect(lambda e: figure(with_links(base, e, ll, ll, ev.line_gbps), what, nodes), measured, 0.05, 2.0)
        return eta, ll, ll

    def loss(eta, simple):
        c = with_links(base, eta, simple, ll, ev.line_gbps)
        return sum(math.log(figure(c, what, n) / m) ** 2 for what, n, m in ev.large)

    grid = [(eta / 100, ll + d * 1e-6) for eta in range(50, 121) for d in range(0, 200, 2)]
    return min(grid, key=lambda k: loss(*k)) + (ll,)


def print_link_fits() -> None:
    print("links (the preset's constants in specs.py against this fit):")
    for ev in LINKS:
        eta, simple, ll = fit_links(ev)
        preset = mc.Cluster.preset(ev.preset)
        have = preset.inter
        print(f"  {ev.preset}: NIC efficiency {eta:.3f} (preset {have.bandwidth_bps / (ev.line_gbps * GBPS_TO_BPS):.3f}), "
              f"Simple step {simple * 1e6:.1f} us (preset {have.latency_s * 1e6:.1f}), LL step {ll * 1e6:.1f} us "
              f"(preset {have.ll_latency_s * 1e6:.1f})")
        for what, nodes, measured in ev.large:
            sim = figure(preset, what, nodes)
            print(f"    {what} {nodes} nodes: measured {measured:.1f} GB/s, preset {sim:.1f} ({sim / measured - 1:+.0%})")
        sim = figure(preset, "ar_us", 2, 8)
        print(f"    ar 8 B 2 nodes: measured {ev.small_us:.0f} us, preset {sim:.0f} ({sim / ev.small_us - 1:+.0%})")
        for what, nodes, nbytes, measured in ev.checks:
            sim = figure(preset, what, nodes, nbytes)
            print(f"    check, not fitted: {what} {nbytes} B {nodes} nodes: measured {measured:.0f} us, preset "
                  f"{sim:.0f} ({sim / measured - 1:+.0%})")


# ---- the compute rows -----------------------------------------------------------------------------------

MPT = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
       "30b": (48, 7168, 64), "70b": (80, 8192, 64)}
"""MPT's (layers, d_model, heads) per size (llm-foundry ``scripts/train/yamls/pretrain/mpt-*.yaml``)."""
MPT_VOCAB = 50368


@dataclass(frozen=True)
class MptRow:
    """One row of llm-foundry's table: the setup and the MFU (%) it measured."""

    gpu: str
    """"a100_80gb", "a100_40gb" or "h100_80gb"."""
    size: str
    seq: int
    gpus: int
    micro_batch: int
    grad_accum: int
    checkpoint: bool
    mfu: float
    pure: bool = False
    """composer's PURE mixed precision (bf16 reductions) rather than DEFAULT (fp32)."""
    fit: bool = False

    @property
    def preset(self) -> str:
        return "p5.48xlarge@2025" if self.gpu == "h100_80gb" else "dgx-a100@2023"

    @property
    def older_preset(self) -> str:
        """The same GPU's preset of the thesis's era (H100's: spec sheets alone)."""
        return "dgx-h100" if self.gpu == "h100_80gb" else "dgx-a100"

    @property
    def name(self) -> str:
        return (f"MPT-{self.size} seq {self.seq} on {self.gpus} {self.gpu}, b {self.micro_batch} x {self.grad_accum}"
                f"{', checkpointed' if self.checkpoint else ''}")


TABLE = """
gpu        size seq   gpus b  accum ckpt mfu   mp
# A100 80GB, 1600 Gbps RoCE (the first row is the fit)
a100_80gb  7b   2048  8    6  2     no   64.23 default fit
a100_80gb  1b   2048  8    14 4     no   59.86 default
a100_80gb  3b   2048  8    10 2     no   62.11 default
a100_80gb  13b  2048  8    2  3     no   59.57 default
a100_80gb  30b  2048  8    3  21    yes  55.3  default
a100_80gb  7b   8192  8    8  2     yes  54.47 default
a100_80gb  70b  2048  32   2  16    yes  48.56 pure
a100_80gb  70b  2048  64   8  4     yes  53.33 pure
# A100 40GB, 1600 Gbps RoCE: the node sweeps
a100_40gb  7b   2048  16   16 1     yes  50.44 pure
a100_40gb  7b   2048  32   18 1     yes  51.55 pure
a100_40gb  7b   2048  64   18 1     yes  50.73 pure
a100_40gb  7b   2048  128  18 1     yes  50.14 pure
a100_40gb  13b  2048  16   10 1     yes  52.5  pure
a100_40gb  13b  2048  128  16 1     yes  51.93 pure
a100_40gb  30b  2048  32   4  1     yes  51.74 pure
a100_40gb  30b  2048  128  6  1     yes  52.25 pure
a100_40gb  70b  2048  64   2  1     yes  35.87 pure
a100_40gb  70b  2048  128  4  1     yes  48.91 pure
# H100 80GB, one node (the first row is the fit)
h100_80gb  7b   2048  8    6  1     no   46.44 default fit
h100_80gb  1b   2048  8    14 1     no   41.82 default
h100_80gb  13b  2048  8    2  1     no   39.79 default
h100_80gb  3b   4096  8    5  6     no   42.31 default
h100_80gb  30b  2048  8    3  21    yes  38.11 default
"""
"""The rows of llm-foundry's table used here, as it prints them (b: micro-batch size, accum: gradient accumulation,
ckpt: activation checkpointing, mp: composer's mixed precision)."""


def _rows(table: str) -> tuple[MptRow, ...]:
    out = []
    for line in table.strip().splitlines()[1:]:
        if line.startswith("#"):
            continue
        gpu, size, seq, gpus, b, accum, ckpt, mfu, mp, *fit = line.split()
        out.append(MptRow(gpu, size, int(seq), int(gpus), int(b), int(accum), ckpt == "yes", float(mfu),
                          pure=mp == "pure", fit=fit == ["fit"]))
    return tuple(out)


ROWS = _rows(TABLE)


def mpt_config(size: str, seq: int) -> GPTConfig:
    layers, hidden, heads = MPT[size]
    return GPTConfig(vocab_size=MPT_VOCAB, seq_len=seq, layers=layers, hidden=hidden, heads=heads)


@functools.lru_cache(maxsize=None)
def _trace(cfg: GPTConfig, micro_batch: int) -> tuple[mc.TrainGraph, int]:
    model, inputs, loss = meta_gpt(cfg, micro_batch)
    return mc.trace(model, inputs, loss, param_dtype=torch.bfloat16), sum(p.numel() for p in model.parameters())


def simulated_mfu(row: MptRow, matmul_efficiency: float | None = None, preset: str | None = None) -> float:
    """llm-foundry's MFU (%) of the row's setup as the current preset prices it (``matmul_efficiency``: the GPU's
    in place of the preset's, for the fit; ``preset``: another preset's, the 40 GB GPU taking its compute)."""
    cluster = mc.Cluster.preset(preset or row.preset, nodes=row.gpus // 8)
    gpu = dataclasses.replace(A100_40GB_2023, matmul_efficiency=cluster.gpu.matmul_efficiency) \
        if row.gpu == "a100_40gb" else cluster.gpu
    if matmul_efficiency is not None:
        gpu = dataclasses.replace(gpu, matmul_efficiency=matmul_efficiency)
    cluster = dataclasses.replace(cluster, gpu=gpu)
    cfg = mpt_config(row.size, row.seq)
    graph, params = _trace(cfg, row.micro_batch)
    plan = mc.Plan(partition_size=row.gpus, micro_batches=row.grad_accum, checkpoint=row.checkpoint,
                   param_dtype=torch.bfloat16,
                   reduce_dtype=torch.bfloat16 if row.pure else torch.float32)
    step = mc.simulate(graph, plan, cluster, system="fsdp2", scaling=False).step_time_s
    flops_per_seq = mc.model_flops_per_token(params, cfg.layers, cfg.hidden, row.seq) * row.seq
    return 100 * row.micro_batch * row.grad_accum * flops_per_seq / step / gpu.flops("bfloat16")


def fit_compute() -> None:
    """Each GPU's matmul efficiency on its one fit row, the links fixed: bisection to 0.001."""
    print("compute (matmul efficiency of 16-bit peak):")
    for row in (r for r in ROWS if r.fit):
        fitted = _bisect(lambda e, row=row: simulated_mfu(row, e), row.mfu, 0.2, 0.95, tol=0.001)
        have = mc.Cluster.preset(row.preset).gpu.matmul_efficiency
        print(f"  {row.gpu}: {fitted:.3f} gives {row.name} {simulated_mfu(row, fitted):.2f}% MFU (published "
              f"{row.mfu}); the preset ({row.preset}) has {have:.3f}: {simulated_mfu(row):.2f}%", flush=True)


def _simulate(indices: list[int]) -> list[tuple[float, float]]:
    """(on the current preset, on the thesis-era one) per row."""
    return [(simulated_mfu(ROWS[i]), simulated_mfu(ROWS[i], preset=ROWS[i].older_preset)) for i in indices]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="only: fit the links, then each GPU's compute")
    args = ap.parse_args()
    if args.fit:
        print_link_fits()
        return fit_compute()
    t0 = time.perf_counter()
    # two processes, the rows split by model size (they share traces within a size)
    order = sorted(range(len(ROWS)), key=lambda i: (ROWS[i].size, ROWS[i].seq, ROWS[i].micro_batch))
    shares = [order[0::2], order[1::2]]
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(_simulate, s) for s in shares]
        results = dict(zip(shares[0] + shares[1], [x for f in futures for x in f.result()]))
    print("| row | preset | role | published MFU | simulated | error | on the 2021-22 preset |\n"
          "|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {}
    for i, row in enumerate(ROWS):
        sim, older = results[i]
        e = sim / row.mfu - 1
        if not row.fit:
            errors.setdefault(row.preset, []).append(abs(e))
        print(f"| {row.name} | {row.preset} | {'fit' if row.fit else 'held out'} | {row.mfu:.1f}% | {sim:.1f}% | "
              f"{e:+.0%} | {row.older_preset} {older:.1f}% ({older / row.mfu - 1:+.0%}) |", flush=True)
    held = [e for v in errors.values() for e in v]
    print(f"\nheld-out rows within 20%: {sum(e <= 0.2 for e in held)} of {len(held)}; "
          f"{time.perf_counter() - t0:.0f} s")
    for preset, errs in errors.items():
        print(f"median |error| of the held-out {preset} rows ({len(errs)}): {statistics.median(errs):.0%} "
              f"({preset}'s prediction_error: {mc.Cluster.preset(preset).prediction_error:.0%})")


if __name__ == "__main__":
    main()
