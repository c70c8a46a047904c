"""Placements of a value on the tensor-parallel ranks, and the slicing they imply.

tp ranks (consecutive ranks inside one node: the "tensor" group) split each layer's compute. A
value's placement on them is one of:

* ``R``: replicated, every tensor rank holds all of it;
* ``S(d, k)``: sharded along dim ``d``, which is ``k`` equal segments each cut into tp contiguous
  pieces; tensor rank r holds piece r of every segment, in segment order (k > 1: a fused projection,
  q|k|v or gate|up, whose every part is split alike);
* ``P``: partial, every tensor rank holds a summand of it (a row-parallel matmul's output).

A parameter's placement is R or S: ``local_piece``/``assemble`` go between its full value and a
tensor rank's piece, the one rule the materialisation, the state dicts and the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    kind: str
    """"R", "S" or "P"."""
    dim: int = 0
    """S: the split dim (>= 0)."""
    segments: int = 1
    """S: the equal segments of ``dim``, each split across the tensor ranks."""
    pad: int = 0
    """S, a parameter's: zeros appended to ``dim`` so that tp divides it (a vocabulary tp does not divide, as
    Megatron-LM pads it); the full value is the first ``size - pad`` of the padded one, the last rank's piece
    ends in the zeros."""

    def __str__(self) -> str:
        if self.kind == "S":
            pad = f"+{self.pad}" if self.pad else ""
            return f"S({self.dim}{pad})" if self.segments == 1 else f"S({self.dim}{pad}, x{self.segments})"
        return self.kind

    def moved(self, dim: int) -> Placement:
        return Placement("S", dim, self.segments)


R = Placement("R")
P = Placement("P")


def S(dim: int, segments: int = 1, pad: int = 0) -> Placement:  # noqa: N802 - the placement's name
    return Placement("S", dim, segments, pad)


def piece_shape(shape: tuple[int, ...], placement: Placement, tp: int) -> tuple[int, ...]:
    """The shape of a tensor rank's piece of a value of full ``shape``."""
    if placement.kind != "S":
        return tuple(shape)
    return (*shape[:placement.dim], (shape[placement.dim] + placement.pad) // tp, *shape[placement.dim + 1:])


def full_shape(shape: tuple[int, ...], placement: Placement, tp: int) -> tuple[int, ...]:
    """``piece_shape``'s inverse: the full value's shape from a piece's."""
    if placement.kind != "S":
        return tuple(shape)
    return (*shape[:placement.dim], shape[placement.dim] * tp - placement.pad, *shape[placement.dim + 1:])


def local_piece(full: torch.Tensor, placement: Placement, rank: int, tp: int) -> torch.Tensor:
    """Tensor rank ``rank``'s piece of ``full`` (a view where the split allows it; a copy where it is padded)."""
    if placement.kind != "S" or tp == 1:
        return full
    d, k = placement.dim, placement.segments
    if placement.pad:
        full = torch.cat([full, full.new_zeros(*full.shape[:d], placement.pad, *full.shape[d + 1:])], d)
    shape = full.shape
    split = full.reshape(*shape[:d], k, tp, shape[d] // (k * tp), *shape[d + 1:])
    return split.select(d + 1, rank).reshape(*shape[:d], shape[d] // tp, *shape[d + 1:])


def assemble(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The full value from every tensor rank's piece, in rank order (``local_piece``'s inverse)."""
    if placement.kind != "S" or len(pieces) == 1:
        return pieces[0]
    d, k, tp = placement.dim, placement.segments, len(pieces)
    shape = pieces[0].shape
    split = [p.reshape(*shape[:d], k, shape[d] // k, *shape[d + 1:]) for p in pieces]
    full = torch.stack(split, d + 1).reshape(*shape[:d], shape[d] * tp, *shape[d + 1:])
    return full.narrow(d, 0, shape[d] * tp - placement.pad) if placement.pad else full


def global_boxes(offsets: tuple[int, ...], sizes: tuple[int, ...], placement: Placement, rank: int, tp: int,
                 local_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """A box (``offsets``, ``sizes``) of tensor rank ``rank``'s piece (of shape ``local_shape``) as boxes
    of the full value: ``(global offsets, sizes, where along the split dim each starts in the box)``. Along
    an S(d, k) dim the piece holds one run of each of the k segments, so a box crossing a run's end is cut
    there; every other dim (and an R value) keeps its coordinates. A padded value's zeros are in no box."""
    if placement.kind != "S" or tp == 1:
        return [(tuple(offsets), tuple(sizes), 0)]
    d = placement.dim
    run = local_shape[d] // placement.segments  # this rank's run of each segment
    whole = local_shape[d] * tp - placement.pad  # (the full value's size along d)
    out = []
    i, end = offsets[d], offsets[d] + sizes[d]
    while i < end:
        segment, stop = i // run, min(end, (i // run + 1) * run)
        at = segment * run * tp + rank * run + i % run  # the segment's start, this rank's run, the offset in it
        n = min(stop - i, whole - at)
        if n > 0:
            out.append(((*offsets[:d], at, *offsets[d + 1:]), (*sizes[:d], n, *sizes[d + 1:]), i - offsets[d]))
        i = stop
    return out
