"""Profile mode: time every op of a trace on the local device.

Runs the traced graph (forward + loss + backward of one micro-batch) on random
tensors of the traced shapes, timing each node (median over ``repeats`` runs), then
scales those times so they add up to the measured time of a straight run of the
whole graph (timing op by op misses the cost between ops, ~15% on a busy CPU), and
records them in ``node.meta[META_TIME_S]``. Inside a process group, every rank must
call it: runs are barrier-aligned and the whole-graph time is the ranks' mean (what a rank then waits for
its group's slowest one at a collective is the calibrated cluster's arrival wait). The passes copy node meta, so the
Program's COMPUTE actions then carry measured times (``Action.measured_s``) and the
simulator prefers them to the roofline estimate. When several ranks share a
machine, profile on all of them at once: each then measures its fair share.

Integer inputs are zeros (valid indices for embeddings and targets of any size).

``OpCounter`` counts the aten ops a step dispatches (host time per op on a GPU; docs/gpu.md).
"""

from __future__ import annotations

import collections
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from micscompile.core.launch import collective_device
from micscompile.cost_model.calibrate import device_sync, mean_rank_median
from micscompile.cost_model.node_cost import META_TIME_S
from micscompile.trace import TrainGraph

WHOLE_WINDOW_S = 2.0
WHOLE_MIN_SAMPLES = 7
"""Time the whole graph for at least WHOLE_WINDOW_S and WHOLE_MIN_SAMPLES steps' worth of runs:
fewer samples on a busy machine are noise (3 samples of a 0.3 s graph moved the total by 20%)."""


class _TimingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, sync) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.times: dict[str, float] = {}
        self.sync = sync

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        self.sync()
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.sync()
        self.times[n.name] = time.perf_counter() - t0
        return out


def _random_like(node: torch.fx.Node, device: torch.device) -> torch.Tensor:
    val = node.meta["val"]
    if val.is_floating_point():
        return (torch.randn(val.shape, dtype=val.dtype, device=device) * 0.02).requires_grad_(False)
    return torch.zeros(val.shape, dtype=val.dtype, device=device)


def profile_trace(
    trace: TrainGraph, device: torch.device | str = "cpu", repeats: int = 3, micro_batches: int = 1,
) -> TrainGraph:
    """Annotate ``trace``'s nodes with their measured time on ``device`` (in place); returns it.

    ``micro_batches``: how many times a step runs the graph back to back (``Plan.micro_batches``).
    The whole-graph time is measured that way, between barriers: on a shared machine a rank
    that finishes early frees cores for the others, which a lone run between barriers
    credits to every micro-batch (4 runs of 1/4 of the batch cost ~30% more than 1/4 of one
    run of the whole batch on 4 ranks over 2 cores).
    """
    from micscompile.passes.retarget_device import retarget_device

    device = torch.device(device)
    gm = torch.fx.GraphModule(trace.gm, retarget_device(trace.graph_copy(), device))  # factory ops traced on meta
    inputs = [_random_like(n, device) for n in gm.graph.nodes if n.op == "placeholder"]
    sync = functools.partial(device_sync, device)
    aligned = dist.is_available() and dist.is_initialized()
    barrier = dist.barrier if aligned else (lambda: None)
    runs = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first run warms up
            barrier()
            interp = _TimingInterpreter(gm, sync)
            interp.run(*inputs)
            runs.append(interp.times)
        runs = runs[1:]
        # the total decides the prediction: time it over >= WHOLE_WINDOW_S (same count on every rank)
        sync()
        t0 = time.perf_counter()
        gm(*inputs)
        sync()
        once = max(time.perf_counter() - t0, 1e-6) * micro_batches
        count = max(WHOLE_MIN_SAMPLES, int(WHOLE_WINDOW_S / once))
        if aligned:
            count = torch.tensor([count], device=collective_device())
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        whole = []
        for _ in range(int(count)):
            barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(micro_batches):
                gm(*inputs)
            sync()
            whole.append((time.perf_counter() - t0) / micro_batches)
    per_node = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    # a typical rank's time: at each collective a step waits for its group's slowest rank, which the
    # calibrated cluster prices as the arrival wait for the compute since the group's last collective
    total = mean_rank_median(whole)
    # timing node by node (with syncs) misses what happens between ops in a straight run:
    # keep the per-node split, scale it to the measured time of the whole graph
    scale = total / max(sum(per_node.values()), 1e-12)
    by_name = {n.name: n for n in trace.gm.graph.nodes}
    for name, seconds in per_node.items():
        by_name[name].meta[META_TIME_S] = seconds * scale
    return trace


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched while active, by op (``ops``) and in all (``total``): each one is host
    time on a GPU, so a small model's step is as fast as its count (docs/gpu.md).
    ``with OpCounter() as c: step(x, y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
