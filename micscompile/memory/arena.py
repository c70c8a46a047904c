"""One preallocated arena per rank: the collectives' buffers at compile-time offsets.

``mc.compile`` lists the buffers the step's collectives allocate (``lifetimes``:
gathered parameters, gradient buckets and their shards, hierarchical stages, pipeline
receive buffers), plans their offsets (``memory.planner``) and allocates the arena once.
Each allocation site takes the next planned slot: the order is the Program's, the
same every step, and every take is checked against the plan (name and size), so a
runtime that strayed from its Program fails loudly instead of corrupting a buffer.

Reuse is safe across the async collectives: a buffer's planned life runs from the
issue to the wait (an in-flight collective's buffers stay reserved), and on CUDA a
collective issued later waits for the compute stream's earlier work, so a later
collective into the same bytes never overtakes the last reader.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from micscompile.core.errors import Error
from micscompile.memory.planner import Buffer, MemoryPlan


class ArenaError(Error, RuntimeError):
    """The runtime asked for a buffer the plan does not have next (a bug, not bad input)."""


class Arena:
    def __init__(self, buffers: list[Buffer], plan: MemoryPlan, device: torch.device) -> None:
        self.buffers = buffers
        self.plan = plan
        self.storage = torch.empty(plan.arena_bytes, dtype=torch.uint8, device=device)
        self.cursor = 0
        self._views: dict[tuple, torch.Tensor] = {}
        """(slot, dtype, shape) -> the view ``take`` made of that slot once: the offsets are the same
        every step, so each later step reuses it instead of dispatching a slice and views again (on a
        GPU those dispatches are host time; a step takes ~200 buffers per micro-step)."""

    def begin_step(self) -> None:
        self.cursor = 0

    def end_step(self) -> None:
        if self.cursor != len(self.buffers):
            raise ArenaError(f"the step took {self.cursor} of the {len(self.buffers)} planned arena buffers")

    def take(self, name: str, numel: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The next planned buffer as a flat ``dtype`` tensor of ``numel`` elements (``shape``: viewed so)."""
        nbytes = numel * dtype.itemsize
        if self.cursor >= len(self.buffers):
            raise ArenaError(f"{name} ({nbytes} bytes): the step has used all {len(self.buffers)} planned buffers")
        want = self.buffers[self.cursor]
        if want.name != name or want.size != nbytes:
            raise ArenaError(f"arena buffer #{self.cursor}: the runtime asked for {name} ({nbytes} bytes), the plan "
                             f"has {want.name} ({want.size} bytes, {want.kind})")
        key = (self.cursor, dtype, shape)
        self.cursor += 1
        view = self._views.get(key)
        if view is None:
            offset = self.plan.offsets[key[0]]
            view = self.storage[offset : offset + nbytes].view(dtype)
            view = self._views[key] = view if shape is None else view.view(shape)
        return view


def _storage(t) -> torch.UntypedStorage | None:
    """A plain tensor's real storage; None for anything else (meta, a subclass, a freed storage)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        return None
    return storage


class OutsideArena(TorchDispatchMode):
    """Counts the bytes that ops allocate outside the arena while active: every op output whose
    storage is new (not one of its inputs', not seen before) adds its bytes until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}

    def _freed(self, ptr: int) -> None:
        self.live_bytes -= self._live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        for t in tree_leaves(out):
            storage = _storage(t)
            if storage is None:
                continue
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and ptr not in inputs and ptr not in self._live:
                self._live[ptr] = nbytes
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(storage, self._freed, ptr)
        return out
