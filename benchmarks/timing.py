"""Timing shared by the benchmarks: what one training step takes across all ranks.

Each timed step starts with the device idle and ends when it is done (``device_sync``: on CUDA
the step returns once its kernels are launched)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from micscompile.cost_model.calibrate import device_sync, slowest_rank_median, slowest_rank_times


def median_step_s(step: Callable, batches: Sequence[Sequence[torch.Tensor]], warmup: int) -> tuple[float, object]:
    """Run ``warmup`` steps, then time one step per remaining batch (barrier before each).
    Returns (the median over steps of the slowest rank's time, the last step's return value)."""
    for batch in batches[:warmup]:
        step(*batch)
    times, out = [], None
    for batch in batches[warmup:]:
        device_sync()
        dist.barrier()
        t0 = time.perf_counter()
        out = step(*batch)
        device_sync()
        times.append(time.perf_counter() - t0)
    return slowest_rank_median(times), out  # a step waits for its slowest rank


def interleaved_times_s(steps: dict[str, Callable], batches: Sequence[Sequence[torch.Tensor]],
                        warmup: int) -> dict[str, list[float]]:
    """Several steps timed in alternation: each round times every step once on the same batch (the
    first one rotating), so drift on a shared machine (other jobs, thermal) reaches all of them alike. Per step, the
    slowest rank's time of every round (rounds pair up across steps)."""
    for batch in batches[:warmup]:
        for step in steps.values():
            step(*batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for k, batch in enumerate(batches[warmup:]):
        for name in names[k % len(names):] + names[:k % len(names)]:  # who goes first rotates
            step = steps[name]
            device_sync()
            dist.barrier()
            t0 = time.perf_counter()
            step(*batch)
            device_sync()
            times[name].append(time.perf_counter() - t0)
    return {name: slowest_rank_times(ts) for name, ts in times.items()}
