"""Simulator of PyTorch's CUDA caching allocator, default configuration.

Mirrors ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``
(pytorch/pytorch), so a trace of tensor allocations can be replayed to state
how much memory PyTorch would reserve, fragmentation included.

Terms (as upstream): a *segment* is one ``cudaMalloc`` result, returned to the
device only by ``release_cached_blocks`` when a new segment would not fit
``capacity_bytes``; a *block* is a contiguous piece of a segment (allocated or
free), linked to its address neighbours by ``prev``/``next``; a *pool* holds the
free blocks of the small (rounded size <= 1 MiB) or large pool, ordered by
(stream, size, address) like ``BlockComparatorSize``.  *allocated* bytes = sum of
allocated block sizes (rounded, after splitting); *reserved* = sum of segment
sizes; *requested* = sum of the original request sizes of live allocations.

Mirrored upstream identifiers: ``round_size``, ``get_pool``,
``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block`` (splitting), ``alloc_block`` (cudaMalloc, failing past the
capacity like the ``set_fraction`` check), ``release_cached_blocks`` /
``release_blocks`` / ``release_block``, ``free`` / ``free_block`` /
``try_merge_blocks``, and the stat peaks of ``increase_stat``.

NOT modelled: expandable segments, ``max_split_size`` (unlimited, so
``release_available_cached_blocks`` is a no-op as upstream),
roundup_power2_divisions, garbage_collection_threshold, CUDA events /
``recordStream`` cross-stream reuse (frees are immediate), IPC, CUDA-graph
private pools, free-memory callbacks, and fragmentation of device memory below
cudaMalloc (any segment that fits the capacity succeeds).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from micscompile.core.errors import Error, InputError

# Constants, names and values from c10/cuda/CUDACachingAllocator.cpp.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576  # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20971520  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152  # round up large allocations to 2 MiB


class OutOfMemoryError(Error, MemoryError):
    """A request did not fit ``capacity_bytes`` even after releasing cached segments."""


def round_size(size: int) -> int:
    """Upstream ``round_size`` without roundup_power2_divisions."""
    if size < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int) -> int:
    """Segment size cudaMalloc'ed for a rounded request (upstream ``get_allocation_size``)."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


@dataclass(frozen=True)
class AllocatorStats:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    peak_requested_bytes: int
    # reserved - allocated right after the malloc that first raised reserved to its peak
    # (cached but unused memory, i.e. fragmentation + segment slack, at the reserved peak)
    reserved_minus_allocated_at_peak_bytes: int
    segments: int  # cudaMalloc calls over the replay (upstream num_device_alloc)
    segments_released: int  # segments returned by release_cached_blocks (num_device_free)
    num_splits: int  # blocks split by alloc_found_block
    num_cache_flushes: int  # release_cached_blocks calls (alloc retries after a failed cudaMalloc)
    final_reserved_bytes: int
    final_allocated_bytes: int


class BlockInfo(NamedTuple):
    ptr: int
    size: int
    allocated: bool
    stream: int
    is_small: bool
    segment_ptr: int
    segment_size: int
    requested_bytes: int


class _Block:
    __slots__ = ("ptr", "size", "stream", "small", "segment", "prev", "next", "allocated", "requested")

    def __init__(self, ptr: int, size: int, stream: int, small: bool, segment: int) -> None:
        self.ptr, self.size, self.stream, self.small, self.segment = ptr, size, stream, small, segment
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated, self.requested = False, 0


