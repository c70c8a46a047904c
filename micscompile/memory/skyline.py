"""Skyline placement and squeaky-wheel search for the memory planner (terms in ``memory.planner``).

Skyline (the "lowest gap first" rule of Sekiyama et al. 2018 / TelaMalloc, with the time axis
fixed): keep, per time, the height below which everything is decided. Repeatedly take the lowest
segment (a maximal time range of equal height, leftmost on ties; the order between equal-height
segments does not matter: they never share a candidate), and place there, at that height, the
unplaced buffer of highest priority that lives entirely inside it; when none does, raise the
segment to its lower neighbour (that area stays unused). Holes are never filled later, but
buffers that live at once end up stacked without gaps wherever the priorities let them.

Squeaky wheel (Joslin & Clements 1999): after each skyline, every buffer that ends above the target
gets its priority raised (by one "boost" level; within a level the base rule decides), so next time
it is taken earlier. Two chains run in turn, with different base rules (longest lifetime, then
largest; largest sqrt(lifetime) * size), each with its own boosts. Priorities are distinct
integers, so every choice, and the whole search, depends only on the input.

On the pipeline-parallel training traces (several hundred buffers, arena 3-4 % above L with the
greedy rules) this reaches L within a few dozen skylines.
Sizes are integers (units of the alignment); times are compressed ranks ``0..T-1``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Work units per skyline step (a placement or a raise), per SCAN_DIV candidates scanned and per
# buffer (setup), calibrated with planner.WORK_PER_S so that the work cap normally ends the
# search well before the deadline.
STEP_WORK = 10
SCAN_DIV = 32
BUFFER_WORK = 4


class SkylineResult(NamedTuple):
    offsets: list[int] | None
    """The best placement found (None if not even one skyline fitted in the work cap)."""
    arena: int
    work: int
    runs: int


class _Skyline:
    def __init__(self, u: Sequence[int], s: Sequence[int], e: Sequence[int], T: int) -> None:
        self.n = n = len(u)
        self.T = T
        self.o = o = sorted(range(n), key=lambda i: (s[i], i))     # buffers by start
        self.s = [s[i] for i in o]
        self.e = [e[i] for i in o]
        self.u = [u[i] for i in o]
        self.e_np = np.array(self.e, np.int64)
        first = [0] * (T + 1)     # first[t]: the first buffer (in start order) starting at or after t
        k = 0
        for t in range(T + 1):
            while k < n and self.s[k] < t:
                k += 1
            first[t] = k
        self.first = first

    def place(self, prio: np.ndarray, deadline: float) -> tuple[list[int], int, int] | None:
        """One skyline with ``prio`` (distinct non-negative int64, in start order); (offsets in
        input order, arena, work), or None at the deadline."""
        n, s, e, u, first, e_np = self.n, self.s, self.e, self.u, self.first, self.e_np
        P = prio.copy()
        xs = [0, self.T - 1]      # segment i covers columns [xs[i], xs[i + 1]); the last is a sentinel
        hs: list[float] = [0, math.inf]
        offs = [0] * n
        left, steps, scanned = n, 0, 0
        while left:
            steps += 1
            if steps & 255 == 0 and time.perf_counter() > deadline:
                return None
            m = min(hs)
            i = hs.index(m)
            a, b = xs[i], xs[i + 1]
            lo, hi = first[a], first[b]
            if hi > lo:
                scanned += hi - lo
                pr = np.where(e_np[lo:hi] <= b, P[lo:hi], -1)
                k = int(pr.argmax())
                if pr[k] >= 0:
                    c = lo + k
                    P[c] = -1
                    offs[c] = m
                    left -= 1
                    sc, ec, top = s[c], e[c], m + u[c]
                    nx, nh = [sc], [top]
                    if sc > a:
                        nx.insert(0, a)
                        nh.insert(0, m)
                    if ec < b:
                        nx.append(ec)
                        nh.append(m)
                    xs[i:i + 1] = nx
                    hs[i:i + 1] = nh
                    j = i + len(nx) - 1
                    if hs[j] == hs[j + 1]:
                        del xs[j + 1], hs[j + 1]
                    if i and hs[i - 1] == hs[i]:
                        del xs[i], hs[i]
                    continue
            # nothing fits: raise the segment to its lower neighbour (merging with it)
            hl = hs[i - 1] if i else math.inf
            hr = hs[i + 1]
            if hl < hr:
                del xs[i], hs[i]
            elif hr < hl:
                del xs[i + 1], hs[i + 1]
                hs[i] = hr
            else:
                del xs[i:i + 2], hs[i:i + 2]
        out = [0] * n
        arena = 0
        for k, i in enumerate(self.o):
            out[i] = int(offs[k])
            arena = max(arena, out[i] + u[k])
        return out, arena, STEP_WORK * steps + scanned // SCAN_DIV


def _ranks(keys: list) -> np.ndarray:
    """0 for the smallest key ... n-1 for the largest (ties: the larger index ranks higher)."""
    r = np.empty(len(keys), np.int64)
    r[sorted(range(len(keys)), key=lambda i: (keys[i], i))] = np.arange(len(keys))
    return r


def skyline_search(u: Sequence[int], s: Sequence[int], e: Sequence[int], T: int, *, target: int,
                   deadline: float, work_cap: int) -> SkylineResult:
    """Squeaky-wheel search over skyline priorities until the arena reaches ``target``, the work
    cap or the deadline."""
    sky = _Skyline(u, s, e, T)
    n = sky.n
    work = BUFFER_WORK * n
    best = SkylineResult(None, 0, 0, 0)
    if n == 0:
        return best
    su, ss, se = sky.u, sky.s, sky.e
    life = [se[k] - ss[k] for k in range(n)]
    bases = [_ranks([(life[k], su[k]) for k in range(n)]),            # longest, then largest
             _ranks([(math.sqrt(life[k]) * su[k], su[k]) for k in range(n)])]
    boosts = [np.zeros(n, np.int64) for _ in bases]
    est = STEP_WORK * 2 * n + n * n // (8 * SCAN_DIV)      # cost of one skyline, then the last one's
    runs = 0
    while work + est <= work_cap and time.perf_counter() < deadline:
        c = runs % len(bases)
        res = sky.place(boosts[c] * n + bases[c], deadline)
        if res is None:
            break
        offs, arena, est = res
        runs += 1
        work += est
        if best.offsets is None or arena < best.arena:
            best = SkylineResult(offs, arena, 0, 0)
            if arena <= target:
                break
        boosts[c] += np.fromiter((offs[i] + u[i] > target for i in sky.o), bool, n)
    return best._replace(work=work, runs=runs)
