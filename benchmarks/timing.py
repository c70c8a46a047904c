"""Timing shared by the benchmarks: what one training step takes across all ranks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def median_step_s(step: Callable, batches: Sequence[Sequence[torch.Tensor]], warmup: int) -> tuple[float, object]:
    """Run ``warmup`` steps, then time one step per remaining batch (barrier before each).
    Returns (the slowest rank's median step time, the last step's return value)."""
    for batch in batches[:warmup]:
        step(*batch)
    times, out = [], None
    for batch in batches[warmup:]:
        dist.barrier()
        t0 = time.perf_counter()
        out = step(*batch)
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # every rank must agree: the step waits for the slowest
    return float(med), out
