"""How parameters are laid out in shards and gather buffers.

Each parameter is flattened and padded to a multiple of p; partition-group rank r
owns the r-th of p equal chunks (``chunk`` elements). A bucket concatenates its
parameters' chunks into one flat shard of ``row_numel`` elements per rank, so an
all-gather of the bucket's shard yields a ``[p, row_numel]`` buffer in which row r
is rank r's shard; parameter i occupies columns ``[offset, offset + chunk)`` of every
row. Padding elements are zero, receive zero gradient and are never read back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    name: str
    """Canonical FQN."""
    shape: tuple[int, ...]
    numel: int
    chunk: int
    """Elements of this parameter per rank: ceil(numel / p)."""
    offset: int
    """Column of the first element of this parameter's chunk in the bucket row."""


@dataclass(frozen=True)
class BucketLayout:
    """One gather/reduce-scatter unit: parameters gathered together."""

    index: int
    name: str
    """The block(s) the bucket holds, e.g. "blocks.3" or "emb+blocks.0"."""
    slots: tuple[ParamSlot, ...]
    partition_size: int
    row_numel: int
    """Elements of the bucket per rank (its shard), padding included."""
    dtype: torch.dtype

    @property
    def padded_numel(self) -> int:
        return self.partition_size * self.row_numel

    @property
    def shard_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered bucket (padding included)."""
        return self.padded_numel * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def slot(self, name: str) -> ParamSlot:
        return next(s for s in self.slots if s.name == name)


def build_layouts(
    buckets: list[tuple[str, list[str]]],
    shapes: dict[str, torch.Size],
    partition_size: int,
    dtype: torch.dtype = torch.float32,
) -> list[BucketLayout]:
    """Layouts for ``buckets`` = [(bucket name, [canonical param names])] in bucket order."""
    layouts = []
    for index, (name, params) in enumerate(buckets):
        slots, offset = [], 0
        for pname in params:
            numel = math.prod(shapes[pname])
            chunk = -(-numel // partition_size)
            slots.append(ParamSlot(pname, tuple(shapes[pname]), numel, chunk, offset))
            offset += chunk
        layouts.append(BucketLayout(index, name, tuple(slots), partition_size, offset, dtype))
    return layouts


def shard_of(full: torch.Tensor, slot: ParamSlot, partition_size: int, shard_rank: int) -> torch.Tensor:
    """Rank ``shard_rank``'s chunk of a full parameter (a copy, padded with zeros)."""
    flat = full.detach().reshape(-1)
    lo = min(shard_rank * slot.chunk, slot.numel)
    hi = min(lo + slot.chunk, slot.numel)
    out = flat.new_zeros(slot.chunk)
    out[: hi - lo] = flat[lo:hi]
    return out


def unpack_param(
    gathered: torch.Tensor, partition_size: int, row_numel: int, offset: int, chunk: int,
    numel: int, shape: tuple[int, ...],
) -> torch.Tensor:
    """The full parameter from a gathered ``[p * row_numel]`` bucket buffer."""
    cols = gathered.view(partition_size, row_numel)[:, offset : offset + chunk]
    return cols.reshape(-1)[:numel].view(shape)


def pack_grads(layout: BucketLayout, grads: tuple[torch.Tensor | None, ...], like: torch.Tensor) -> torch.Tensor:
    """Full gradients -> a ``[p * row_numel]`` buffer in gather layout (None = zero)."""
    p = layout.partition_size
    flat = like.new_empty(layout.padded_numel, dtype=layout.dtype)
    rows = flat.view(p, layout.row_numel)
    for slot, grad in zip(layout.slots, grads):
        cols = rows[:, slot.offset : slot.offset + slot.chunk]
        if grad is None:
            cols.zero_()
            continue
        g = grad.reshape(-1)
        pad = p * slot.chunk - slot.numel
        if pad:
            g = torch.nn.functional.pad(g, (0, pad))
        cols.copy_(g.view(p, slot.chunk))
    return flat
