"""Pipeline schedules as per-stage orders, and their makespan under dependencies.

A schedule is, for each of S stages, the order in which it runs ("F", mb) and
("B", mb) for micro-batches mb = 0..m-1. Dependencies: F(s, mb) needs F(s-1, mb)
(plus one P2P hop); B(s, mb) needs B(s+1, mb) (plus one hop) and its own F(s, mb).
Each stage runs its order one action at a time. With uniform stage times the bubble
(idle time of a stage over the ideal m * (t_f + t_b)) is (S-1)/m for both GPipe
and 1F1B (design.md); 1F1B keeps at most S micro-batches of activations alive
instead of m.
"""

from __future__ import annotations

from collections.abc import Sequence

Order = list[tuple[str, int]]


def gpipe_orders(stages: int, micro_batches: int) -> list[Order]:
    """All forwards, then all backwards (in reverse), on every stage."""
    order = [("F", mb) for mb in range(micro_batches)] + [("B", mb) for mb in reversed(range(micro_batches))]
    return [list(order) for _ in range(stages)]


def one_f_one_b_orders(stages: int, micro_batches: int) -> list[Order]:
    """Synchronous 1F1B: stage s warms up with S-1-s forwards, alternates, then drains."""
    orders = []
    for s in range(stages):
        warm = min(stages - 1 - s, micro_batches)
        order: Order = [("F", mb) for mb in range(warm)]
        f, b = warm, 0
        while f < micro_batches:
            order += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        order += [("B", mb) for mb in range(b, micro_batches)]
        orders.append(order)
    return orders


def makespan_s(
    orders: Sequence[Order], forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: float = 0.0,
) -> tuple[float, list[float]]:
    """(time until the last stage finishes, busy time per stage) for per-stage F/B times."""
    stages = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, mb = orders[s][position[s]]
            if kind == "F":
                deps = [("F", s - 1, mb)] if s > 0 else []
            else:
                deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s < stages - 1 else [])
            if any(d not in done for d in deps):
                continue
            ready = max([done[d] + (p2p_s if d[1] != s else 0.0) for d in deps], default=0.0)
            start = max(clock[s], ready)
            clock[s] = start + (forward_s[s] if kind == "F" else backward_s[s])
            done[(kind, s, mb)] = clock[s]
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(stages) if position[s] < len(orders[s])}
            raise ValueError(f"schedule deadlocks: stages wait on each other at {stuck}")
    busy = [len(orders[s]) // 2 * (forward_s[s] + backward_s[s]) for s in range(stages)]
    return max(clock), busy


def bubble_fraction(orders: Sequence[Order], forward_s: float = 1.0, backward_s: float = 2.0) -> float:
    """Idle time of the busiest stage over its ideal busy time, with uniform stages."""
    stages = len(orders)
    total, busy = makespan_s(orders, [forward_s] * stages, [backward_s] * stages)
    return (total - max(busy)) / max(busy)