class CachingAllocator:
    """One device's caching allocator; ``malloc`` returns the block address as handle (0 for size 0)."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise InputError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # BlockPool.blocks of small_blocks / large_blocks: sorted (stream, size, ptr) keys
        self._pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._blocks: dict[int, _Block] = {}  # ptr -> block, every live block
        self._segments: dict[int, int] = {}  # segment base ptr -> size
        self._next_ptr = kRoundLarge  # fresh, never reused virtual addresses; 0 is null
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self._peak_alloc = self._peak_reserved = self._peak_requested = 0
        self._gap_at_peak = 0
        self._n_segments = self._n_released = self._n_splits = self._n_flushes = 0

    def malloc(self, size: int, stream: int = 0) -> int:
        if size < 0:
            raise InputError(f"negative allocation size {size}")
        if size == 0:  # upstream allocate(): nullptr for size 0, pools untouched
            return 0
        rounded = round_size(size)
        small = rounded <= kSmallSize  # get_pool
        alloc_size = get_allocation_size(rounded)
        new_peak = False
        block = self._get_free_block(rounded, stream, small)
        if block is None:
            block = self._alloc_block(alloc_size, stream, small)
            if block is None:  # release_available_cached_blocks is a no-op without max_split_size
                self._release_cached_blocks()
                block = self._alloc_block(alloc_size, stream, small)
            if block is None:
                raise OutOfMemoryError(self._oom_message(size, alloc_size, stream))
            new_peak = self.reserved_bytes > self._peak_reserved
            self._peak_reserved = max(self._peak_reserved, self.reserved_bytes)
        if self._should_split(block, rounded):  # alloc_found_block: allocated part keeps low address
            rest = _Block(block.ptr + rounded, block.size - rounded, stream, small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            self._blocks[rest.ptr] = rest
            bisect.insort(self._pools[small], (stream, rest.size, rest.ptr))
            self._n_splits += 1
        block.allocated, block.requested = True, size
        self.allocated_bytes += block.size
        self.requested_bytes += size
        self._peak_alloc = max(self._peak_alloc, self.allocated_bytes)
        self._peak_requested = max(self._peak_requested, self.requested_bytes)
        if new_peak:
            self._gap_at_peak = self.reserved_bytes - self.allocated_bytes
        return block.ptr

    def _get_free_block(self, size: int, stream: int, small: bool) -> _Block | None:
        """Best fit: lower_bound of (stream, size, nullptr) in the pool, same stream only."""
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (stream, size, 0))
        if i == len(pool) or pool[i][0] != stream:
            return None
        return self._blocks[pool.pop(i)[2]]

    @staticmethod
    def _should_split(block: _Block, size: int) -> bool:
        remaining = block.size - size
        return remaining >= kMinBlockSize if block.small else remaining > kSmallSize

    def _alloc_block(self, alloc_size: int, stream: int, small: bool) -> _Block | None:
        """cudaMalloc of a new segment; fails (None) past ``capacity_bytes``."""
        if self.capacity_bytes is not None and self.reserved_bytes + alloc_size > self.capacity_bytes:
            return None
        ptr = self._next_ptr
        self._next_ptr += -(-alloc_size // kRoundLarge) * kRoundLarge
        block = _Block(ptr, alloc_size, stream, small, ptr)
        self._blocks[ptr] = block
        self._segments[ptr] = alloc_size
        self.reserved_bytes += alloc_size
        self._n_segments += 1
        return block

    def _release_cached_blocks(self) -> None:
        """Return every free, unsplit segment to the device (large pool first, as upstream)."""
        self._n_flushes += 1
        for small in (False, True):
            keep = []
            for key in self._pools[small]:
                block = self._blocks[key[2]]
                if block.prev is None and block.next is None:  # release_block
                    del self._blocks[block.ptr], self._segments[block.ptr]
                    self.reserved_bytes -= block.size
                    self._n_released += 1
                else:
                    keep.append(key)
            self._pools[small] = keep

    def _oom_message(self, size: int, alloc_size: int, stream: int) -> str:
        unalloc = self.reserved_bytes - self.allocated_bytes
        return (
            f"simulated CUDA out of memory: tried to allocate {alloc_size / 2**20:.2f} MiB "
            f"({alloc_size} bytes, new segment for a {size}-byte request on stream {stream}); "
            f"capacity {self.capacity_bytes} bytes, of which {self.reserved_bytes} bytes are reserved "
            f"({self.allocated_bytes} allocated, {unalloc} reserved but unallocated in split segments "
            f"that cannot be released)"
        )

    def free(self, handle: int) -> None:
        if handle == 0:
            return
        block = self._blocks.get(handle)
        if block is None or not block.allocated:
            raise InputError(f"free of unknown or already freed handle {handle:#x}")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested = 0
        for candidate in (block.prev, block.next):  # free_block -> try_merge_blocks
            self._try_merge(block, candidate)
        bisect.insort(self._pools[block.small], (block.stream, block.size, block.ptr))

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated:
            return
        pool = self._pools[src.small]
        del pool[bisect.bisect_left(pool, (src.stream, src.size, src.ptr))]
        del self._blocks[src.ptr]
        if src is dst.prev:  # [src dst]: dst takes the lower address
            del self._blocks[dst.ptr]
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            self._blocks[dst.ptr] = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def blocks(self) -> list[BlockInfo]:
        """Every block (allocated or cached) in address order, like a memory snapshot."""
        return [
            BlockInfo(b.ptr, b.size, b.allocated, b.stream, b.small, b.segment, self._segments[b.segment], b.requested)
            for _, b in sorted(self._blocks.items())
        ]

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            self._peak_reserved, self._peak_alloc, self._peak_requested, self._gap_at_peak,
            self._n_segments, self._n_released, self._n_splits, self._n_flushes,
            self.reserved_bytes, self.allocated_bytes,
        )


def _as_triple(item: Any) -> tuple[int, int, int | None]:
    size, start, end = (item.size, item.start, item.end) if hasattr(item, "size") else item
    return int(size), int(start), None if end is None else int(end)


def replay_buffers(buffers: Iterable[Any], *, capacity_bytes: int | None = None,
                   timeline: list[tuple[int, int, int]] | None = None) -> AllocatorStats:
    """Replay buffers (``.size/.start/.end`` objects or ``(size, start, end)`` tuples).

    Each buffer of ``size`` bytes is live over the half-open step interval [start, end);
    ``end=None`` means never freed.  At each step, frees of buffers ending there come
    first (input order), then mallocs of buffers starting there (input order).  A buffer
    with ``start == end`` is still allocated at its step and freed right after that
    step's mallocs (a tensor produced and dropped at once still touches the allocator).
    Zero-size buffers get a null handle and never touch the pools.  Streams: all on 0.
    ``timeline``: a list that receives (step, reserved bytes, allocated bytes) after each step's
    mallocs (the memory-over-time picture).
    """
    items = [_as_triple(b) for b in buffers]
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    instant: dict[int, list[int]] = {}
    for i, (size, start, end) in enumerate(items):
        if size < 0 or (end is not None and end < start):
            raise InputError(f"buffer {i}: bad size/interval {(size, start, end)}")
        starts.setdefault(start, []).append(i)
        if end == start:
            instant.setdefault(start, []).append(i)
        elif end is not None:
            ends.setdefault(end, []).append(i)
    alloc = CachingAllocator(capacity_bytes)
    handles: dict[int, int] = {}
    for t in sorted(starts.keys() | ends.keys()):
        for i in ends.get(t, ()):
            alloc.free(handles.pop(i))
        for i in starts.get(t, ()):
            handles[i] = alloc.malloc(items[i][0])
        if timeline is not None:
            timeline.append((t, alloc.reserved_bytes, alloc.allocated_bytes))
        for i in instant.get(t, ()):
            alloc.free(handles.pop(i))
    return alloc.stats()
