"""Tests for the PyTorch CUDA caching-allocator simulator (micscompile/cost_model/caching_allocator.py)."""

from __future__ import annotations

from collections import namedtuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from micscompile.cost_model.caching_allocator import (
    AllocatorStats,
    CachingAllocator,
    OutOfMemoryError,
    get_allocation_size,
    kLargeBuffer,
    kMinBlockSize,
    kSmallBuffer,
    kSmallSize,
    replay_buffers,
    round_size,
)

KiB = 1 << 10
MiB = 1 << 20


def _free_blocks(alloc: CachingAllocator) -> list:
    return [b for b in alloc.blocks() if not b.allocated]


# --- sizes ---------------------------------------------------------------------------


def test_constants_match_upstream() -> None:
    assert (kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer) == (512, MiB, 2 * MiB, 20 * MiB)


@pytest.mark.parametrize(
    ("request_bytes", "rounded"),
    [(1, 512), (100, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)],
)
def test_round_size(request_bytes: int, rounded: int) -> None:
    assert round_size(request_bytes) == rounded


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (5 * MiB, 20 * MiB),
     (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB), (12 * MiB, 12 * MiB), (13 * MiB, 14 * MiB)],
)
def test_get_allocation_size(rounded: int, segment: int) -> None:
    assert get_allocation_size(rounded) == segment


def test_100_bytes_allocates_512() -> None:
    alloc = CachingAllocator()
    alloc.malloc(100)
    s = alloc.stats()
    assert (s.peak_allocated_bytes, s.peak_requested_bytes, s.peak_reserved_bytes) == (512, 100, 2 * MiB)


def test_small_requests_share_one_2mib_segment() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1000)
    b = alloc.malloc(1000)
    assert b == a + 1024  # split: allocated part keeps the low address
    s = alloc.stats()
    assert (s.segments, s.peak_reserved_bytes, s.peak_allocated_bytes) == (1, 2 * MiB, 2048)
    assert [(f.ptr, f.size) for f in _free_blocks(alloc)] == [(a + 2048, 2 * MiB - 2048)]


def test_1mib_is_small_pool_and_1mib_plus_one_is_large() -> None:
    alloc = CachingAllocator()
    alloc.malloc(MiB)
    assert alloc.reserved_bytes == 2 * MiB
    alloc.malloc(MiB + 1)
    assert alloc.reserved_bytes == 22 * MiB
    assert alloc.allocated_bytes == MiB + MiB + 512


def test_5mib_reserves_20mib_and_second_reuses_remainder() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    assert (alloc.reserved_bytes, alloc.allocated_bytes) == (20 * MiB, 5 * MiB)
    b = alloc.malloc(5 * MiB)
    assert b == a + 5 * MiB
    s = alloc.stats()
    assert (s.segments, s.peak_reserved_bytes, s.peak_allocated_bytes) == (1, 20 * MiB, 10 * MiB)


def test_large_requests_round_to_2mib_segments() -> None:
    alloc = CachingAllocator()
    alloc.malloc(12 * MiB)
    assert alloc.reserved_bytes == 12 * MiB and alloc.allocated_bytes == 12 * MiB
    alloc.malloc(13 * MiB)
    # 14 MiB segment, remainder 1 MiB is not > kSmallSize: the whole block is allocated
    assert alloc.reserved_bytes == 26 * MiB and alloc.allocated_bytes == 26 * MiB
    assert alloc.stats().num_splits == 0 and _free_blocks(alloc) == []


@pytest.mark.parametrize(
    ("second", "split"), [(14 * MiB, False), (14 * MiB + 512, False), (14 * MiB - 512, True)]
)
def test_large_pool_split_rule(second: int, split: bool) -> None:
    alloc = CachingAllocator()
    alloc.malloc(5 * MiB)  # 20 MiB segment, 15 MiB free remainder
    alloc.malloc(second)
    assert alloc.stats().segments == 1
    if split:  # remainder 1 MiB + 512 > kSmallSize
        assert alloc.allocated_bytes == 5 * MiB + second
        assert [f.size for f in _free_blocks(alloc)] == [MiB + 512]
    else:  # remainder <= 1 MiB stays inside the allocated block
        assert alloc.allocated_bytes == 20 * MiB
        assert alloc.requested_bytes == 5 * MiB + second
        assert _free_blocks(alloc) == []


