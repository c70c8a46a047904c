"""Sharded state dicts for ``torch.distributed.checkpoint`` (DCP), keyed by global FQNs.

A rank holds, of each parameter, a contiguous range ``[lo, hi)`` of its flattened
elements (``sharding.py``): not a rectangular block, so neither ``DTensor``'s even
``Shard(0)`` nor one chunk per rank can describe it. ``FlatShards`` presents it to DCP
with the parameter's real shape and the range split into the few rectangular boxes
that cover it exactly (``flat_boxes``: a partial row, whole rows, a partial row, at
every depth), each a view of the live shard. DCP's checkpointable protocol (the
three ``__..__`` methods that ``DTensor`` also implements) does the rest: ``dcp.save``
writes each box once (replicas write the same boxes and DCP keeps one), and
``dcp.load`` reads into the boxes of whatever plan loads it, in place. So a
checkpoint saved under one plan loads under another (p, S, world size), and into a
plain ``model.state_dict()`` in a single process.

Layout of the dict (torch's own FQN format, as ``get_state_dict`` returns it):
``{"model": {fqn: ...}, "optim": {"state": {fqn: {key: ...}}, "param_groups": [...]},
"steps": n}``. Optimizer state shaped like a parameter's piece is sharded like the
parameter; the rest (step counters) is replicated and saved once.

A parameter several pipeline chunks hold (a tied weight) is written from one chunk
(the lowest index) and read into every chunk holding it.

With tensor parallelism a rank's range is of its tensor rank's piece (``core.tensor_layout``): each
box of the piece is placed in the full tensor (``global_boxes``: cut where the piece's run of a
segment ends), so the checkpoint holds full tensors whatever tp saved it, and any tp loads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from micscompile.core.errors import InputError, MissingKeyError, UsageError
from micscompile.core.tensor_layout import Placement, global_boxes, local_piece, piece_shape


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Rectangular boxes ``(offsets, sizes, first flat index)`` that cover exactly the flattened
    elements ``[lo, hi)`` of a row-major tensor of ``shape``, in order (each box is contiguous)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [((first, *o), (1, *s), first * inner + start)
                for o, s, start in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)]
    boxes = []
    if lo % inner:  # the partial first row
        boxes += flat_boxes(shape, lo, (first + 1) * inner)
        first += 1
    end = hi // inner  # rows [first, end) are whole
    if end > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:]), first * inner))
    if hi % inner:  # the partial last row
        boxes += flat_boxes(shape, end * inner, hi)
    return boxes


@dataclass(frozen=True)
class Part:
    """One piece of a parameter (or of optimizer state shaped like it) on this rank."""

    values: torch.Tensor
    """1-D: the flattened elements [lo, lo + numel) (a view of the live shard)."""
    lo: int
    write: bool
    """Saved from here (False: only loaded into, e.g. a tied weight's second chunk)."""


class FlatShards(torch.Tensor):
    """This rank's pieces of one global tensor, for DCP: metadata only (shape, dtype), no data
    of its own; ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
    hand DCP the boxes, views of the live shards."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], parts: list[Part], owner: object, tensor: TensorPiece | None = None):
        """``shape``: the full tensor's; ``tensor``: the parts are ranges of this tensor rank's piece."""
        first = parts[0].values
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)
        self._properties = TensorProperties(dtype=first.dtype)
        self._owner = owner
        self._boxes = []  # (ChunkStorageMetadata, view, write): writable boxes first
        placement, rank, tp = tensor or (Placement("R"), 0, 1)
        local = piece_shape(tuple(shape), placement, tp)
        for part in sorted(parts, key=lambda p: not p.write):
            n = part.values.numel()
            for offsets, sizes, start in flat_boxes(local, part.lo, part.lo + n):
                view = part.values[start - part.lo : start - part.lo + math.prod(sizes)].view(sizes)
                for at, size, cut in global_boxes(offsets, sizes, placement, rank, tp, local):
                    box = view if size == sizes else view.narrow(placement.dim, cut, size[placement.dim])
                    chunk = ChunkStorageMetadata(offsets=torch.Size(at), sizes=torch.Size(size))
                    self._boxes.append((chunk, box, part.write))
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UsageError(f"FlatShards is a checkpoint view (pass it to torch.distributed.checkpoint), "
                           f"not a tensor to compute with: {func}")

    def __repr__(self) -> str:  # noqa: D105
        return f"FlatShards(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={len(self._boxes)})"

    # ---- DCP's checkpointable protocol ----------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=self._properties, size=self.shape))
            for chunk, _, write in self._boxes if write
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for chunk, _, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._boxes):
            chunk, view, _ = self._boxes[index.index]
            if chunk.offsets == index.offset:
                return view
        for chunk, view, _ in self._boxes:
            if chunk.offsets == index.offset:
                return view
        raise InputError(f"no box at {index.offset} for {index.fqn}")


@dataclass(frozen=True)
class TensorPiece:
    """A tensor-parallel parameter's piece on this rank: its placement, the tensor rank and tp."""

    placement: Placement
    rank: int
    tp: int

    def __iter__(self):
        return iter((self.placement, self.rank, self.tp))


@dataclass(frozen=True)
class Home:
    """Where one parameter's piece lives on this rank."""

    fqn: str
    """Canonical FQN."""
    shape: tuple[int, ...]
    """The full parameter's."""
    lo: int
    values: torch.Tensor
    """1-D view of the live shard (possibly empty)."""
    param: nn.Parameter | None
    """The optimizer's Parameter for this piece (None: not trainable)."""
    write: bool = True
    tensor: TensorPiece | None = None
    """Set: ``lo`` and ``values`` are of this tensor rank's piece."""


def _by_fqn(homes: Iterable[Home]) -> dict[str, list[Home]]:
    out: dict[str, list[Home]] = {}
    for h in homes:
        out.setdefault(h.fqn, []).append(h)
    return out


def _is_sharded(value: object, param: nn.Parameter) -> bool:
    """Optimizer state shaped like the parameter's piece is sharded like it (exp_avg, momentum)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == param.shape


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give a fresh optimizer its state (the tensors ``dcp.load`` fills) with one step at learning
    rate 0 on zero gradients, as ``torch.distributed.checkpoint.state_dict`` does; the parameters do
    not change. True if it ran (the caller drops that state again unless a checkpoint fills it)."""
    if optimizer.state:
        return False
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in g["params"]:
            if p.grad is not None:
                p.grad.zero_()
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    return True


def build(homes: list[Home], optimizer: torch.optim.Optimizer, buffers: dict[str, torch.Tensor],
          aliases: dict[str, list[str]], steps: int, owner: object, optimizer_homes: list[Home] | None = None) -> dict:
    """The sharded state dict (module docstring) over live storage: the parameters from ``homes``, the
    optimizer state from ``optimizer_homes`` (default: the same; the optimizer's smaller pieces with
    ``optimizer_sharding="world"``)."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    names = {}
    for fqn, hs in _by_fqn(homes).items():
        shards = FlatShards(hs[0].shape, [Part(h.values, h.lo, h.write) for h in hs], owner, hs[0].tensor)
        for alias in aliases.get(fqn, [fqn]):
            model[alias] = shards
    for fqn, hs in _by_fqn(homes if optimizer_homes is None else optimizer_homes).items():
        held = [(h, optimizer.state[h.param]) for h in hs if h.param is not None and h.param in optimizer.state]
        for h in hs:
            if h.param is not None:
                names[id(h.param)] = fqn
        if not held:
            continue
        entry = {}
        for key, value in held[0][1].items():
            if _is_sharded(value, held[0][0].param):
                entry[key] = FlatShards(hs[0].shape, [Part(st[key], h.lo, h.write) for h, st in held], owner,
                                        hs[0].tensor)
            else:
                entry[key] = value  # replicated (a step counter): saved once, loaded into every copy
        state[fqn] = entry
    model.update(buffers)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "steps": steps}


def _load_values(dst: list[tuple[torch.Tensor, int]], src: object, what: str, owner: object,
                 tensor: TensorPiece | None = None) -> None:
    """Fill pieces ``(values, lo)`` (of ``tensor``'s piece, if set) from ``src``: a FlatShards of this step
    (``dcp.load`` already wrote it in place) or a full tensor (e.g. a plain ``model.state_dict()``'s)."""
    if isinstance(src, FlatShards):
        if src._owner is not owner:
            raise InputError(f"{what}: a FlatShards from another step; pass the dict this step's "
                             "state_dict() returned (after dcp.load), or full tensors")
        return
    if not isinstance(src, torch.Tensor):
        raise InputError(f"{what}: expected a tensor, got {type(src).__name__}")
    flat = (src.detach() if tensor is None else local_piece(src.detach(), *tensor)).reshape(-1)
    for values, lo in dst:
        values.copy_(flat[lo : lo + values.numel()])


def apply(sd: dict, homes: list[Home], optimizer: torch.optim.Optimizer, buffers: dict[str, torch.Tensor],
          owner: object, optimizer_homes: list[Home] | None = None) -> int:
    """Load ``sd`` (``build``'s layout) into the live shards, buffers and optimizer; returns its step count."""
    missing = [k for k in ("model", "optim", "steps") if k not in sd]
    if missing:
        raise MissingKeyError(f"state dict has no {missing}: expected the layout step.state_dict() returns")
    model, optim = sd["model"], sd["optim"]
    for fqn, hs in _by_fqn(homes).items():
        if fqn not in model:
            raise MissingKeyError(f"state dict has no parameter {fqn!r}")
        _load_values([(h.values, h.lo) for h in hs], model[fqn], f"model.{fqn}", owner, hs[0].tensor)
    optimizer_homes = homes if optimizer_homes is None else optimizer_homes
    for fqn, hs in _by_fqn(optimizer_homes).items():
        saved = optim["state"].get(fqn)
        if saved is None:
            continue
        for h in hs:
            if h.param is None:
                continue
            st = optimizer.state[h.param]
            for key, value in saved.items():
                if key in st and _is_sharded(st[key], h.param):
                    _load_values([(st[key], h.lo)], value, f"optim.state.{fqn}.{key}", owner, h.tensor)
                elif isinstance(value, torch.Tensor):
                    if key in st and st[key] is value:
                        continue
                    st[key] = value.detach().clone().to(st[key].device if key in st else value.device)
                else:
                    st[key] = value
    for name, buf in buffers.items():
        if name in model and model[name] is not buf:
            buf.copy_(model[name])
    names = {id(h.param): h.fqn for h in optimizer_homes if h.param is not None}
    for group in optimizer.param_groups:
        first = next((names[id(p)] for p in group["params"] if id(p) in names), None)
        saved = next((g for g in optim["param_groups"] if first in g["params"]), None)
        if saved is not None:  # (the kernel, fused or foreach, and capturable are the loading step's own choice)
            group.update({k: v for k, v in saved.items() if k not in ("params", "fused", "foreach", "capturable")})
    return int(sd["steps"])


class Checkpointable:
    """``state_dict`` / ``load_state_dict`` for a step class that provides ``_homes()``,
    ``_state_buffers()``, ``graph`` (its ``param_aliases``), ``optimizer`` and ``steps``, and an fp16
    step's ``loss_scaler`` (saved under "loss_scale")."""

    loss_scaler = None
    _provisional = False
    """The optimizer state exists only because ``state_dict`` made it (no step has run): the next
    step drops it, so training goes on exactly as if it had never been made."""

    def state_dict(self) -> dict:
        """Sharded parameters, buffers and optimizer state under global FQNs, over this step's live
        storage, for ``torch.distributed.checkpoint``::

            dcp.save(step.state_dict(), checkpoint_id=path)
            sd = step.state_dict(); dcp.load(sd, checkpoint_id=path); step.load_state_dict(sd)

        Any plan (p, S, world size) loads what any other saved; a plain single-process model loads
        the parameters with ``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``.
        No collective: DCP's own planning exchanges what it needs (but with ``optimizer_sharding="world"``
        and low-precision gathers, an all-gather of the fp32 master rows over the replicas first)."""
        self._settle(exact=True)
        if init_optimizer_state(self.optimizer):
            self._provisional = True
        sd = build(self._homes(), self.optimizer, self._state_buffers(), self.graph.param_aliases,
                   self.steps, self, self._homes(optimizer=True))
        if self.loss_scaler is not None:  # fp16: the dynamic loss scale
            sd["loss_scale"] = self.loss_scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Take ``sd``: the dict ``state_dict()`` returned, after ``dcp.load`` filled it (nothing to
        copy), or one with full tensors (e.g. ``{"model": model.state_dict(), "optim": ..., "steps": n}``)."""
        self._settle()
        init_optimizer_state(self.optimizer)
        self.steps = apply(sd, self._homes(), self.optimizer, self._state_buffers(), self, self._homes(optimizer=True))
        if self.loss_scaler is not None and "loss_scale" in sd:
            self.loss_scaler.load_state_dict(sd["loss_scale"])
        self._provisional = self.steps == 0
        if getattr(self, "_graphed", None) is not None:  # the loaded tensors are new: the next call captures anew
            self._graphed.graph = None

    def _settle(self, exact: bool = False) -> None:
        """Wait for what the last step left in flight on the shards (none by default)."""

    def _drop_provisional_state(self) -> None:
        if self._provisional:
            self.optimizer.state.clear()
            self._provisional = False
