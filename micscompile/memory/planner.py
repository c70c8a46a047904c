"""Static memory planning: one fixed offset per buffer in one arena per rank.

Terms
    buffer        ``size`` bytes live over the half-open Program-step interval ``[start, end)``.
                  Two buffers are *live at once* when ``a.start < b.end and b.start < a.end``;
                  touching intervals (``[0, 2)`` and ``[2, 4)``) are not, and may share bytes.
    aligned size  ``size`` rounded up to a multiple of ``alignment`` (a power of two).
    never live    ``size == 0`` or ``end == start``: offset 0, ignored everywhere else.
    arena         ``max(offset + aligned size)`` over the live buffers (0 if none).
    L             ``max_t`` of the aligned bytes live at ``t``: no placement can beat it.
    piece         a maximal time window that no buffer crosses. Pieces are independent (the
                  arena is the max of theirs); identical pieces (same canonical signature:
                  times shifted to start at 0, buffers in a canonical order, aligned sizes)
                  are solved once and their offsets reused.

Invariants of a ``MemoryPlan`` (``MemoryPlan.check`` verifies them against the buffers)
    * one offset per input buffer, in input order, ``>= 0`` and a multiple of ``alignment``;
    * buffers live at once occupy disjoint address ranges;
    * ``offset + aligned size <= arena_bytes`` for every live buffer; ``L <= arena_bytes``;
    * ``optimal`` is true only when ``arena_bytes == L`` or an exact search proved it;
    * the output depends only on the input: seeded search, and work caps (derived from the
      time budget) that normally end the search before the wall-clock budget does.

Phases, per distinct piece; each ends as soon as the piece reaches its target (its own L, or the
global L or best proven lower bound when higher: a piece below the max cannot change the arena):
    1. greedy portfolio: best-fit by size / lifetime / area, first-fit by start / size;
    2. within ``time_budget_s`` (None: 1 s, 0: skip), on the pieces that set the arena, costliest
       first: for pieces of up to EXACT_MAX_BUFFERS buffers an exact feasibility search at the
       target (``memory.search``); then a squeaky-wheel search over skyline placements
       (``memory.skyline``: lowest gap first, buffers that end above the target get priority next
       time), which is what brings pipeline-parallel traces from 3-4 % above L down to L; then
       randomized local search on the best order; then, for small pieces, exact branch and bound
       from the best placement, which can prove optimality.
Internally all sizes and offsets are in units of ``alignment``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from micscompile.core.errors import Error
from micscompile.memory.search import exact_search, local_search
from micscompile.memory.skyline import skyline_search


class Buffer(NamedTuple):
    size: int
    """Bytes."""
    start: int
    """First Program step where the buffer is live."""
    end: int
    """Half-open: live over ``[start, end)``."""
    name: str = ""
    kind: str = ""
    """e.g. "gathered", "activation" (informational)."""


class MemoryPlanError(Error, ValueError):
    """Invalid buffers or alignment, or a plan that breaks an invariant; the message names the buffer(s)."""


DEFAULT_BUDGET_S = 1.0
EXACT_MAX_BUFFERS = 256     # pieces up to this many buffers also get the exact search
NUMPY_MIN_BUFFERS = 256     # pieces from this many buffers on use the numpy placement
# Work caps: the search stops after about this many elementary steps per second of budget
# (calibrated so that it normally ends well before the wall clock, keeping results deterministic).
WORK_PER_S = 2_500_000
# The wall clock stops the search only at this many times the budget: the work caps, not the machine's
# speed, end it on a machine up to this much slower than the one WORK_PER_S was measured on (on a day the
# project's 2-core machine ran pure Python 3-4x slower, equal limits gave another plan for the same buffers).
DEADLINE_SLACK = 4.0
_INT64_SAFE = 1 << 61


def _describe(i: int, name: str, start: int, end: int) -> str:
    return f"buffer #{i}" + (f" {name!r}" if name else "") + f" [{start}, {end})"


class _Norm(NamedTuple):
    size: list[int]
    start: list[int]
    end: list[int]
    name: list[str]
    units: list[int]      # aligned size / alignment; 0 for a never-live buffer


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_alignment(alignment: Any) -> int:
    if not _is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise MemoryPlanError(f"alignment must be a positive power of two, got {alignment!r}")
    return int(alignment)


def _normalize(buffers: Iterable[Any], alignment: int) -> _Norm:
    sizes: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    names: list[str] = []
    units: list[int] = []
    for i, b in enumerate(buffers):
        if all(hasattr(b, f) for f in ("size", "start", "end")):
            size, start, end, name = b.size, b.start, b.end, getattr(b, "name", "")
        elif isinstance(b, (tuple, list)) and 3 <= len(b) <= 5:
            size, start, end = b[0], b[1], b[2]
            name = b[3] if len(b) > 3 else ""
        else:
            raise MemoryPlanError(f"buffer #{i}: expected a Buffer, an object with .size/.start/.end or a "
                                  f"(size, start, end) tuple, got {b!r}")
        name = str(name)
        for field, v in (("size", size), ("start", start), ("end", end)):
            if not _is_int(v):
                raise MemoryPlanError(f"buffer #{i}" + (f" {name!r}" if name else "")
                                      + f": {field} must be an int, got {v!r}")
        size, start, end = int(size), int(start), int(end)
        if size < 0:
            raise MemoryPlanError(f"{_describe(i, name, start, end)}: negative size {size}")
        if end < start:
            raise MemoryPlanError(f"{_describe(i, name, start, end)}: end {end} < start {start}")
        sizes.append(size)
        starts.append(start)
        ends.append(end)
        names.append(name)
        units.append(-(-size // alignment) if end > start else 0)
    return _Norm(sizes, starts, ends, names, units)


def _peak(units: Sequence[int], starts: Sequence[int], ends: Sequence[int], idx: Iterable[int]) -> int:
    """Max over time of the live units (frees at t before allocs at t)."""
    events = []
    for i in idx:
        events.append((starts[i], 1, units[i]))
        events.append((ends[i], 0, -units[i]))
    events.sort()
    cur = peak = 0
    for _, _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def lower_bound_bytes(buffers: Iterable[Any], alignment: int = 512) -> int:
    """L: the most aligned bytes live at any one time."""
    a = _check_alignment(alignment)
    nb = _normalize(buffers, a)
    return _peak(nb.units, nb.start, nb.end, [i for i, u in enumerate(nb.units) if u]) * a


@dataclass(frozen=True)
class MemoryPlan:
    offsets: tuple[int, ...]
    """Aligned byte offsets, in input order."""
    arena_bytes: int
    """max over buffers of offset + aligned size (0 if none)."""
    lower_bound_bytes: int
    """L = max over time of the live aligned bytes."""
    alignment: int
    method: str
    """The strategy that produced the placement of the piece that sets the arena."""
    optimal: bool
    """arena_bytes == lower_bound_bytes, or the exact search proved optimality."""
    solve_time_s: float
    components: int
    """Independent pieces (time windows no buffer crosses)."""
    distinct_components: int
    """Pieces that had to be solved; the others reused an identical piece's offsets."""

    @property
    def fragmentation_bytes(self) -> int:
        return self.arena_bytes - self.lower_bound_bytes

    def check(self, buffers: Iterable[Any]) -> None:
        """Raise MemoryPlanError unless this plan is a valid placement of ``buffers``."""
        a = self.alignment
        nb = _normalize(buffers, _check_alignment(a))
        n = len(nb.size)
        if len(self.offsets) != n:
            raise MemoryPlanError(f"the plan has {len(self.offsets)} offsets for {n} buffers")
        live = []
        for i, off in enumerate(self.offsets):
            where = _describe(i, nb.name[i], nb.start[i], nb.end[i])
            if not _is_int(off) or off < 0 or off % a:
                raise MemoryPlanError(f"{where}: offset {off!r} is not a non-negative multiple of {a}")
            if nb.units[i]:
                if off + nb.units[i] * a > self.arena_bytes:
                    raise MemoryPlanError(f"{where}: [{off}, {off + nb.units[i] * a}) ends past the arena "
                                          f"({self.arena_bytes} bytes)")
                live.append(i)
        # Sweep over time; the live set is kept sorted by address and pairwise disjoint, so a new
        # buffer only needs checking against its two address neighbours.
        events = sorted([(nb.end[i], 0, i) for i in live] + [(nb.start[i], 1, i) for i in live])
        active: list[tuple[int, int]] = []    # (offset, index), sorted

        def span(i: int) -> str:
            off = self.offsets[i]
            return f"{_describe(i, nb.name[i], nb.start[i], nb.end[i])} at bytes [{off}, {off + nb.units[i] * a})"

        for _, is_alloc, i in events:
            key = (self.offsets[i], i)
            if not is_alloc:
                del active[bisect.bisect_left(active, key)]
                continue
            pos = bisect.bisect_left(active, key)
            for j in ([active[pos - 1][1]] if pos else []) + ([active[pos][1]] if pos < len(active) else []):
                lo, hi = max(self.offsets[i], self.offsets[j]), min(self.offsets[i] + nb.units[i] * a,
                                                                     self.offsets[j] + nb.units[j] * a)
                if lo < hi:
                    x, y = sorted((i, j))
                    raise MemoryPlanError(f"{span(x)} and {span(y)} are live at the same time and overlap "
                                          f"in address")
            active.insert(pos, key)
        if self.arena_bytes < self.lower_bound_bytes:
            raise MemoryPlanError(f"arena {self.arena_bytes} bytes is below the lower bound {self.lower_bound_bytes}")

    def __str__(self) -> str:
        ratio = self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        return (f"MemoryPlan: arena {self.arena_bytes} B, L {self.lower_bound_bytes} B, arena/L {ratio:.4f}, "
                f"{self.method}{' (optimal)' if self.optimal else ''}, {len(self.offsets)} buffers in "
                f"{self.components} pieces ({self.distinct_components} distinct), {self.solve_time_s * 1e3:.1f} ms")


