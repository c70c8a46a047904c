"""Where to cut a chain of units (the model's blocks, in forward order) into pipeline chunks.

``balance`` is the dynamic program over cut points: split ``costs`` into ``chunks``
contiguous non-empty runs, minimising the slowest run, subject to every run's
memory staying within its cap. Exact for that objective (tests compare it with
brute force); O(chunks * units^2), each chunk's step in numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from micscompile.core.plan import PlanError


def balance(
    costs: Sequence[float], chunks: int, memory: Sequence[float] | None = None,
    memory_cap: Callable[[int], float] | None = None,
) -> tuple[int, ...]:
    """Start index of each of ``chunks`` runs of ``costs`` minimising the largest run's cost.

    ``memory[i]`` is unit i's bytes; run c may hold at most ``memory_cap(c)`` bytes (e.g. the
    device capacity less the activations its schedule keeps in flight). Raises PlanError when
    there are fewer units than chunks or no split fits the memory.
    """
    n = len(costs)
    if chunks > n:
        raise PlanError(f"cannot cut {n} blocks into {chunks} pipeline chunks (stages x chunks per rank): "
                        f"use at most {n}")
    prefix, held = (np.array([0.0, *itertools.accumulate(v)]) for v in (costs, memory or [0.0] * n))
    cap = memory_cap or (lambda c: math.inf)
    # best[c][j]: the slowest run when units [0, j) form chunks 0..c-1; cut[c][j]: where run c-1 starts
    best = np.full((chunks + 1, n + 1), math.inf)
    cut = np.zeros((chunks + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    starts_at = np.arange(n + 1)[:, None]
    for c in range(1, chunks + 1):  # (the runs [i, j) for every i and j at once: for each j the first best i)
        ends = np.arange(c, n - (chunks - c) + 1)
        before = best[c - 1][:, None]
        value = np.maximum(before, prefix[ends] - prefix[:, None])
        value[(starts_at < c - 1) | (starts_at >= ends) | (before == math.inf)
              | (held[ends] - held[:, None] > cap(c - 1))] = math.inf
        i = np.argmin(value, axis=0)
        slowest = value[i, np.arange(len(ends))]
        ok = slowest < math.inf
        best[c][ends[ok]], cut[c][ends[ok]] = slowest[ok], i[ok]
    if best[chunks][n] == math.inf:
        raise PlanError(f"no split of the model into {chunks} pipeline chunks fits in memory "
                        f"(largest block {max(memory or [0]):.3g} bytes); use more stages or a larger "
                        f"partition size")
    starts, j = [], n
    for c in range(chunks, 0, -1):
        j = int(cut[c][j])
        starts.append(j)
    return tuple(reversed(starts))
