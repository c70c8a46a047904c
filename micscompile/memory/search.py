"""The search phases of the memory planner on one piece (see ``memory.planner`` for the terms).

``local_search`` perturbs a greedy placement order; ``exact_search`` is a branch and bound.

The exact search places buffers one at a time, each at its lowest fitting address ("first fit"),
and branches over which buffer goes next. Why that can reach the optimum (proof in three lines):

    Take an optimal placement with the least sum of offsets; place its buffers in (offset, index)
    order with first fit. By induction each lands at or below its optimal offset (the earlier ones
    live with it end below it), so all land exactly there, in non-decreasing offset order.

Hence the search only explores sequences whose offsets never decrease (ties in index order), and
takes interchangeable buffers (same size and interval) in index order. With x the last offset:
    * a remaining buffer that fits in a hole entirely below x could never be placed: dead end;
    * every remaining buffer goes at or above max(its first fit, x), and those live at one time t
      are disjoint: stacking them by that base, per t, bounds the arena (this implies the classic
      bound "x + remaining bytes live at t + placed bytes above x at t", i.e. L at the root);
    * no buffer may reach the best arena found (the partial arena stays below it).
Children are tried lowest offset first, then earliest start, then largest: with the target at L
this finds a perfect packing with little backtracking on the instances we tried.
Sizes here are integers (units of the alignment); times are compressed ranks ``0..T-1``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple


class ExactResult(NamedTuple):
    offsets: list[int] | None
    """A placement better than ``upper``, or None if none was found."""
    arena: int
    exhausted: bool
    """The whole tree was searched: no placement has an arena below ``arena`` (``upper`` if none found)."""
    work: int
    """Elementary steps spent (for the caller's deterministic work cap)."""


class _Stop(Exception):
    pass


def exact_search(u: list[int], s: list[int], e: list[int], T: int, *, upper: int, target: int,
                 deadline: float, work_cap: int) -> ExactResult:
    """Search for a placement with arena < ``upper``, the best first; stop as soon as one reaches
    ``target`` (>= L), or at the deadline or the work cap (``exhausted`` False)."""
    n = len(u)
    steps = [range(s[i], e[i]) for i in range(n)]
    ov = [0] * n           # bitmask of the buffers live at once with i
    for i in range(n):
        for j in range(n):
            if i != j and s[i] < e[j] and s[j] < e[i]:
                ov[i] |= 1 << j
    twin = [-1] * n        # previous interchangeable buffer
    seen: dict[tuple[int, int, int], int] = {}
    for i in range(n):
        key = (u[i], s[i], e[i])
        twin[i] = seen.get(key, -1)
        seen[key] = i
    live = [0] * T
    for i in range(n):
        for t in steps[i]:
            live[t] += u[i]
    L = max(live, default=0)

    off = [0] * n
    top = [0] * n
    ff = [0] * n           # current first-fit offset of every unplaced buffer
    seq: list[int] = []    # placed buffers, in (non-decreasing) offset order
    best = upper
    best_offs: list[int] | None = None
    work = 0
    t_check = 0

    def first_fit(d: int) -> int:
        cur, ud, od = 0, u[d], ov[d]
        for p in seq:
            if od >> p & 1:
                if off[p] - cur >= ud:
                    break
                if top[p] > cur:
                    cur = top[p]
        return cur

    def dfs(placed: int, x: int, last: int, maxtop: int, remlife: int) -> None:
        nonlocal best, best_offs, work, t_check
        if len(seq) == n:
            if maxtop < best:
                best, best_offs = maxtop, list(off)
                if best <= target:
                    raise _Stop
            return
        rem = [c for c in range(n) if not placed >> c & 1]
        work += (n + remlife) >> 1
        if work > work_cap:
            raise _Stop
        t_check += 1
        if t_check & 63 == 0 and time.perf_counter() > deadline:
            raise _Stop
        # Bound: every remaining buffer c goes at or above base(c) = max(ff[c], x) (first fit only
        # rises as buffers are added, and offsets never decrease), and those live at one time t are
        # disjoint: per t, stacking them by base is the least possible top (one machine, release dates).
        base = []
        for c in rem:
            f = ff[c]
            if f + u[c] <= x:     # c fits in a hole below x that no later buffer can fill: its
                return            # offset would decrease, so this is not a canonical sequence
            base.append((f if f > x else x, c))
        base.sort()
        col = [0] * T
        for b, c in base:
            uc = u[c]
            for t in steps[c]:
                v = col[t]
                v = (v if v > b else b) + uc
                col[t] = v
        if max(col) >= best:
            return
        cands = [c for c in rem if (ff[c] > x or (ff[c] == x and c > last))
                 and (twin[c] < 0 or placed >> twin[c] & 1) and ff[c] + u[c] < best]
        cands.sort(key=lambda c: (ff[c], s[c], -u[c], c))
        for c in cands:
            o = ff[c]
            if o + u[c] >= best:
                continue
            off[c], top[c] = o, o + u[c]
            seq.append(c)
            saved = []
            m = ov[c] & ~placed
            while m:
                d = (m & -m).bit_length() - 1
                m &= m - 1
                if ff[d] < top[c] and ff[d] + u[d] > o:    # its current gap now collides with c
                    saved.append((d, ff[d]))
                    ff[d] = first_fit(d)
            try:
                dfs(placed | 1 << c, o, c, max(maxtop, top[c]), remlife - len(steps[c]))
            finally:
                for d, v in saved:
                    ff[d] = v
                seq.pop()

    finished = False
    try:
        if best > L:
            dfs(0, 0, -1, 0, sum(map(len, steps)))
        finished = True
    except _Stop:
        pass
    except RecursionError:   # pragma: no cover - n is small by construction
        pass
    return ExactResult(best_offs, best, finished, work)


class LocalResult(NamedTuple):
    order: list[int]
    offsets: list[int]
    arena: int
    work: int


def local_search(place: Callable[[list[int], int], tuple[list[int], int] | None], u: Sequence[int],
                 order: Sequence[int], offsets: list[int], arena: int, *, target: int, deadline: float,
                 work_cap: int, cost: int, seed: int) -> LocalResult:
    """Randomized search on a placement order: move a buffer that touches the peak address earlier,
    swap neighbours, or move any buffer; keep moves that do not raise the arena, restart from the
    best after 200 moves without progress. ``place(order, limit)`` gives (offsets, arena), or None
    once the arena would exceed ``limit``; each call costs ``cost`` work units. Seeded: the result
    depends only on the input, as long as the work cap ends the search before the deadline."""
    rng = random.Random(seed)
    n = len(u)
    best = LocalResult(list(order), offsets, arena, 0)
    if n < 2:
        return best
    cur_order, cur_offs, cur_arena = list(order), offsets, arena
    work = stale = 0
    while best.arena > target and work + cost <= work_cap and time.perf_counter() < deadline:
        work += cost
        new = list(cur_order)
        r = rng.random()
        if r < 0.5:     # a buffer that touches the peak address goes earlier
            peak = [b for b in range(n) if cur_offs[b] + u[b] == cur_arena]
            b = peak[rng.randrange(len(peak))]
            i = new.index(b)
            if i:
                new.insert(rng.randrange(i), new.pop(i))
        elif r < 0.8:   # swap neighbours
            i = rng.randrange(n - 1)
            new[i], new[i + 1] = new[i + 1], new[i]
        else:           # move any buffer anywhere
            new.insert(rng.randrange(n), new.pop(rng.randrange(n)))
        res = place(new, cur_arena)
        stale += 1
        if res is not None:
            cur_order, (cur_offs, cur_arena) = new, res
            if cur_arena < best.arena:
                best, stale = LocalResult(new, cur_offs, cur_arena, 0), 0
        if stale >= 200:
            cur_order, cur_offs, cur_arena, stale = list(best.order), best.offsets, best.arena, 0
    return best._replace(work=work)