def test_small_pool_split_rule_keeps_512_byte_remainders() -> None:
    alloc = CachingAllocator()
    alloc.malloc(MiB)
    alloc.malloc(MiB - 1024 - 512)  # leaves 1536 bytes of the 2 MiB segment free
    alloc.malloc(1024)
    assert [f.size for f in _free_blocks(alloc)] == [512]  # remaining >= kMinBlockSize: split
    alloc.malloc(512)
    assert _free_blocks(alloc) == [] and alloc.stats().segments == 1


# --- free / merge / best fit ---------------------------------------------------------


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_merge_on_free(order: str) -> None:
    alloc = CachingAllocator()
    a, b, c = alloc.malloc(1024), alloc.malloc(3072), alloc.malloc(2048)
    for name in order:
        alloc.free({"a": a, "b": b}[name])
    free = _free_blocks(alloc)
    assert [(f.ptr, f.size) for f in free] == [(a, 4096), (c + 2048, 2 * MiB - 6144)]
    d = alloc.malloc(4096)  # fits only in the merged a+b block (best fit)
    assert d == a and alloc.stats().segments == 1
    alloc.free(c)  # c merges with its free successor; d still splits the segment
    alloc.free(d)  # everything merges back into one whole-segment block
    assert [(f.ptr, f.size) for f in _free_blocks(alloc)] == [(a, 2 * MiB)]


def test_merge_across_three_blocks_large_pool() -> None:
    alloc = CachingAllocator()
    a, b, c = alloc.malloc(4 * MiB), alloc.malloc(4 * MiB), alloc.malloc(4 * MiB)
    alloc.free(a)
    alloc.free(c)  # merges with the 8 MiB tail
    alloc.free(b)  # merges with both neighbours
    assert [(f.ptr, f.size) for f in _free_blocks(alloc)] == [(a, 20 * MiB)]
    assert alloc.malloc(18 * MiB) == a and alloc.stats().segments == 1


def test_best_fit_picks_smallest_fitting_block() -> None:
    alloc = CachingAllocator()
    big = alloc.malloc(3072)
    alloc.malloc(512)
    fit = alloc.malloc(2048)
    alloc.malloc(512)
    alloc.free(big)
    alloc.free(fit)
    assert alloc.malloc(2048) == fit  # 2 KiB hole beats the lower-address 3 KiB hole
    assert alloc.malloc(2048) == big  # then the 3 KiB hole (split), not the tail


def test_best_fit_ties_broken_by_lower_address() -> None:
    alloc = CachingAllocator()
    h1 = alloc.malloc(2048)
    alloc.malloc(512)
    h2 = alloc.malloc(2048)
    alloc.malloc(512)
    alloc.free(h2)
    alloc.free(h1)
    assert alloc.malloc(1024) == h1


def test_best_fit_across_segments_large_pool() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(30 * MiB)
    b = alloc.malloc(12 * MiB)
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(11 * MiB) == b  # 12 MiB segment, no split (remainder 1 MiB)
    assert alloc.stats().segments == 2 and alloc.allocated_bytes == 12 * MiB


def test_blocks_are_per_stream() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1000, stream=1)
    alloc.free(a)
    b = alloc.malloc(1000, stream=0)
    assert b != a and alloc.stats().segments == 2
    assert alloc.malloc(1000, stream=1) == a
    big = alloc.malloc(12 * MiB, stream=1)
    alloc.free(big)
    alloc.malloc(12 * MiB, stream=0)
    assert alloc.stats().segments == 4 and alloc.reserved_bytes == 4 * MiB + 24 * MiB


def test_small_and_large_pools_are_separate() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    alloc.free(a)  # 20 MiB free in the large pool
    alloc.malloc(100)  # small request: never served by the large pool
    assert alloc.stats().segments == 2


def test_free_errors_and_zero_size() -> None:
    alloc = CachingAllocator()
    assert alloc.malloc(0) == 0
    alloc.free(0)
    assert alloc.stats() == CachingAllocator().stats()
    a = alloc.malloc(10)
    alloc.free(a)
    with pytest.raises(ValueError, match="already freed"):
        alloc.free(a)
    with pytest.raises(ValueError):
        alloc.malloc(-1)


# --- capacity ------------------------------------------------------------------------


def test_capacity_releases_cached_segments_and_retries() -> None:
    alloc = CachingAllocator(capacity_bytes=40 * MiB)
    small = alloc.malloc(100)
    alloc.free(small)  # whole free 2 MiB segment
    a = alloc.malloc(12 * MiB)
    alloc.free(a)  # whole free 12 MiB segment
    alloc.malloc(30 * MiB)  # 2 + 12 + 30 > 40: release both cached segments, retry
    s = alloc.stats()
    assert (s.segments, s.segments_released, s.num_cache_flushes) == (3, 2, 1)
    assert s.final_reserved_bytes == 30 * MiB and s.peak_reserved_bytes == 30 * MiB
    assert alloc.blocks()[0].size == 30 * MiB


