"""Calibrate a ``local`` Cluster on the machine at hand, inside a process group.

Every rank measures at the same time (barrier-aligned), because that is how
training runs: on a shared machine, concurrent ranks split its cores and memory
bandwidth. Measured: matmul throughput, memory bandwidth, per-op overhead, alpha
and beta of all-gather / reduce-scatter / all-reduce for every group size that
divides the world (consecutive-rank groups, all running at once), and what a
collective in flight costs compute. Times are medians over repeats of the slowest
rank's time. On CUDA every timed window ends with a device sync (the host returns
once kernels are launched), matmul peaks are measured per dtype (fp32, bf16, fp16),
and the memory is the GPU's; the topology is torchrun's (LOCAL_WORLD_SIZE per node).

Run it as ``python -m micscompile calibrate --nproc 4`` (writes local_cluster.json).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from micscompile.core.errors import UsageError
from micscompile.core.launch import collective_device, local_world_size, step_device
from micscompile.core.optim import prefer_fused
from micscompile.cost_model.collective_time import fit_key
from micscompile.cost_model.specs import Cluster, GpuSpec, Link

COLLECTIVE_SIZES_BYTES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
MATMUL_SHAPES = ((512, 256, 768), (512, 1024, 256), (512, 256, 256), (2048, 256, 256))
"""(m, k, n) of the matmuls timed on a CPU rank: a bench-sized model's."""
GPU_MATMUL_SHAPES = ((8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096), (4096, 4096, 4096))
"""On a GPU: a transformer's at hidden 4096 over 8192 tokens. The CPU's shapes run in microseconds
there and time the launches: 13.9 TFLOP/s bf16 on an H100 (docs/gpu.md)."""
BANDWIDTH_ELEMENTS = 1 << 22
"""fp32 elements per operand of the ``add`` timed on a CPU rank."""
GPU_BANDWIDTH_ELEMENTS = 1 << 26
"""On a GPU: 3 x 256 MiB, past its L2 cache (the CPU's 3 x 16 MiB sit in an H100's 50 MB L2)."""
ARRIVAL_STRETCH_OPS = ((4, 40), (16, 30), (64, 16), (256, 8), (1024, 6))
"""(small ops in a stretch of compute, repeats): the stretches, ~0.3-80 ms on a CPU rank (from a
layer's backward to a small model's whole step: the compute a step runs between two collectives of a
group), after which calibration times how long a rank waits for its group's last one (``_arrival_waits``)."""
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Measured peaks, keyed like ``GpuSpec.peak_flops``: a bf16 plan is priced at the bf16 peak."""


MIN_WINDOW_S = 0.1
"""Each timed sample runs at least this long: short windows on an oversubscribed machine
measure a rank running alone, not its fair share of the cores."""


def device_sync(device: torch.device | str | None = None) -> None:
    """Wait until ``device`` has run what was queued on it (None: the current GPU, if this process
    uses CUDA); nothing on the CPU. Every timed window starts and ends with it: on CUDA the host
    returns as soon as kernels are launched. For measurements only, never inside a training step."""
    if device is None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _over_ranks(times: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    """Per aligned sample, ``times`` reduced over the ranks with ``op`` (every rank must call it with as
    many samples); the samples themselves outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(times)
    t = torch.tensor(times, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def slowest_rank_times(times: list[float]) -> list[float]:
    """Per aligned sample, the slowest rank's time (every rank must call it with as many samples)."""
    return _over_ranks(times, dist.ReduceOp.MAX)


def slowest_rank_median(times: list[float]) -> float:
    """The median over aligned samples of the slowest rank's time in each: a step waits for its
    slowest rank, and which rank is slowest changes from step to step, so the median of
    per-sample maxima exceeds the slowest median."""
    return statistics.median(slowest_rank_times(times))


def mean_rank_median(times: list[float]) -> float:
    """The median over aligned samples of the ranks' mean time in each (every rank must call it with as
    many samples): what a typical rank takes; what it then waits for the slowest one at a collective
    is the calibrated arrival wait (``_arrival_waits``)."""
    totals = _over_ranks(times, dist.ReduceOp.SUM)
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return statistics.median(total / ranks for total in totals)


def _inner_count(fn: Callable[[], object], device: torch.device) -> int:
    """Calls of ``fn`` per window of >= MIN_WINDOW_S, the same on every rank (collectives must match)."""
    device_sync(device)
    t0 = time.perf_counter()
    fn()
    device_sync(device)
    inner = torch.tensor([max(1, int(MIN_WINDOW_S / max(time.perf_counter() - t0, 1e-6)))],
                         device=collective_device())
    dist.all_reduce(inner, op=dist.ReduceOp.MAX)
    return int(inner)


def _window(fn: Callable[[], object], inner: int, device: torch.device) -> float:
    """Seconds per call over ``inner`` calls on ``device``, all ranks starting together."""
    device_sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    device_sync(device)
    return (time.perf_counter() - t0) / inner


def _timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` on ``device``: median over ``repeats`` windows of >= MIN_WINDOW_S
    each of the slowest rank's time."""
    inner = _inner_count(fn, device)
    return slowest_rank_median([_window(fn, inner, device) for _ in range(repeats)])


def _timed_extra(fn: Callable[[], object], base: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call that ``fn`` takes beyond ``base``, from alternating windows: a shared
    machine drifts by more than the difference between two windows timed apart."""
    inner_fn, inner_base = _inner_count(fn, device), _inner_count(base, device)
    return slowest_rank_median([_window(fn, inner_fn, device) - _window(base, inner_base, device)
                                for _ in range(repeats)])


REPLAYED_OPS = 256
"""Kernels in the chain ``_replayed_op_s`` captures."""


def _replayed_op_s(tiny: torch.Tensor, repeats: int, device: torch.device) -> float:
    """Seconds per kernel of a chain of ``REPLAYED_OPS`` bare adds (8 elements) captured in one CUDA graph and
    replayed: what an op costs a captured step (``GpuSpec.graph_op_overhead_s``; the host queues one replay, the
    device launches each kernel after the last and runs it). Captured as ``runtime.cuda_graph`` captures a step:
    warmed up on a side stream first; replayed once before the timing (the first replay uploads the graph)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            tiny.add(tiny)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tiny
        for _ in range(REPLAYED_OPS):
            out = out.add(tiny)
    graph.replay()
    device_sync(device)
    return _timed(graph.replay, repeats, device) / REPLAYED_OPS


def matmul_shapes(device: torch.device) -> tuple[tuple[int, int, int], ...]:
    """The matmuls timed on ``device``: GPU_MATMUL_SHAPES on CUDA, else MATMUL_SHAPES."""
    return GPU_MATMUL_SHAPES if device.type == "cuda" else MATMUL_SHAPES


def bandwidth_elements(device: torch.device) -> int:
    """The operands' length of the ``add`` timed on ``device``: GPU_BANDWIDTH_ELEMENTS on CUDA, else
    BANDWIDTH_ELEMENTS."""
    return GPU_BANDWIDTH_ELEMENTS if device.type == "cuda" else BANDWIDTH_ELEMENTS


def _matmul_peaks(device: torch.device, repeats: int) -> dict[str, float]:
    """Per dtype of MATMUL_DTYPES (by name), the median matmul FLOP/s over ``matmul_shapes(device)``."""
    peaks = {}
    for dtype in MATMUL_DTYPES:
        rates = []
        for m, k, n in matmul_shapes(device):
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            rates.append(2 * m * k * n / _timed(lambda a=a, b=b: torch.mm(a, b), repeats, device))
        peaks[str(dtype).removeprefix("torch.")] = statistics.median(rates)
    return peaks


def _topology(world: int) -> tuple[int, int]:
    """(nodes, ranks per node): torchrun's LOCAL_WORLD_SIZE ranks per node (one node without it)."""
    per_node = local_world_size() or world
    if per_node < 1 or world % per_node:
        raise UsageError(f"LOCAL_WORLD_SIZE={per_node} does not divide the {world} ranks: "
                           "every node must run as many ranks")
    return world // per_node, per_node


def _memory_bytes(device: torch.device, per_node: int) -> int:
    """One rank's memory: its GPU's on CUDA, else its share of this node's host memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(host // per_node)


def _links(fits: dict[str, dict[str, float]], world: int, per_node: int) -> tuple[Link, Link]:
    """(intra, inter): from the all-gather fits over one node's consecutive ranks and over the
    world, inverting ``collective_time.ring_latency_s`` (the world's ring: m - 1 network steps, the
    rest intra-node ones); the one without a fit of its own (one rank per node, or one node) takes
    the other's."""

    def link(g: int, nodes: int, intra_latency_s: float = 0.0) -> Link | None:
        fit = fits.get(fit_key("all_gather", g))
        if g < 2 or fit is None:
            return None
        if nodes > 1:  # what the g - nodes intra-node steps leave to the nodes - 1 network ones
            latency = max(0.0, fit["alpha_s"] - (g - nodes) * intra_latency_s) / (nodes - 1)
        else:
            latency = fit["alpha_s"] / (g - 1)
        return Link(bandwidth_bps=(g - 1) / g / fit["beta_s_per_byte"], latency_s=latency)

    intra = link(per_node, 1)
    inter = link(world, world // per_node, intra.latency_s if intra else 0.0) if world > per_node else None
    fallback = Link(bandwidth_bps=1e9, latency_s=0.0)  # one rank: no collective uses it
    return intra or inter or fallback, inter or intra or fallback


def _fit(sizes: list[float], times: list[float]) -> dict[str, float]:
    """T = alpha + beta * N by least squares on the *relative* error, clipped to non-negative:
    sizes span 1000x, and a plain fit lets the largest message decide the small ones."""
    w = [1 / max(t, 1e-12) ** 2 for t in times]
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, sizes)) / sw, sum(wi * y for wi, y in zip(w, times)) / sw
    beta = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times)) / sum(
        wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
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
    """``chunks`` times: issue an all-gather of ``nbytes`` in ``group``, one matmul, wait
    (what a Program does)."""
    out = torch.zeros(nbytes // 4, device=a.device)
    inp = torch.zeros(out.numel() // g, device=a.device)

    def pattern() -> None:
        for _ in range(chunks):
            work = dist.all_gather_single(out, inp, group=group, async_op=True)
            torch.mm(a, b)
            work.wait()

    return pattern


def _gathers_at_once(nbytes: int, g: int, at_once: int, group, device: torch.device) -> Callable[[], None]:
    """Issue ``at_once`` all-gathers of ``nbytes`` in ``group``, then wait for them all."""
    bufs = [(torch.zeros(nbytes // 4, device=device), torch.zeros(nbytes // 4 // g, device=device))
            for _ in range(at_once)]

    def run() -> None:
        for work in [dist.all_gather_single(full, part, group=group, async_op=True) for full, part in bufs]:
            work.wait()

    return run


def _matmuls(a: torch.Tensor, b: torch.Tensor, chunks: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(chunks):
            torch.mm(a, b)

    return run


def _stretch(ops: int, device: torch.device) -> Callable[[], None]:
    """``ops`` small layers (a 64 x 128 by 128 x 128 matmul, gelu, add): a step's kind of compute,
    many short ops with Python between them."""
    x, w = torch.randn(64, 128, device=device), torch.randn(128, 128, device=device) * 0.05

    def run() -> None:
        y = x
        for _ in range(ops):
            y = torch.nn.functional.gelu(y @ w) + y

    return run


def _arrival_waits(sizes: list[int], per_node: int,
                   device: torch.device) -> dict[int, tuple[dict[str, float], list[tuple[float, float]]]]:
    """Per group size g (consecutive ranks inside one node), how long a rank waits for its group's last
    rank after a stretch of compute all started together (a barrier): its ranks run the same ops, but
    not in the same time (scheduling, caches, the other ranks on the cores). The mean wait over ranks,
    groups and repeats, from every rank's end on the node's one monotonic clock
    (``time.perf_counter``), at each ARRIVAL_STRETCH_OPS length, fitted as wait = k * (c / 1 ms) ** e
    (least squares in log-log; e in [0, 1]): ({"arrival_wait_s": k, "arrival_exponent": e}, the measured
    (stretch, wait) points). A step pays it at every collective that synchronizes a group, for the
    compute since the group's last one (``simulator``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [g for g in sizes if g <= per_node]  # (no clock is shared across nodes)
    if not sizes:
        return {}
    points: dict[int, list[tuple[float, float]]] = {g: [] for g in sizes}
    for ops, repeats in ARRIVAL_STRETCH_OPS:
        run = _stretch(ops, device)
        run()
        spans, waits = [], {g: [] for g in sizes}
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            ends = torch.zeros(world, dtype=torch.float64, device=collective_device())
            ends[rank] = t1
            dist.all_reduce(ends)  # every rank's end
            ends = ends.tolist()
            spans.append(t1 - t0)
            for g in sizes:
                waits[g].append(statistics.mean(max(ends[f:f + g]) - e for f in range(0, world, g) for e in ends[f:f + g]))
        span = slowest_rank_median(spans)
        for g in sizes:
            points[g].append((span, max(statistics.mean(waits[g]), 1e-7)))
    fits = {}
    for g, pts in points.items():
        xs, ys = [math.log(c / 1e-3) for c, _ in pts], [math.log(w) for _, w in pts]
        e = min(max(statistics.linear_regression(xs, ys).slope, 0.0), 1.0)
        fits[g] = ({"arrival_wait_s": math.exp(statistics.mean(ys) - e * statistics.mean(xs)),
                    "arrival_exponent": e}, pts)
    return fits


def calibrate(repeats: int = 7, log: Callable[[str], None] | None = None) -> Cluster:
    """Measure this machine; every rank must call it. Returns the same Cluster on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes, per_node = _topology(world)
    device = step_device()
    say = log or (lambda s: None)

    # compute: matmul throughput per dtype, memory bandwidth, per-op overhead
    peaks = _matmul_peaks(device, repeats)
    x, y, z = (torch.randn(bandwidth_elements(device), device=device) for _ in range(3))
    bandwidth = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, y, out=z), repeats, device)
    tiny = torch.ones(8, device=device)
    op_overhead = _timed(lambda: tiny.add(tiny), repeats, device)
    graph_op = _replayed_op_s(tiny, repeats, device) if device.type == "cuda" else None
    say("matmul " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()) + " GFLOP/s, "
        f"memory {bandwidth / 1e9:.2f} GB/s, op {op_overhead * 1e6:.1f} us"
        + (f", replayed in a CUDA graph {graph_op * 1e6:.1f} us" if graph_op is not None else "") + " (per rank)")

    # optimizer step (AdamW), laid out and run as the training step runs it: 48 parameters and their gradients
    # as views of one flat shard each (~4x faster than separate tensors on this CPU), 4M elements, by
    # the implementation the step runs (core.optim.prefer_fused: torch's fused kernel here, 0.9 against
    # 3.5 ns per element on 4 ranks over 2 cores). One per-element cost: with realistic sizes the
    # per-tensor term is below the noise.
    elements, tensors = 1 << 22, 48
    flat, grad = torch.randn(elements, device=device), torch.randn(elements, device=device)
    size = elements // tensors
    params = []
    for i in range(tensors):
        p = torch.nn.Parameter(flat[i * size : (i + 1) * size])
        p.grad = grad[i * size : (i + 1) * size]
        params.append(p)
    adamw = torch.optim.AdamW(params, lr=1e-3)
    prefer_fused(adamw)
    per_element = _timed(adamw.step, repeats, device) / (size * tensors)
    del adamw, params, flat, grad
    say(f"AdamW step {per_element * 1e9:.2f} ns per element")

    # collectives: alpha/beta per kind and group size
    fits: dict[str, dict[str, float]] = {}
    groups = _groups(world, rank)
    for g, pg in groups.items():
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            times = []
            for nbytes in COLLECTIVE_SIZES_BYTES:
                times.append(_timed(_collective(kind, nbytes, g, pg, device), repeats, device))
            fits[fit_key(kind, g)] = _fit([float(s) for s in COLLECTIVE_SIZES_BYTES], times)
            say(f"{kind:>14} g={g}: alpha {fits[fit_key(kind, g)]['alpha_s'] * 1e6:.0f} us, "
                f"{1 / fits[fit_key(kind, g)]['beta_s_per_byte'] / 1e9:.2f} GB/s")

    # What a collective costs the compute stream in the Program's pattern (issue, compute X, wait),
    # per group size (two 2-rank groups load the cores less than one 4-rank group): measured at two
    # compute lengths, extra = exposed_fraction * duration + slowdown * X (cores shared with the
    # communication threads: on 4 ranks over 2 cores nothing hides, and compute alongside slows);
    # and what a collective issued while another of its group is in flight adds (gloo runs a group's
    # collectives on 2 threads: two at once take ~1.6x one, not 2x).
    chunks, pattern_repeats = 32, max(repeats, 11)  # small signals on a shared machine: more samples
    small, big = ((torch.randn(n, n, device=device), torch.randn(n, n, device=device)) for n in (256, 512))
    x_small, x_big = (_timed(_matmuls(*m, chunks), repeats, device) / chunks for m in (small, big))
    interference: dict[str, dict[str, float]] = {}
    for g, pg in groups.items():
        exposed, slowdown, queued, shown = [], [], [], []
        for nbytes in (64 << 10, 1 << 20, 4 << 20):
            d = _timed(_gathers_at_once(nbytes, g, 1, pg, device), repeats, device)
            queued.append(min(max(_timed(_gathers_at_once(nbytes, g, 2, pg, device), repeats, device) / d - 1, 0.0), 1.0))
            extra_small, extra_big = (
                _timed_extra(_program_pattern(nbytes, g, chunks, *m, pg), _matmuls(*m, chunks), pattern_repeats,
                             device) / chunks
                for m in (small, big)
            )
            phi = min(max((extra_big - extra_small) / (x_big - x_small), 0.0), 1.0)
            slowdown.append(phi)
            exposed.append(min(max((extra_small - phi * x_small) / d, 0.0), 1.0) if d > 0 else 0.0)
            shown.append(f"{nbytes >> 10} KiB ({d * 1e3:.1f} ms): +{extra_small * 1e3:.1f} / +{extra_big * 1e3:.1f} ms")
        phi = statistics.median(slowdown)
        interference[str(g)] = {"exposed_fraction": statistics.median(exposed), "slowdown": phi,
                                "max_slowdown_s": phi * x_big, "queued_fraction": statistics.median(queued)}
        say(f"gather in flight, g={g}, beside {x_small * 1e3:.1f} / {x_big * 1e3:.1f} ms of matmul: "
            + ", ".join(shown) + f" -> {interference[str(g)]['exposed_fraction']:.0%} of its duration exposed, "
            f"compute alongside {phi:.0%} slower; a second gather in flight adds "
            f"{interference[str(g)]['queued_fraction']:.0%} of its duration")

    # arrival: how long a rank waits for its group's last one after a stretch of compute (CPU ranks:
    # on a GPU the device's queue absorbs the host's jitter)
    if device.type == "cpu" and groups:
        for g, (fit, points) in _arrival_waits(list(groups), per_node, device).items():
            interference[str(g)].update(fit)
            say(f"arrival, g={g}: a rank waits for its group's last one " + ", ".join(
                f"{w * 1e3:.2f} ms after {c * 1e3:.1f}" for c, w in points)
                + f" ms of compute -> {fit['arrival_wait_s'] * 1e3:.3f} ms x (c / 1 ms) ^ {fit['arrival_exponent']:.2f}")

    intra, inter = _links(fits, world, per_node)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu rank (1/{per_node} of this machine)"
    gpu = GpuSpec(
        name=name, peak_flops=peaks, memory_bandwidth_bps=bandwidth, memory_bytes=_memory_bytes(device, per_node),
        matmul_efficiency=1.0, memory_efficiency=1.0, op_overhead_s=op_overhead, graph_op_overhead_s=graph_op,
        optimizer_param_s=0.0,
        optimizer_element_s=per_element, device_type=device.type,
    )
    return Cluster(name="local", nodes=nodes, gpus_per_node=per_node, gpu=gpu, intra=intra, inter=inter,
                   collective_interference=interference, collective_fits=fits)