# ----------------------------------------------------------------------------------------------
# One piece: canonical buffers, placement rules.

class _Piece:
    """A canonical sub-instance: buffers sorted by (start, end, units), times shifted to 0."""

    def __init__(self, sig: tuple[tuple[int, int, int], ...]) -> None:
        self.n = n = len(sig)
        self.s = [t[0] for t in sig]
        self.e = [t[1] for t in sig]
        self.u = [t[2] for t in sig]
        times = sorted(set(self.s) | set(self.e))
        rank = {t: r for r, t in enumerate(times)}
        self.sc = [rank[t] for t in self.s]       # compressed times (same overlap relation)
        self.ec = [rank[t] for t in self.e]
        self.T = len(times)
        self.L = _peak(self.u, self.sc, self.ec, range(n))
        self.use_numpy = n >= NUMPY_MIN_BUFFERS
        if self.use_numpy:     # addresses beyond int64 (absurd sizes) fall back to Python ints
            self.addr_dtype = np.int64 if sum(self.u) < _INT64_SAFE else object
        else:
            self.mask = [(1 << e) - (1 << s) for s, e in zip(self.sc, self.ec)]   # times as bitsets

    def orders(self) -> Iterator[tuple[str, bool, list[int]]]:
        """The greedy portfolio: (method, best_fit, order). Lifetimes are in (shifted) Program steps."""
        s, e, u, r = self.s, self.e, self.u, range(self.n)
        yield "best-fit/size", True, sorted(r, key=lambda i: (-u[i], -(e[i] - s[i]), i))
        yield "best-fit/lifetime", True, sorted(r, key=lambda i: (-(e[i] - s[i]), -u[i], i))
        yield "best-fit/area", True, sorted(r, key=lambda i: (-u[i] * (e[i] - s[i]), -u[i], i))
        yield "first-fit/start", False, sorted(r, key=lambda i: (s[i], -e[i], -u[i], i))
        yield "first-fit/size", False, sorted(r, key=lambda i: (-u[i], -(e[i] - s[i]), i))

    def place(self, order: Sequence[int], best_fit: bool, limit: int | None = None) -> tuple[list[int], int] | None:
        """Place buffers one at a time in ``order``; None as soon as a top exceeds ``limit``."""
        return (self._place_numpy if self.use_numpy else self._place_python)(order, best_fit, limit)

    def _place_python(self, order, best_fit, limit):
        u, mask = self.u, self.mask
        offs = [0] * self.n
        p_off: list[int] = []     # placed buffers sorted by offset
        p_top: list[int] = []
        p_mask: list[int] = []
        arena = 0
        for b in order:
            ub, mb = u[b], mask[b]
            cur, best, best_gap = 0, -1, 0
            for j in range(len(p_off)):
                if p_mask[j] & mb:
                    o = p_off[j]
                    gap = o - cur
                    if gap >= ub:
                        if not best_fit or gap == ub:
                            best = cur
                            break
                        if best < 0 or gap < best_gap:
                            best, best_gap = cur, gap
                    t = p_top[j]
                    if t > cur:
                        cur = t
            o = best if best >= 0 else cur
            top = o + ub
            if top > arena:
                if limit is not None and top > limit:
                    return None
                arena = top
            offs[b] = o
            k = bisect.bisect_right(p_off, o)
            p_off.insert(k, o)
            p_top.insert(k, top)
            p_mask.insert(k, mb)
        return offs, arena

    def _place_numpy(self, order, best_fit, limit):
        n, sl, el, u = self.n, self.sc, self.ec, self.u
        ps = np.empty(n, np.int64)
        pe = np.empty(n, np.int64)
        po = np.empty(n, self.addr_dtype)
        pt = np.empty(n, self.addr_dtype)
        offs = [0] * n
        arena = 0
        for m, b in enumerate(order):
            sb, eb, ub = sl[b], el[b], u[b]
            o = 0
            if m:
                idx = np.flatnonzero((ps[:m] < eb) & (pe[:m] > sb))
                if idx.size:
                    oo = po[idx]
                    tt = pt[idx]
                    if idx.size > 1:
                        srt = oo.argsort(kind="stable")
                        oo = oo[srt]
                        tt = np.maximum.accumulate(tt[srt])
                    gs = np.empty_like(oo)       # gap j runs from gs[j] (max top below) to oo[j]
                    gs[0] = 0
                    gs[1:] = tt[:-1]
                    gl = oo - gs
                    if best_fit:
                        fit = np.flatnonzero(gl >= ub)
                        o = int(gs[fit[gl[fit].argmin()]]) if fit.size else int(tt[-1])
                    else:
                        j = int((gl >= ub).argmax())
                        o = int(gs[j]) if gl[j] >= ub else int(tt[-1])
            top = o + ub
            if top > arena:
                if limit is not None and top > limit:
                    return None
                arena = top
            offs[b] = o
            ps[m], pe[m], po[m], pt[m] = sb, eb, o, top
        return offs, arena