def test_capacity_without_pressure_keeps_cache() -> None:
    alloc = CachingAllocator(capacity_bytes=44 * MiB)
    a = alloc.malloc(12 * MiB)
    alloc.free(a)
    alloc.malloc(30 * MiB)
    s = alloc.stats()
    assert (s.segments_released, s.num_cache_flushes, s.final_reserved_bytes) == (0, 0, 42 * MiB)


def test_oom_when_split_segments_cannot_be_released() -> None:
    alloc = CachingAllocator(capacity_bytes=30 * MiB)
    a = alloc.malloc(5 * MiB)  # 20 MiB segment, split: not releasable
    with pytest.raises(OutOfMemoryError, match=r"out of memory.*tried to allocate 22\.00 MiB") as exc:
        alloc.malloc(22 * MiB)  # the 15 MiB free remainder is too small; 20 + 22 > 30
    msg = str(exc.value)
    assert "capacity 31457280 bytes" in msg and f"{15 * MiB} reserved but unallocated" in msg
    assert isinstance(exc.value, MemoryError)
    # state unchanged after the failed request; freeing makes room
    assert alloc.reserved_bytes == 20 * MiB and alloc.stats().num_cache_flushes == 1
    alloc.free(a)  # segment whole again: releasable
    alloc.malloc(22 * MiB)
    s = alloc.stats()
    assert alloc.reserved_bytes == 22 * MiB and (s.segments_released, s.num_cache_flushes) == (1, 2)


def test_replay_capacity_oom_raises() -> None:
    with pytest.raises(OutOfMemoryError):
        replay_buffers([(12 * MiB, 0, 2), (12 * MiB, 1, 3)], capacity_bytes=20 * MiB)


# --- replay --------------------------------------------------------------------------

Buf = namedtuple("Buf", "size start end")


def test_replay_free_before_malloc_at_same_step() -> None:
    s = replay_buffers([Buf(12 * MiB, 0, 2), Buf(12 * MiB, 2, 4)])
    assert (s.segments, s.peak_reserved_bytes, s.peak_allocated_bytes) == (1, 12 * MiB, 12 * MiB)
    overlapping = replay_buffers([(12 * MiB, 0, 3), (12 * MiB, 2, 4)])
    assert (overlapping.segments, overlapping.peak_reserved_bytes) == (2, 24 * MiB)


def test_replay_mallocs_in_input_order() -> None:
    five_first = replay_buffers([(5 * MiB, 0, 1), (15 * MiB, 0, 1)])
    assert five_first.peak_reserved_bytes == 20 * MiB  # 15 MiB fills the remainder exactly
    fifteen_first = replay_buffers([(15 * MiB, 0, 1), (5 * MiB, 0, 1)])
    assert fifteen_first.peak_reserved_bytes == 16 * MiB + 20 * MiB


def test_replay_accepts_unsorted_input_and_never_freed() -> None:
    s = replay_buffers([(MiB, 5, 9), (3 * MiB, 0, None), (0, 1, 2)])
    assert s.final_allocated_bytes == 3 * MiB and s.final_reserved_bytes == 22 * MiB
    assert s.peak_allocated_bytes == 4 * MiB and s.segments == 2


def test_replay_zero_size_and_empty() -> None:
    empty = replay_buffers([])
    assert replay_buffers([(0, 0, 1), (0, 1, 2)]) == empty
    assert empty.peak_reserved_bytes == 0 and empty.segments == 0


def test_replay_instant_buffer_is_allocated_then_freed() -> None:
    s = replay_buffers([(12 * MiB, 3, 3), (12 * MiB, 4, 5)])
    assert (s.segments, s.peak_allocated_bytes, s.final_allocated_bytes) == (1, 12 * MiB, 0)
    with pytest.raises(ValueError):
        replay_buffers([(1, 3, 2)])


