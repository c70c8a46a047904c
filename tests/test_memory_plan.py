"""The static memory planner (micscompile.memory.planner): validity, optimality, reuse, scale."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from micscompile.memory import planner as mp
from micscompile.memory.planner import Buffer, MemoryPlan, MemoryPlanError, lower_bound_bytes, plan_memory

A = 512


def aligned(size: int, a: int = A) -> int:
    return -(-size // a) * a


def live(b) -> bool:
    return b[0] > 0 and b[2] > b[1]


def naive_L(bufs, a: int = A) -> int:
    times = {t for b in bufs for t in b[1:3]}
    return max((sum(aligned(b[0], a) for b in bufs if live(b) and b[1] <= t < b[2]) for t in times), default=0)


def assert_valid(bufs, plan: MemoryPlan, a: int = A) -> None:
    """Independent of MemoryPlan.check: every pair, the arena, the alignment, the bound."""
    assert len(plan.offsets) == len(bufs)
    assert all(o >= 0 and o % a == 0 for o in plan.offsets)
    idx = [i for i, b in enumerate(bufs) if live(b)]
    for i, j in itertools.combinations(idx, 2):
        (si, s1, e1), (sj, s2, e2) = bufs[i][:3], bufs[j][:3]
        if s1 < e2 and s2 < e1:
            oi, oj = plan.offsets[i], plan.offsets[j]
            assert oi + aligned(si, a) <= oj or oj + aligned(sj, a) <= oi, (i, j, plan)
    assert plan.arena_bytes == max((plan.offsets[i] + aligned(bufs[i][0], a) for i in idx), default=0)
    assert plan.lower_bound_bytes == naive_L(bufs, a) == lower_bound_bytes(bufs, a)
    assert plan.arena_bytes >= plan.lower_bound_bytes
    assert plan.fragmentation_bytes == plan.arena_bytes - plan.lower_bound_bytes
    plan.check(bufs)


def first_fit_brute_force(bufs, a: int = A) -> int:
    """The optimal arena: the best over all orders of placing each buffer at its lowest fitting address."""
    idx = [i for i, b in enumerate(bufs) if live(b)]
    best = None
    for perm in itertools.permutations(idx):
        off: dict[int, int] = {}
        for i in perm:
            size, s, e = bufs[i][0], bufs[i][1], bufs[i][2]
            busy = sorted((off[j], off[j] + aligned(bufs[j][0], a)) for j in off if bufs[j][1] < e and s < bufs[j][2])
            cur = 0
            for lo, hi in busy:
                if lo - cur >= aligned(size, a):
                    break
                cur = max(cur, hi)
            off[i] = cur
        arena = max((off[i] + aligned(bufs[i][0], a) for i in off), default=0)
        best = arena if best is None else min(best, arena)
    return best or 0


def fits_exhaustive(bufs, arena: int) -> bool:
    """Is there any placement (alignment 1) within ``arena``? Tries every offset of every buffer."""
    order = sorted(range(len(bufs)), key=lambda i: -bufs[i][0])
    off: dict[int, int] = {}

    def rec(k: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        z, s, e = bufs[i]
        for o in range(arena - z + 1):
            if all(not (s < bufs[j][2] and bufs[j][1] < e) or o + z <= off[j] or off[j] + bufs[j][0] <= o
                   for j in off):
                off[i] = o
                if rec(k + 1):
                    return True
                del off[i]
        return False

    return rec(0)


# ------------------------------------------------------------------------------------------------
# Properties on random instances.

buffer_st = st.tuples(st.integers(1, 10**6), st.integers(0, 50), st.integers(0, 50)).map(
    lambda t: (t[0], min(t[1], t[2]), max(t[1], t[2])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 40).flatmap(lambda n: st.lists(buffer_st, min_size=n, max_size=n)))
def test_random_instances_are_valid_and_deterministic(bufs):
    plan = plan_memory(bufs, time_budget_s=0.25)
    assert_valid(bufs, plan)
    again = plan_memory(list(bufs), time_budget_s=0.25)
    assert again.offsets == plan.offsets and again.method == plan.method
    greedy = plan_memory(bufs, time_budget_s=0)
    assert_valid(bufs, greedy)
    assert plan_memory(bufs, time_budget_s=0).offsets == greedy.offsets
    assert plan.arena_bytes <= greedy.arena_bytes          # the search never makes it worse
    if plan.arena_bytes == plan.lower_bound_bytes:
        assert plan.optimal


@pytest.mark.parametrize("seed", range(6))
def test_numpy_and_python_placement_agree(seed):
    # The greedy rules have two implementations (pure Python for small pieces, numpy for large
    # ones); they must place every buffer identically, order by order.
    rng = random.Random(seed)
    n = rng.randint(30, 300)
    sig = sorted((s, s + rng.choice([1, 2, 5, 40]), rng.randint(1, 2000)) for s in rng.choices(range(60), k=n))
    pieces = {}
    for threshold in (10**9, 1):
        old = mp.NUMPY_MIN_BUFFERS
        mp.NUMPY_MIN_BUFFERS = threshold
        try:
            pieces[threshold] = mp._Piece(tuple(sig))
        finally:
            mp.NUMPY_MIN_BUFFERS = old
    python, vectorized = pieces[10**9], pieces[1]
    assert not python.use_numpy and vectorized.use_numpy
    for (method, best_fit, order), again in zip(python.orders(), vectorized.orders()):
        assert again[2] == order
        assert python.place(order, best_fit) == vectorized.place(order, best_fit), method
        shuffled = rng.sample(order, len(order))
        assert python.place(shuffled, best_fit) == vectorized.place(shuffled, best_fit), method


tiny_st = st.lists(st.tuples(st.integers(1, 8 * A), st.integers(0, 6), st.integers(1, 4)).map(
    lambda t: (t[0], t[1], t[1] + t[2])), min_size=1, max_size=6)


@settings(max_examples=120, deadline=None)
@given(tiny_st)
def test_tiny_instances_reach_the_brute_force_optimum(bufs):
    plan = plan_memory(bufs)
    assert_valid(bufs, plan)
    assert plan.arena_bytes == first_fit_brute_force(bufs)
    assert plan.optimal


# ------------------------------------------------------------------------------------------------
# Instances with a known optimum.

def test_disjoint_buffers_share_one_slot():
    bufs = [(1000 * (i + 1), 3 * i, 3 * i + 3) for i in range(10)]
    for budget in (0, None):
        plan = plan_memory(bufs, time_budget_s=budget)
        assert_valid(bufs, plan)
        assert plan.arena_bytes == plan.lower_bound_bytes == aligned(10000)
        assert set(plan.offsets) == {0} and plan.optimal
        assert plan.components == plan.distinct_components == 10


def test_all_overlapping_buffers_stack():
    bufs = [(1000 * (i + 1) + 7, i, 20 + i) for i in range(10)]
    plan = plan_memory(bufs, time_budget_s=0)
    assert_valid(bufs, plan)
    assert plan.arena_bytes == sum(aligned(b[0]) for b in bufs) == plan.lower_bound_bytes
    assert plan.optimal and plan.components == 1


def test_lifo_nesting_reaches_L():
    # a stack: buffer k lives over [k, 2n - k), with sizes in no particular order
    rng = random.Random(3)
    n = 30
    bufs = [(rng.randint(1, 10**6), k, 2 * n - k) for k in range(n)]
    # plus short temporaries at the top of the stack, between pushes and between pops
    bufs += [(rng.randint(1, 10**6), t, t + 1) for t in range(2 * n)]
    plan = plan_memory(bufs, time_budget_s=0)
    assert_valid(bufs, plan)
    assert plan.arena_bytes == plan.lower_bound_bytes and plan.optimal


# The whole greedy portfolio ends at 13 * A here; the optimum is L = 10 * A (at t=4: E, B, A fill
# it exactly; B=0, D=1, C=4, A=1, E=6 in units of A).
HARD = [(5 * A, 4, 5), (1 * A, 1, 6), (5 * A, 2, 3), (3 * A, 1, 4), (4 * A, 3, 5)]


def test_exact_search_beats_the_greedy_portfolio():
    greedy = plan_memory(HARD, time_budget_s=0)
    assert_valid(HARD, greedy)
    assert greedy.arena_bytes == 13 * A and not greedy.optimal
    assert greedy.method.startswith(("best-fit/", "first-fit/"))
    exact = plan_memory(HARD, time_budget_s=2.0)
    assert_valid(HARD, exact)
    assert exact.arena_bytes == exact.lower_bound_bytes == 10 * A == first_fit_brute_force(HARD)
    assert exact.method == "exact" and exact.optimal
    assert exact.solve_time_s < 1.0     # it stops as soon as it reaches L


# Here no placement reaches L = 5 (alignment 1): the exact search must prove that 6 is optimal.
GAP = [(2, 0, 1), (3, 0, 2), (1, 1, 3), (1, 2, 3), (1, 1, 4), (2, 2, 4), (2, 4, 5), (1, 4, 5), (2, 3, 6), (3, 5, 6)]


def test_exact_search_proves_an_optimum_above_L():
    assert not fits_exhaustive(GAP, 5) and fits_exhaustive(GAP, 6)
    plan = plan_memory(GAP, alignment=1)
    assert_valid(GAP, plan, a=1)
    assert (plan.arena_bytes, plan.lower_bound_bytes) == (6, 5)
    assert plan.optimal                  # proved, although arena > L
    greedy = plan_memory(GAP, alignment=1, time_budget_s=0)
    assert greedy.arena_bytes == 6 and not greedy.optimal   # greedy alone cannot know


# ------------------------------------------------------------------------------------------------
# MemoryPlan.check

def test_check_rejects_overlap_of_buffers_live_at_once_and_names_both():
    bufs = [Buffer(1000, 0, 4, "gather.w1", "gathered"), Buffer(600, 10, 12, "tmp"),
            Buffer(2000, 2, 6, "act.3", "activation")]
    plan = plan_memory(bufs)
    plan.check(bufs)
    broken = dataclasses.replace(plan, offsets=(0, 0, 512))
    with pytest.raises(MemoryPlanError) as exc:
        broken.check(bufs)
    msg = str(exc.value)
    assert "#0 'gather.w1' [0, 4)" in msg and "#2 'act.3' [2, 6)" in msg
    assert "[0, 1024)" in msg and "[512, 2560)" in msg and "overlap" in msg


def test_check_allows_sharing_between_touching_intervals():
    bufs = [(1000, 0, 2), (1000, 2, 4)]
    MemoryPlan(offsets=(0, 0), arena_bytes=1024, lower_bound_bytes=1024, alignment=A, method="hand",
               optimal=True, solve_time_s=0.0, components=2, distinct_components=1).check(bufs)
    plan = plan_memory(bufs)
    assert plan.offsets == (0, 0) and plan.arena_bytes == 1024


@pytest.mark.parametrize("change, words", [
    (dict(offsets=(0, 100)), "multiple of 512"),
    (dict(offsets=(0, -512)), "non-negative"),
    (dict(offsets=(0,)), "1 offsets for 2 buffers"),
    (dict(offsets=(0, 2048)), "past the arena"),
    (dict(offsets=(0, 512)), "overlap in address"),
])
def test_check_rejects_malformed_plans(change, words):
    bufs = [(1000, 0, 3), (1000, 1, 4)]
    plan = plan_memory(bufs)
    with pytest.raises(MemoryPlanError, match=words):
        dataclasses.replace(plan, **change).check(bufs)


# ------------------------------------------------------------------------------------------------
# Decomposition

def test_identical_windows_are_solved_once(monkeypatch):
    rng = random.Random(11)
    W = 20
    window = [(rng.randint(1, 10**6), s, s + rng.randint(1, 8)) for s in rng.choices(range(W - 8), k=25)]
    window.append((4096, 0, W))          # one buffer spans the window, so it is one piece
    single = plan_memory(window, time_budget_s=0.2)
    assert single.components == 1
    bufs = [(z, s + r * (W + r), e + r * (W + r)) for r in range(8) for z, s, e in window]   # uneven gaps
    perm = list(range(len(bufs)))
    rng.shuffle(perm)
    shuffled = [bufs[i] for i in perm]
    calls = []
    real = mp._greedy
    monkeypatch.setattr(mp, "_greedy", lambda *a: calls.append(1) or real(*a))
    plan = plan_memory(shuffled, time_budget_s=0.2)
    assert_valid(shuffled, plan)
    assert (plan.components, plan.distinct_components) == (8, 1) and len(calls) == 1
    assert plan.arena_bytes == single.arena_bytes and plan.lower_bound_bytes == single.lower_bound_bytes
    offsets = [0] * len(bufs)
    for k, i in enumerate(perm):
        offsets[i] = plan.offsets[k]
    n = len(window)
    assert all(offsets[r * n:(r + 1) * n] == offsets[:n] for r in range(8))   # the same offsets reused


def test_touching_windows_are_separate_pieces():
    bufs = [(1000, 0, 2), (3000, 1, 3), (2000, 3, 5), (500, 5, 6), (500, 5, 6)]
    plan = plan_memory(bufs)
    assert_valid(bufs, plan)
    assert plan.components == 3 and plan.distinct_components == 3
    assert plan.arena_bytes == plan.lower_bound_bytes == 4096


# ------------------------------------------------------------------------------------------------
# Inputs and validation

def test_input_forms_and_never_live_buffers():
    tuples = [(1000, 0, 5), (0, 1, 3), (700, 2, 2), (2000, 1, 3)]
    objs = [SimpleNamespace(size=z, start=s, end=e, name=f"b{i}") for i, (z, s, e) in enumerate(tuples)]
    named = [Buffer(z, s, e, f"b{i}", "temp") for i, (z, s, e) in enumerate(tuples)]
    plans = [plan_memory(x) for x in (tuples, objs, named, iter(tuples))]
    assert len({p.offsets for p in plans}) == 1
    plan = plans[0]
    assert plan.offsets[1] == plan.offsets[2] == 0          # never live: offset 0, ignored
    assert plan.arena_bytes == plan.lower_bound_bytes == 1024 + 2048
    assert plan_memory([]).arena_bytes == 0 and plan_memory([(0, 0, 9), (9, 3, 3)]).components == 0
    assert lower_bound_bytes([(1, 0, 2), (1, 2, 4)], alignment=1) == 1   # half-open: frees first


@pytest.mark.parametrize("bufs, kwargs, words", [
    ([(1, 0, 1), (-5, 0, 1)], {}, r"buffer #1 \[0, 1\): negative size -5"),
    ([(1, 0, 1), Buffer(8, 4, 2, "x")], {}, r"buffer #1 'x' \[4, 2\): end 2 < start 4"),
    ([(1.5, 0, 1)], {}, r"buffer #0: size must be an int, got 1.5"),
    ([(1, 0, "3")], {}, r"buffer #0: end must be an int"),
    ([(1, 0)], {}, r"buffer #0: expected a Buffer"),
    ([(1, 0, 1)], {"alignment": 0}, "positive power of two, got 0"),
    ([(1, 0, 1)], {"alignment": 384}, "positive power of two, got 384"),
    ([(1, 0, 1)], {"alignment": -512}, "positive power of two"),
    ([(1, 0, 1)], {"time_budget_s": -1}, "time_budget_s"),
])
def test_validation_errors(bufs, kwargs, words):
    with pytest.raises(MemoryPlanError, match=words):
        plan_memory(bufs, **kwargs)
    assert issubclass(MemoryPlanError, ValueError)


def test_str_and_alignment():
    plan = plan_memory([(100, 0, 2), (100, 1, 3)], alignment=64)
    assert plan.offsets in ((0, 128), (128, 0)) and plan.arena_bytes == 256 and plan.alignment == 64
    text = str(plan)
    assert "arena 256 B" in text and "L 256 B" in text and plan.method in text and "\n" not in text


# ------------------------------------------------------------------------------------------------
# Real traces: [size, start, end] of every buffer of one rank's training step, from the compiler's
# Programs. The pipeline-parallel one (872 buffers: sent activations held to the end of the step,
# receive buffers, nested forward/backward activations, temporaries) defeats every greedy rule by
# 3 %; on gpt-p2-s1 (248 buffers) the greedy portfolio and a short local search end 1.05 % above L.

TRACES = Path(__file__).parent / "data" / "memory_traces"


@pytest.mark.parametrize("name", ["bench-GPT-S2_t1_interleaved_v2.json", "gpt-p2-s1.json"])
def test_real_traces_within_one_percent_of_L(name):
    bufs = [tuple(b) for b in json.loads((TRACES / name).read_text())]
    if name.startswith("bench-"):
        greedy = plan_memory(bufs, time_budget_s=0)
        assert greedy.arena_bytes > 1.02 * greedy.lower_bound_bytes      # hard for the greedy portfolio
    plan = plan_memory(bufs)
    assert_valid(bufs, plan)
    assert plan.arena_bytes <= 1.01 * plan.lower_bound_bytes, str(plan)
    assert plan_memory(bufs).offsets == plan.offsets                  # deterministic


def skyline_alone(bufs, work_cap: int):
    """The squeaky-wheel skyline without the rest of the planner; (plan, aligned buffers, runs)."""
    from micscompile.memory.skyline import skyline_search
    p = mp._Piece(tuple(sorted((s, e, -(-z // A)) for z, s, e in bufs if live((z, s, e)))))
    res = skyline_search(p.u, p.sc, p.ec, p.T, target=p.L, deadline=time.perf_counter() + 60, work_cap=work_cap)
    assert res.offsets is not None and res.arena >= p.L
    plan = MemoryPlan(offsets=tuple(o * A for o in res.offsets), arena_bytes=res.arena * A,
                      lower_bound_bytes=p.L * A, alignment=A, method="skyline", optimal=False,
                      solve_time_s=0.0, components=1, distinct_components=1)
    return plan, [(u * A, s, e) for u, s, e in zip(p.u, p.s, p.e)], res.runs


def test_skyline_search_alone_on_the_pipeline_trace():
    bufs = json.loads((TRACES / "bench-GPT-S2_t1_interleaved_v2.json").read_text())
    plan, aligned_bufs, runs = skyline_alone(bufs, 10**7)
    plan.check(aligned_bufs)
    assert plan.arena_bytes <= 1.01 * plan.lower_bound_bytes and runs > 1


@settings(max_examples=100, deadline=None)
@given(st.lists(buffer_st, min_size=1, max_size=30).filter(lambda bs: any(live(b) for b in bs)))
def test_skyline_placements_are_valid(bufs):
    plan, aligned_bufs, _ = skyline_alone(bufs, 20_000)
    assert_valid(aligned_bufs, plan)


# ------------------------------------------------------------------------------------------------
# Scale

def transformer_trace(layers: int = 100, saved: int = 8, temps: int = 12, seed: int = 0) -> list[Buffer]:
    """Forward: every layer saves ``saved`` activations (a growing stack) with short temporaries
    around each; backward mirrors it, each activation dying at its backward step."""
    rng = random.Random(seed)
    bufs: list[Buffer] = []
    born = {}
    t = 0

    def temporaries(tag: str) -> None:
        for j in range(temps):
            bufs.append(Buffer(rng.randint(1, 8 << 20), t, t + rng.randint(1, 3), f"{tag}.tmp{j}", "temporary"))

    for layer in range(layers):
        for k in range(saved):
            born[layer, k] = t
            temporaries(f"fwd{layer}.{k}")
            t += 1
    for layer in reversed(range(layers)):
        for k in reversed(range(saved)):
            temporaries(f"bwd{layer}.{k}")
            bufs.append(Buffer(rng.randint(1, 4 << 20), born[layer, k], t + 1, f"act{layer}.{k}", "activation"))
            t += 1
    return bufs


def test_scale_20000_buffers_greedy():
    """The greedy plan of 20k buffers is tight, and its time grows near-linearly from 5k buffers (5.8x
    measured for 4x the buffers; a quadratic placement would take 16x), whatever the machine's speed."""
    small = transformer_trace(layers=25)
    t0 = time.perf_counter()
    plan_memory(small, time_budget_s=0)
    small_s = time.perf_counter() - t0
    bufs = transformer_trace()
    assert len(bufs) == 20_000 == 4 * len(small)
    t0 = time.perf_counter()
    plan = plan_memory(bufs, time_budget_s=0)
    elapsed = time.perf_counter() - t0
    plan.check(bufs)
    ratio = plan.arena_bytes / plan.lower_bound_bytes
    print(f"\n20k buffers: {plan}; arena/L = {ratio:.6f}, {elapsed:.2f} s ({elapsed / small_s:.1f}x 5k buffers)")
    assert elapsed < 10 * small_s
    assert ratio <= 1.05
    assert plan.components == 1