class _Solution:
    def __init__(self, offs: list[int], arena: int, method: str, proven: bool) -> None:
        self.offs, self.arena, self.method, self.proven = offs, arena, method, proven
        self.order: list[int] | None = None
        self.best_fit = True
        self.work = 0     # search work spent on this piece


def _greedy(p: _Piece, target: int) -> _Solution:
    best: _Solution | None = None
    for method, best_fit, order in p.orders():
        res = p.place(order, best_fit, None if best is None else best.arena - 1)
        if res is not None:
            best = _Solution(res[0], res[1], method, res[1] <= p.L)
            best.order, best.best_fit = order, best_fit
            if best.arena <= target:
                break
    assert best is not None
    return best


def _improve(p: _Piece, sol: _Solution, glb: int, work_cap: int, deadline: float) -> int:
    """Phases 2-3 on one piece, in place; returns the proven lower bound on the piece's optimum.

    Pieces small enough for the exact search first ask it for a placement at the target (a
    feasibility search prunes hard and usually succeeds or fails fast); then every piece gets the
    skyline search (``memory.skyline``) and a short local search on the best order; small pieces
    end with branch and bound from the best placement.
    """
    lb = p.L
    target = max(lb, glb)
    t_start = time.perf_counter()
    span = max(deadline - t_start, 0.0)
    exact = p.n <= EXACT_MAX_BUFFERS

    def spend(frac: float) -> tuple[int, float]:
        return max(int(work_cap * frac) - sol.work, 0), t_start + span * frac

    if exact:
        cap, dl = spend(0.15)
        res = exact_search(p.u, p.sc, p.ec, p.T, upper=target + 1, target=target, deadline=dl, work_cap=cap)
        sol.work += res.work
        if res.offsets is not None:
            sol.offs, sol.arena, sol.method = res.offsets, res.arena, "exact"
        elif res.exhausted:     # nothing fits in the target: the optimum is above it
            lb = max(lb, target + 1)
    target = max(lb, glb)
    if sol.arena > target:
        cap, dl = spend(0.55 if exact else 0.85)
        sky = skyline_search(p.u, p.sc, p.ec, p.T, target=target, deadline=dl, work_cap=cap)
        sol.work += sky.work
        if sky.offsets is not None and sky.arena < sol.arena:
            sol.offs, sol.arena, sol.method = sky.offsets, sky.arena, "skyline"
            sol.order, sol.best_fit = sorted(range(p.n), key=lambda i: (sky.offsets[i], i)), False
            if sol.arena > target:
                # First fit in (offset, index) order puts every buffer at or below its skyline
                # offset (the argument in memory.search), and matches the local search's order.
                sol.offs, sol.arena = p.place(sol.order, False)
    if sol.arena > target and sol.order is not None:
        cap, dl = spend(0.7 if exact else 1.0)
        cost = p.n + p.n * p.n // 16 if not p.use_numpy else 25 * p.n + p.n * p.n // 800   # ~ one placement
        ls = local_search(lambda order, limit: p.place(order, sol.best_fit, limit), p.u, sol.order, sol.offs,
                          sol.arena, target=target, deadline=dl, work_cap=cap, cost=cost, seed=p.n)
        sol.work += ls.work
        if ls.arena < sol.arena:
            sol.order, sol.offs, sol.arena = ls.order, ls.offsets, ls.arena
            sol.method = ("best-fit" if sol.best_fit else "first-fit") + "/local-search"
    if exact and sol.arena > target:
        cap, dl = spend(1.0)
        res = exact_search(p.u, p.sc, p.ec, p.T, upper=sol.arena, target=target, deadline=dl, work_cap=cap)
        sol.work += res.work
        if res.offsets is not None:
            sol.offs, sol.arena, sol.method = res.offsets, res.arena, "exact"
        if res.exhausted:       # nothing below sol.arena exists
            lb = max(lb, sol.arena)
    sol.proven = sol.arena <= lb
    return lb