def test_fragmentation_reserved_exceeds_allocated_peak() -> None:
    # five 4 MiB tensors tile one 20 MiB segment; freeing 1st and 3rd leaves two
    # non-adjacent 4 MiB holes, so an 8 MiB request needs a second segment.
    bufs = [(4 * MiB, 0, 2), (4 * MiB, 0, 5), (4 * MiB, 0, 2), (4 * MiB, 0, 5), (4 * MiB, 0, 5),
            (8 * MiB, 2, 5)]
    s = replay_buffers(bufs)
    assert s.peak_allocated_bytes == 20 * MiB and s.peak_requested_bytes == 20 * MiB
    assert s.peak_reserved_bytes == 40 * MiB and s.segments == 2
    assert s.reserved_minus_allocated_at_peak_bytes == 20 * MiB


def test_reserved_minus_allocated_at_peak() -> None:
    s = replay_buffers([(5 * MiB, 0, 2), (5 * MiB, 1, 2)])
    assert s.peak_reserved_bytes == 20 * MiB
    assert s.reserved_minus_allocated_at_peak_bytes == 15 * MiB  # measured after the first malloc
    assert isinstance(s, AllocatorStats)


# --- property tests ------------------------------------------------------------------

_sizes = st.one_of(
    st.integers(0, 3 * KiB),
    st.integers(1, 2 * MiB),
    st.integers(MiB, 24 * MiB),
    st.sampled_from([MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 13 * MiB, 20 * MiB]),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("m"), _sizes, st.integers(0, 1)),
        st.tuples(st.just("f"), st.integers(0, 10**6), st.just(0)),
    ),
    max_size=60,
)


def _check_invariants(alloc: CachingAllocator, live: dict[int, int]) -> None:
    blocks = alloc.blocks()
    segments: dict[int, int] = {}
    for b in blocks:
        assert b.segment_ptr <= b.ptr and b.ptr + b.size <= b.segment_ptr + b.segment_size
        assert b.size % kMinBlockSize == 0 and b.size > 0
        segments[b.segment_ptr] = b.segment_size
    # blocks tile each segment exactly, allocated ones never overlap, free ones are merged
    for prev, cur in zip(blocks, blocks[1:]):
        assert prev.ptr + prev.size <= cur.ptr
        if prev.segment_ptr == cur.segment_ptr:
            assert prev.ptr + prev.size == cur.ptr and prev.stream == cur.stream
            assert prev.allocated or cur.allocated
    for seg_ptr, seg_size in segments.items():
        assert sum(b.size for b in blocks if b.segment_ptr == seg_ptr) == seg_size
    allocated = [b for b in blocks if b.allocated]
    assert sorted(b.ptr for b in allocated) == sorted(p for p in live.values() if p)
    assert alloc.allocated_bytes == sum(b.size for b in allocated)
    assert alloc.requested_bytes == sum(b.requested_bytes for b in allocated)
    assert alloc.reserved_bytes == sum(segments.values())
    for b in allocated:
        assert b.size >= round_size(b.requested_bytes)
        assert b.is_small == (round_size(b.requested_bytes) <= kSmallSize)
    s = alloc.stats()
    assert s.peak_reserved_bytes >= s.peak_allocated_bytes >= s.peak_requested_bytes
    assert s.peak_reserved_bytes >= alloc.reserved_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, capacity=st.one_of(st.none(), st.integers(20 * MiB, 120 * MiB)))
def test_random_traces_keep_invariants(ops: list, capacity: int | None) -> None:
    alloc = CachingAllocator(capacity)
    live: dict[int, int] = {}
    next_id = 0
    for kind, value, stream in ops:
        if kind == "m":
            try:
                live[next_id] = alloc.malloc(value, stream=stream)
            except OutOfMemoryError:
                assert capacity is not None
            next_id += 1
        elif live:
            key = sorted(live)[value % len(live)]
            alloc.free(live.pop(key))
        _check_invariants(alloc, live)
    if capacity is not None:
        assert alloc.stats().peak_reserved_bytes <= capacity


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_sizes, st.integers(0, 12), st.integers(0, 6)), max_size=30))
def test_replay_peaks_ordered(raw: list) -> None:
    bufs = [(size, start, start + dur) for size, start, dur in raw]
    s = replay_buffers(bufs)
    assert s.peak_reserved_bytes >= s.peak_allocated_bytes >= s.peak_requested_bytes
    assert s.final_allocated_bytes == 0 and s.final_reserved_bytes == s.peak_reserved_bytes
    # peak requested equals the true maximum live sum (instant buffers count at their step)
    steps = {t for _, a, b in bufs for t in (a, b)}
    live_max = max(
        [sum(sz for sz, a, b in bufs if a <= t < b or a == b == t) for t in steps], default=0
    )
    assert s.peak_requested_bytes == live_max
