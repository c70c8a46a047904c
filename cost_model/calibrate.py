"""Calibrate a ``local`` Cluster on the machine at hand, inside a process group.

Every rank measures at the same time (barrier-aligned), because that is how
training runs: on a shared machine, concurrent ranks split its cores and memory
bandwidth. Measured: matmul throughput, memory bandwidth, per-op overhead, alpha
and beta of all-gather / reduce-scatter / all-reduce for every group size that
divides the world (consecutive-rank groups, all running at once), and the
communication/compute overlap. Times are medians over repeats, maxed over ranks.

Run it as ``python -m micscompile calibrate --nproc 4`` (writes local_cluster.json).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from micscompile.cost_model.collective_time import fit_key
from micscompile.cost_model.specs import Cluster, GpuSpec, Link

COLLECTIVE_SIZES_BYTES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)
MATMUL_SHAPES = ((512, 256, 768), (512, 1024, 256), (512, 256, 256), (2048, 256, 256))


MIN_WINDOW_S = 0.1
"""Each timed sample runs at least this long: short windows on an oversubscribed machine
measure a rank running alone, not its fair share of the cores."""


def _timed(fn: Callable[[], object], repeats: int, group=None) -> float:
    """Seconds per call of ``fn``: median over ``repeats`` windows of >= MIN_WINDOW_S each,
    all ranks aligned and agreeing on the inner count; the slowest rank's median."""
    t0 = time.perf_counter()
    fn()
    inner = torch.tensor([max(1, int(MIN_WINDOW_S / max(time.perf_counter() - t0, 1e-6)))])
    dist.all_reduce(inner, op=dist.ReduceOp.MAX)  # same count everywhere: collectives must match
    inner = int(inner)
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _fit(sizes: list[float], times: list[float]) -> dict[str, float]:
    """Least-squares T = alpha + beta * N, clipped to non-negative."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sum((x - mx) ** 2 for x in sizes)
    beta = max(beta, 1e-15)
    alpha = max(my - beta * mx, 0.0)
    return {"alpha_s": alpha, "beta_s_per_byte": beta}


def _groups(world: int, rank: int) -> dict[int, object]:
    """One consecutive-rank group per size g | world, g >= 2 (every rank creates all of them)."""
    out = {}
    for g in range(2, world + 1):
        if world % g:
            continue
        for first in range(0, world, g):
            ranks = list(range(first, first + g))
            pg = dist.new_group(ranks) if g < world else dist.group.WORLD
            if rank in ranks:
                out[g] = pg
    return out


def _collective(kind: str, nbytes: int, g: int, group, device: torch.device) -> Callable[[], object]:
    """One blocking collective over a full buffer of ``nbytes`` in ``group`` (of size ``g``)."""
    full = torch.zeros(nbytes // 4, device=device)
    part = torch.zeros(nbytes // 4 // g, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    return lambda: dist.all_reduce(full, group=group)


def _program_pattern(
    nbytes: int, g: int, chunks: int, a: torch.Tensor, b: torch.Tensor, group,
) -> Callable[[], None]:
    """``chunks`` times: issue an all-gather of ``nbytes`` in ``group``, compute two matmuls, wait
    (what a Program does)."""
    out = torch.zeros(nbytes // 4, device=a.device)
    inp = torch.zeros(out.numel() // g, device=a.device)

    def pattern() -> None:
        for _ in range(chunks):
            work = dist.all_gather_single(out, inp, group=group, async_op=True)
            torch.mm(a, b)
            torch.mm(a, b)
            work.wait()

    return pattern


def calibrate(repeats: int = 5, log: Callable[[str], None] | None = None) -> Cluster:
    """Measure this machine; every rank must call it. Returns the same Cluster on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    say = log or (lambda s: None)

    # compute: matmul throughput, memory bandwidth, per-op overhead
    rates = []
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        rates.append(2 * m * k * n / _timed(lambda a=a, b=b: torch.mm(a, b), repeats))
    matmul_flops = statistics.median(rates)
    x, y, z = (torch.randn(1 << 22, device=device) for _ in range(3))
    bandwidth = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, y, out=z), repeats)
    tiny = torch.ones(8, device=device)
    op_overhead = _timed(lambda: tiny.add(tiny), repeats)
    say(f"matmul {matmul_flops / 1e9:.1f} GFLOP/s, memory {bandwidth / 1e9:.2f} GB/s, op {op_overhead * 1e6:.1f} us (per rank)")

    # optimizer step (AdamW), laid out as TrainStep lays it out: 48 parameters and their gradients
    # as views of one flat shard each (~4x faster than separate tensors on this CPU), 4M elements.
    # One per-element cost: with realistic sizes the per-tensor term is below the noise.
    elements, tensors = 1 << 22, 48
    flat, grad = torch.randn(elements, device=device), torch.randn(elements, device=device)
    size = elements // tensors
    params = []
    for i in range(tensors):
        p = torch.nn.Parameter(flat[i * size : (i + 1) * size])
        p.grad = grad[i * size : (i + 1) * size]
        params.append(p)
    adamw = torch.optim.AdamW(params, lr=1e-3)
    per_element = _timed(adamw.step, repeats) / (size * tensors)
    del adamw, params, flat, grad
    say(f"AdamW step {per_element * 1e9:.2f} ns per element")

    # collectives: alpha/beta per kind and group size
    fits: dict[str, dict[str, float]] = {}
    groups = _groups(world, rank)
    for g, pg in groups.items():
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            times = []
            for nbytes in COLLECTIVE_SIZES_BYTES:
                times.append(_timed(_collective(kind, nbytes, g, pg, device), repeats))
            fits[fit_key(kind, g)] = _fit([float(s) for s in COLLECTIVE_SIZES_BYTES], times)
            say(f"{kind:>14} g={g}: alpha {fits[fit_key(kind, g)]['alpha_s'] * 1e6:.0f} us, "
                f"{1 / fits[fit_key(kind, g)]['beta_s_per_byte'] / 1e9:.2f} GB/s")

    # What a collective costs the compute stream in the Program's pattern (issue, compute, wait),
    # per group size (two 2-rank groups load the cores less than one 4-rank group) at three sizes,
    # fitted against the message size (which spans 64x; durations of small messages are all
    # latency, so fitting against them is ill-conditioned).
    a, b = torch.randn(512, 512, device=device), torch.randn(512, 512, device=device)
    chunks, pattern_repeats = 32, max(repeats, 7)  # small signals on a shared machine: more samples
    alone = _timed(lambda: [torch.mm(a, b) for _ in range(2 * chunks)], pattern_repeats)
    sizes = [64 << 10, 1 << 20, 4 << 20]
    compute_fits: dict[str, dict[str, float]] = {}
    overlap = overhead = 0.0  # informational (the simulator uses compute_fits): from the world group
    for g, pg in groups.items():
        durations, charges = [], []
        for nbytes in sizes:
            durations.append(_timed(_collective("all_gather", nbytes, g, pg, device), repeats))
            pattern = _program_pattern(nbytes, g, chunks, a, b, pg)
            charges.append(max(_timed(pattern, pattern_repeats) - alone, 0.0) / chunks)
        compute_fits[str(g)] = _fit([float(n) for n in sizes], charges)
        if g == world:  # the overlap these figures imply at the largest size, for reading
            overlap = min(max(1 - charges[-1] / durations[-1], 0.0), 1.0) if durations[-1] else 1.0
            overhead = compute_fits[str(g)]["alpha_s"]
        say(f"collective cost to compute, g={g}: " + ", ".join(
            f"{n >> 10} KiB gather ({d * 1e3:.1f} ms) -> {c * 1e3:.1f} ms" for n, d, c in zip(sizes, durations, charges))
            + f"; fit {compute_fits[str(g)]['alpha_s'] * 1e6:.0f} us + "
            f"{compute_fits[str(g)]['beta_s_per_byte'] * 1e9:.2f} ns/B")

    g = world
    world_fit = fits.get(fit_key("all_gather", g), {"alpha_s": 0.0, "beta_s_per_byte": 1e-9})
    link = Link(bandwidth_bps=(g - 1) / g / world_fit["beta_s_per_byte"], latency_s=world_fit["alpha_s"] / max(g - 1, 1))
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpu = GpuSpec(
        name=f"{device.type} rank (1/{world} of this machine)", peak_flops={"float32": matmul_flops},
        memory_bandwidth_bps=bandwidth, memory_bytes=int(mem_total // world), matmul_efficiency=1.0,
        memory_efficiency=1.0, op_overhead_s=op_overhead, optimizer_param_s=0.0,
        optimizer_element_s=per_element,
    )
    return Cluster(name="local", nodes=1, gpus_per_node=world, gpu=gpu, intra=link, inter=link,
                   overlap=overlap, collective_overhead_s=overhead, collective_compute_fits=compute_fits,
                   collective_fits=fits)
