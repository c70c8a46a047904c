"""This rank's parameter shards and buffers, from a real or a meta-device model.

Real parameters are sliced (the full tensors are only read). For parameters on the
meta device, modules are materialised one at a time in ``named_modules()`` order:
the module's own meta parameters and buffers get storage on the CPU, ``init_fn``
initialises them there, and each parameter's slice for this rank is copied to its
shard on ``device`` as soon as every module that owns it (tied weights have several)
has been initialised, then the full tensor is dropped. So values equal, bit for bit
and on any device, what ``init_fn`` applied in the same order to an unsharded copy
on the CPU gives under the same seed (the CPU generator: a GPU's would draw other
numbers), while at most one module (plus pending tied weights) is ever full.
``init_fn`` is called for every module that directly owns parameters or buffers,
and must initialise only that module's own tensors.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from micscompile.core.errors import InputError
from micscompile.core.sharding import BucketLayout, local_piece
from micscompile.core.tensor_layout import R
from micscompile.core.tensor_layout import local_piece as local_piece_of


def default_init(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _owned(module: nn.Module) -> list[tuple[dict, str]]:
    return [(module._parameters, k) for k, v in module._parameters.items() if v is not None] + [
        (module._buffers, k) for k, v in module._buffers.items() if v is not None
    ]


def check_initializable(model: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    """Refuse, before any collective, a meta model whose tensors nothing would initialise."""
    if init_fn not in (None, default_init):
        return
    for fqn, mod in model.named_modules():
        has_meta = any(store[key].is_meta for store, key in _owned(mod))
        if has_meta and not callable(getattr(mod, "reset_parameters", None)):
            raise InputError(
                f"module '{fqn or '<root>'}' ({type(mod).__name__}) has tensors on the meta device but no "
                "reset_parameters(), so nothing would initialise them; pass init_fn= to mc.compile that does"
            )


def fingerprint(model: nn.Module) -> str:
    """What must agree across ranks for them to start from the same weights: the values of a
    real model, or the CPU random state that will initialise a meta one."""
    h = hashlib.blake2b(digest_size=8)
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        h.update(torch.get_rng_state().numpy().tobytes())
    for t in tensors:
        if not t.is_meta:
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local_states(
    model: nn.Module,
    parts: Sequence[tuple[BucketLayout, ...]],
    shard_rank: int,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
    tensor: tuple[dict, int, int] | None = None,
) -> list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """For each part this rank holds (the layouts of a flat plan, or of each of its pipeline chunks):
    (one flat shard per bucket, {buffer name: tensor}) for partition-group rank ``shard_rank``.
    ``tensor``: (parameter -> placement, this tensor rank, tp): the layouts hold a tensor rank's pieces
    (``lowering.tensor_split``), cut from each full parameter first (``core.tensor_layout``).

    A meta model is initialised once for all of them, so a parameter's values never depend on
    which chunks a rank holds (an interleaved rank's chunks are not contiguous in the model)."""
    shards = [[torch.zeros(lay.row_numel, dtype=lay.dtype, device=device) for lay in layouts] for layouts in parts]
    slots: dict[str, list] = {}
    for i, layouts in enumerate(parts):
        for lay in layouts:
            for slot in lay.slots:
                slots.setdefault(slot.name, []).append((i, lay, slot))

    def place(name: str, full: torch.Tensor) -> None:
        if tensor is not None:
            placements, rank, tp = tensor
            full = local_piece_of(full.detach(), placements.get(name, R), rank, tp)
        for i, lay, slot in slots.get(name, ()):  # a pipeline chunk holds only its own parameters
            lo, hi = lay.local_range(slot, shard_rank)
            local_piece(lay, slot, shards[i][lay.index], shard_rank).copy_(full.detach().reshape(-1)[lo:hi])

    def buffers_per_part(named_buffers: dict[str, torch.Tensor]) -> list:
        return [(s, {n: b.detach().to(device, copy=True) for n, b in named_buffers.items()}) for s in shards]

    is_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if not is_meta:
        for name, p in model.named_parameters():
            place(name, p)
        return buffers_per_part(dict(model.named_buffers()))

    init_fn = init_fn or default_init
    model = copy.deepcopy(model)  # never touch the caller's module; meta copies are free
    canonical = {}
    owners: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    for mod in model.modules():
        for store, key in _owned(mod):
            owners[id(store[key])] = owners.get(id(store[key]), 0) + 1
    for name, p in model.named_parameters():
        if not p.is_meta:  # a partly materialised model: real values are kept as they are
            place(name, p)
    real: dict[int, torch.Tensor] = {}  # id(meta tensor) -> materialised tensor
    for _, mod in model.named_modules():
        owned = _owned(mod)
        if not owned:
            continue
        metas = []
        for store, key in owned:
            t = store[key]
            if t.is_meta:
                if id(t) not in real:
                    new = torch.empty_like(t, device="cpu")
                    real[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                metas.append((store, key, t))
                store[key] = real[id(t)]
        init_fn(mod)
        for store, key, t in metas:
            owners[id(t)] -= 1
            if isinstance(t, nn.Parameter) and owners[id(t)] == 0:
                place(canonical[id(t)], real.pop(id(t)))
                store[key] = t  # back to meta: the full tensor is freed
    return buffers_per_part(dict(model.named_buffers()))


def initialize(model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply ``init_fn`` to a real model exactly as ``compile`` does to a meta one.

    The reference for a meta model: under the same seed, ``initialize(real_copy)`` of a
    copy on the CPU gives the values ``compile`` shards, on any device.
    """
    init_fn = init_fn or default_init
    for mod in model.modules():
        if _owned(mod):
            init_fn(mod)
    return model
