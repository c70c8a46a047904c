"""Timing shared by the benchmarks: what one training step takes across all ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from micscompile.cost_model.calibrate import slowest_rank_median


def median_step_s(step: Callable, batches: Sequence[Sequence[torch.Tensor]], warmup: int) -> tuple[float, object]:
    """Run ``warmup`` steps, then time one step per remaining batch (barrier before each).
    Returns (the median over steps of the slowest rank's time, the last step's return value)."""
    for batch in batches[:warmup]:
        step(*batch)
    times, out = [], None
    for batch in batches[warmup:]:
        dist.barrier()
        t0 = time.perf_counter()
        out = step(*batch)
        times.append(time.perf_counter() - t0)
    return slowest_rank_median(times), out  # a step waits for its slowest rank