# ----------------------------------------------------------------------------------------------

def plan_memory(buffers: Iterable[Any], *, alignment: int = 512, time_budget_s: float | None = None) -> MemoryPlan:
    """Place every buffer at a fixed aligned offset so that buffers live at once never overlap.

    ``time_budget_s``: the time for the improvement and exact phases (None: 1 s, 0: greedy only), as
    work caps; the wall clock stops them at ``DEADLINE_SLACK`` times it. Every phase ends as soon
    as the arena reaches L.
    """
    t0 = time.perf_counter()
    a = _check_alignment(alignment)
    if time_budget_s is None:
        time_budget_s = DEFAULT_BUDGET_S
    if not isinstance(time_budget_s, (int, float)) or time_budget_s < 0:
        raise MemoryPlanError(f"time_budget_s must be None or >= 0, got {time_budget_s!r}")
    nb = _normalize(buffers, a)
    n = len(nb.size)
    st, en, un = nb.start, nb.end, nb.units

    # Decompose at the times no buffer crosses; canonicalise each piece.
    live = sorted((i for i in range(n) if un[i]), key=lambda i: (st[i], en[i]))
    groups: list[list[int]] = []
    reach = None
    for i in live:
        if reach is None or st[i] >= reach:
            groups.append([])
            reach = en[i]
        else:
            reach = max(reach, en[i])
        groups[-1].append(i)
    piece_of: list[tuple[tuple, list[int]]] = []     # (signature, members in canonical order)
    pieces: dict[tuple, _Piece] = {}
    for g in groups:
        t = st[g[0]]
        g = sorted(g, key=lambda i: (st[i], en[i], un[i]))     # stable: ties keep input order
        sig = tuple((st[i] - t, en[i] - t, un[i]) for i in g)
        if sig not in pieces:
            pieces[sig] = _Piece(sig)
        piece_of.append((sig, g))
    L = max((p.L for p in pieces.values()), default=0)

    # Phase 1: greedy, once per distinct piece.
    sols = {sig: _greedy(p, max(p.L, L)) for sig, p in pieces.items()}

    # Phases 2-3: improve the pieces that set the arena, the costliest first, within the budget.
    glb = L            # proven lower bound on the optimal arena (units)
    for sol in sols.values():
        if sol.proven:
            glb = max(glb, sol.arena)
    deadline = time.perf_counter() + DEADLINE_SLACK * time_budget_s
    work_left = int(time_budget_s * WORK_PER_S)
    stuck = 0          # arena of a piece we could not bring down: pieces below it do not matter
    for sig in sorted(pieces, key=lambda k: -sols[k].arena):
        if time_budget_s <= 0 or sols[sig].arena <= max(glb, stuck):
            continue
        todo = sum(1 for k in pieces if sols[k].arena > max(glb, stuck))
        now = time.perf_counter()
        piece_lb = _improve(pieces[sig], sols[sig], glb, work_left // todo, now + (deadline - now) / todo)
        work_left -= sols[sig].work
        glb = max(glb, piece_lb)
        if not sols[sig].proven:
            stuck = max(stuck, sols[sig].arena)

    offsets = [0] * n
    arena, method, proven = 0, "empty", True
    for sig, g in piece_of:
        sol = sols[sig]
        for i, o in zip(g, sol.offs):
            offsets[i] = o * a
        if sol.arena > arena:
            arena, method = sol.arena, sol.method
    if arena:
        proven = arena <= glb
    return MemoryPlan(offsets=tuple(offsets), arena_bytes=arena * a, lower_bound_bytes=L * a, alignment=a,
                      method=method, optimal=proven, solve_time_s=time.perf_counter() - t0,
                      components=len(groups), distinct_components=len(pieces))
