"""How parameters are laid out in shards and gather buffers.

A bucket is the concatenation of its parameters, flattened, in order, padded with
zeros at the end to a multiple of p (``padded_numel``). Partition-group rank r owns
the contiguous elements ``[r * row_numel, (r + 1) * row_numel)`` of that flat
buffer. So the all-gather of the shards *is* the flat bucket: each parameter is a
zero-copy view of it, and gradients pack into it with one concatenation, whose
reduce-scatter hands rank r its own range. A parameter's local piece is the part of
its flattened elements that falls in the rank's range (1-D, possibly empty); the
optimizer sees those pieces, which is exact for elementwise optimizers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from micscompile.core.errors import InputError


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket's flat buffer."""

    name: str
    """Canonical FQN."""
    shape: tuple[int, ...]
    numel: int
    offset: int
    """Index of the parameter's first element in the bucket's flat buffer."""


@dataclass(frozen=True)
class BucketLayout:
    """One gather/reduce-scatter unit: parameters gathered together."""

    index: int
    name: str
    """The block(s) the bucket holds, e.g. "blocks.3" or "emb+blocks.0"."""
    slots: tuple[ParamSlot, ...]
    partition_size: int
    row_numel: int
    """Elements of the bucket per rank (its shard): ceil(numel / p)."""
    dtype: torch.dtype
    """The shards' (master weights') dtype."""
    param_dtype: torch.dtype | None = None
    """dtype of the gathered bucket (Plan.param_dtype); None: ``dtype``."""
    reduce_dtype: torch.dtype | None = None
    """dtype of the packed gradients and their reduction (Plan.reduce_dtype); None: ``dtype``."""

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.dtype

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.partition_size * self.row_numel

    @property
    def shard_bytes(self) -> int:
        """Bytes of one master shard (and of its gradient accumulator)."""
        return self.row_numel * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered bucket (padding included), in ``gather_dtype``."""
        return self.padded_numel * self.gather_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the packed gradient bucket, in ``grad_dtype``."""
        return self.padded_numel * self.grad_dtype.itemsize

    @property
    def grad_shard_bytes(self) -> int:
        """Bytes of one reduced gradient shard, in ``grad_dtype``."""
        return self.row_numel * self.grad_dtype.itemsize

    def local_range(self, slot: ParamSlot, shard_rank: int) -> tuple[int, int]:
        """[lo, hi) of ``slot``'s flattened elements that ``shard_rank`` owns (lo == hi: none)."""
        start = shard_rank * self.row_numel
        lo = min(max(start - slot.offset, 0), slot.numel)
        hi = min(max(start + self.row_numel - slot.offset, 0), slot.numel)
        return lo, max(lo, hi)

    def optimizer_layout(self, shards: int) -> BucketLayout:
        """The layout the optimizer sees when ``shards`` ranks split each shard (``Plan.optimizer_sharding=
        "world"``, ``shards`` = d): the bucket cut into p * d rows of ``row_numel / d``; rank
        ``shard_rank * d + q`` (q: its index among the replicas) steps row q of its shard."""
        if shards == 1:
            return self
        if self.row_numel % shards:
            raise InputError(f"bucket {self.name}: a shard of {self.row_numel} elements does not split into {shards}")
        return dataclasses.replace(self, partition_size=self.partition_size * shards, row_numel=self.row_numel // shards)

    def shard_offset(self, slot: ParamSlot, shard_rank: int) -> int:
        """Where ``slot``'s local piece starts in ``shard_rank``'s shard."""
        return slot.offset + self.local_range(slot, shard_rank)[0] - shard_rank * self.row_numel


def build_layouts(
    buckets: list[tuple[str, list[str]]],
    shapes: dict[str, torch.Size],
    partition_size: int,
    dtype: torch.dtype = torch.float32,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    row_multiple: int = 1,
) -> list[BucketLayout]:
    """Layouts for ``buckets`` = [(bucket name, [canonical param names])] in bucket order; the
    shards in ``dtype``, gathered in ``param_dtype`` and reduced in ``reduce_dtype`` (None: ``dtype``),
    each shard padded to a multiple of ``row_multiple`` elements (d with ``optimizer_sharding="world"``)."""
    same = {None, dtype}.__contains__
    layouts = []
    for index, (name, params) in enumerate(buckets):
        slots, offset = [], 0
        for pname in params:
            numel = math.prod(shapes[pname])
            slots.append(ParamSlot(pname, tuple(shapes[pname]), numel, offset))
            offset += numel
        row = -(-offset // partition_size)
        row += -row % row_multiple
        layouts.append(BucketLayout(index, name, tuple(slots), partition_size, row, dtype,
                                    None if same(param_dtype) else param_dtype,
                                    None if same(reduce_dtype) else reduce_dtype))
    return layouts


def local_piece(layout: BucketLayout, slot: ParamSlot, shard: torch.Tensor, shard_rank: int) -> torch.Tensor:
    """View of ``slot``'s local piece inside this rank's bucket ``shard``."""
    lo, hi = layout.local_range(slot, shard_rank)
    start = layout.shard_offset(slot, shard_rank)
    return shard[start : start + hi - lo]


def local_pieces(layouts, shards: list[torch.Tensor], shard_rank: int) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter in ``layouts`` (1-D, possibly empty), by canonical name."""
    return {slot.name: local_piece(lay, slot, shard, shard_rank)
            for lay, shard in zip(layouts, shards) for slot in lay.slots}


def shard_parameters(
    layouts, shards: list[torch.Tensor], grads: list[torch.Tensor], shard_rank: int, trainable, unused,
) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, Parameter) for each trainable parameter: this rank's piece (possibly empty), sharing the
    shard's storage, its ``.grad`` a view of the gradient shard; like eager, a parameter the loss does
    not reach has no gradient (the optimizer skips it)."""
    out = []
    for lay, shard, grad in zip(layouts, shards, grads):
        for slot in lay.slots:
            if slot.name in trainable:
                param = torch.nn.Parameter(local_piece(lay, slot, shard, shard_rank))
                param.grad = None if slot.name in unused else local_piece(lay, slot, grad, shard_rank)
                out.append((slot.name, param))
    return out


def shard_of(full: torch.Tensor, layout: BucketLayout, slot: ParamSlot, shard_rank: int) -> torch.Tensor:
    """``shard_rank``'s piece of a full parameter (1-D copy, possibly empty)."""
    lo, hi = layout.local_range(slot, shard_rank)
    return full.detach().reshape(-1)[lo:hi].clone()


def flat_view(buf: torch.Tensor, offset: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf[offset : offset + numel].view(shape)``, kept on a plain ``buf``: a gathered bucket or a
    gradient bucket is the same arena slot every step (``Arena.take``), so later steps dispatch no slice
    and view again (host time on a GPU; ~200 per micro-step for bench_peers' GPT). Each kept view is
    made on ``buf``'s storage (``set_``), not as a view of ``buf``, so it holds no reference back to
    it: no cycle, and a buffer allocated for one step frees as before. Anything else (a fake tensor
    while tracing, a parameter) gets a plain view."""
    if type(buf) is not torch.Tensor:
        return buf[offset : offset + numel].view(shape)
    views = buf.__dict__.setdefault("_mc_views", {})
    key = (offset, numel, shape)
    view = views.get(key)
    if view is None:
        view = views[key] = torch.empty(0, dtype=buf.dtype, device=buf.device).set_(
            buf.untyped_storage(), buf.storage_offset() + offset, shape)
    return view


def unpack_param(gathered: torch.Tensor, offset: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The full parameter as a view of the gathered flat bucket (or of the shard when p = 1)."""
    return flat_view(gathered, offset, numel, shape)


def pack_grads(layout: BucketLayout, grads: tuple[torch.Tensor | None, ...], out: torch.Tensor,
               written: tuple[int, ...] = ()) -> torch.Tensor:
    """Full gradients -> the bucket's flat ``[padded_numel]`` buffer ``out`` (in ``grad_dtype``; None =
    zero): each gradient copied, and cast, into its slot, whatever its strides; the padding zeroed.
    The slots in ``written`` are left as they are (their matmuls wrote them: ``collectives.accumulate_mm``)."""
    pairs = []
    for i, (slot, g) in enumerate(zip(layout.slots, grads)):
        if i in written:
            continue
        if g is None:
            flat_view(out, slot.offset, slot.numel, (slot.numel,)).zero_()
        else:
            pairs.append((flat_view(out, slot.offset, slot.numel, tuple(g.shape)), g))
    if pairs:
        torch._foreach_copy_(*map(list, zip(*pairs)))  # one dispatch for the bucket
    if layout.padded_numel > layout.numel:
        flat_view(out, layout.numel, layout.padded_numel - layout.numel, (layout.padded_numel - layout.numel,)).zero_()
    return out
