"""The correctness yardstick: single-process eager PyTorch on the same global batch.

Parity metric (docs/design.md), per tensor: max|a - b| / max(max|b|, 1e-2) <= 1e-5 in fp32.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from micscompile.core.errors import InputError
from micscompile.runtime.loss_scale import LossScaler

TOLERANCE = 1e-5
LOW_PRECISION_TOLERANCE = 2e-2
"""Mixed-precision parity against ``train_reference_mixed`` after 5 steps where the plan rounds
differently from the reference: gradients summed in bf16 / fp16 (the reference sums in fp32), a
tied weight's two gradients summed in fp32 across pipeline stages (eager autograd sums them in
param_dtype). A few roundings of 2^-9 (bf16) per step, compounded by momentum. Otherwise a
mixed-precision plan runs exactly the reference's low-precision ops and meets ``TOLERANCE``."""


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max(max|b|, 1e-2): the parity metric of one tensor (b is the reference)."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != b.shape:
        raise InputError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-2)) if b.numel() else 0.0


def state_error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst parity error over the tensors of two state dicts, and which tensor it is."""
    if state.keys() != ref.keys():
        raise InputError(f"state dict keys differ: {sorted(state.keys() ^ ref.keys())}")
    worst = max(((rel_error(state[k], ref[k]), k) for k in ref), default=(0.0, ""))
    return worst


def train_reference(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    global_batches: Sequence[Sequence[torch.Tensor]],
    num_model_inputs: int = 1,
    copy_model: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` (a deep copy unless ``copy_model=False``, for a loss_fn that reads the
    model's own parameters) eagerly, one step per global batch: (losses, state_dict)."""
    if copy_model:
        model = copy.deepcopy(model)
    opt = optimizer(list(model.parameters()))
    losses = []
    for batch in global_batches:
        opt.zero_grad()
        loss = loss_fn(model(*batch[:num_model_inputs]), *batch[num_model_inputs:])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _SplitSums(TorchDispatchMode):
    """``mm`` and ``addmm`` by a weight (one operand a view of a parameter: a linear's forward and its input's
    gradient, the matmuls whose sum tensor parallelism splits) as ``parts`` partial products over slices of
    the inner dimension, each in the operands' dtype, summed in it (``train_reference_mixed``'s
    ``split_sums``)."""

    def __init__(self, parts: int, params) -> None:
        super().__init__()
        self.parts = parts
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and not kwargs:
            bias, (a, b) = (None, args) if func is torch.ops.aten.mm.default else (args[0], args[1:3])
            k = a.shape[1]
            weight = any(x.untyped_storage().data_ptr() in self.params for x in (a, b))
            if weight and a.dtype != torch.float64 and k % self.parts == 0 and k > self.parts:
                step = k // self.parts
                out = sum(torch.mm(a[:, i:i + step], b[i:i + step]) for i in range(0, k, step))
                return out if bias is None else out + bias
        return func(*args, **kwargs)


def _add_into(totals: list, grads, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``totals[i] += convert(grads[i])`` for each gradient that is not None (a None total: the first)."""
    for i, g in enumerate(grads):
        if g is not None:
            g = convert(g)
            totals[i] = g if totals[i] is None else totals[i] + g


def train_reference_mixed(
    model: nn.Module,
    make_loss: Callable[[nn.Module], Callable[..., torch.Tensor]],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    global_batches: Sequence[Sequence[torch.Tensor]],
    chunks: int,
    param_dtype: torch.dtype,
    num_model_inputs: int = 1,
    loss_scaler: LossScaler | None = None,
    max_grad_norm: float | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    micro_batches: int = 1,
    partition_size: int | None = None,
    compiled: bool = False,
    skip_steps: Collection[int] = (),
    split_sums: int = 1,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The mixed-precision yardstick (FSDP2 MixedPrecisionPolicy semantics), eager, one process.

    ``model`` keeps the fp32 master weights and the optimizer steps them. Each global batch is cut
    into ``chunks`` equal slices (one per rank and micro-step of the plan compared against); each
    slice runs forward and backward on ``copy.deepcopy(model).to(param_dtype)`` (parameters and
    buffers cast), on floating inputs cast to it, with the loss ``make_loss(copy)``; the
    slices' gradients are summed in fp32 and divided by ``chunks`` (the gradient of the global
    mean loss). In fp16 the slices' backward is seeded with a dynamic loss scale (``loss_scaler``,
    default ``LossScaler()``), the summed gradients unscaled, and a step with a non-finite gradient
    skipped while the scale backs off, as the step does (``runtime.loss_scale``).
    A loss that returns ``(loss_sum, count)`` (the token-weighted loss) divides the summed gradients
    and losses by the whole batch's count instead. ``max_grad_norm``: the summed gradients are
    clipped with ``torch.nn.utils.clip_grad_norm_`` before each step (a non-finite norm skips it).
    In ``torch.float32`` this is the fp32 reference summed in the plan's micro-batch order.
    ``reduce_dtype``: the slices' gradients are summed in it where the plan sums them in it (an fp16 sum
    overflows, and the fp16 loss scale backs off, where the plan's reduction does): slice i is chain
    i // ``micro_batches``'s micro-batch i % ``micro_batches``; each micro-batch's slices are summed
    over each partition group of ``partition_size`` chains (None: all of them, the every-step
    all-reduce), accumulated in fp32 over the micro-batches, then, over several groups, summed over
    them (the second hop). Each reduction is exact, then rounded to ``reduce_dtype`` once: it overflows where the true
    sum does, whatever order a collective adds it in (a sequential fp16 sum can overflow in one order
    and not another).
    ``compiled``: each slice's forward and backward run through ``torch.compile`` (Inductor), rounding as
    fused kernels do: the yardstick of how far Inductor's rounding alone moves a value. ``skip_steps``: the
    optimizer does not step on these (0-based) steps whatever their gradients (an fp16 run's skipped steps,
    so that a reference in another dtype steps alike). ``split_sums``: every matmul (``mm``, ``addmm``) sums
    this many partial products over equal slices of its inner dimension, each rounded to its dtype first, as
    a tensor-parallel matmul does (each tensor rank rounds its partial product before the all-reduce): the
    yardstick of how far that second rounding alone moves a value.
    Returns (losses, master state_dict) like ``train_reference``.
    """
    low = copy.deepcopy(model).to(param_dtype)
    run = torch.compile(low) if compiled else low
    masters = list(model.parameters())
    opt = optimizer(masters)
    loss_low = make_loss(low)
    scaler = (loss_scaler or LossScaler()) if param_dtype == torch.float16 else None  # fp16, as the step
    losses = []
    for step_index, batch in enumerate(global_batches):
        with torch.no_grad():
            for lp, mp in zip(low.parameters(), masters):
                lp.copy_(mp)
        totals: list[torch.Tensor | None] = [None] * len(masters)  # None: no slice reached the parameter
        sums: dict[tuple[int, int], list] = {}  # (group, micro-batch) -> sums in reduce_dtype (low precision)
        loss_sum, count = 0.0, None
        for index, piece in enumerate(zip(*(x.chunk(chunks) for x in batch))):
            piece = [x.to(param_dtype) if x.is_floating_point() else x for x in piece]
            with _SplitSums(split_sums, low.parameters()) if split_sums > 1 else contextlib.nullcontext():
                loss = loss_low(run(*piece[:num_model_inputs]), *piece[num_model_inputs:])
                if isinstance(loss, tuple):  # (loss_sum, count)
                    loss, n = loss
                    count = (count or 0) + int(n)
                seed = None if scaler is None else torch.full_like(loss, scaler.scale)
                grads = torch.autograd.grad(loss, list(low.parameters()), grad_outputs=seed, allow_unused=True)
            if reduce_dtype == torch.float32:
                _add_into(totals, grads, torch.Tensor.float)
            else:
                chain, micro = divmod(index, micro_batches)
                acc = sums.setdefault((chain // (partition_size or chunks), micro), [None] * len(masters))
                _add_into(acc, grads, torch.Tensor.double)  # (summed exactly, rounded to reduce_dtype once below)
            loss_sum += float(loss.detach().float())
        if sums:  # fp32 over each group's micro-batches, then the groups summed in reduce_dtype
            groups: dict[int, list] = {}
            for (group, _), acc in sorted(sums.items()):
                _add_into(groups.setdefault(group, [None] * len(masters)), acc, lambda g: g.to(reduce_dtype).float())
            if len(groups) == 1:  # one partition group (or the every-step all-reduce): no second hop
                totals = next(iter(groups.values()))
            else:
                hop = [None] * len(masters)
                for tot in groups.values():
                    _add_into(hop, tot, lambda g: g.to(reduce_dtype).double())
                totals = [None if g is None else g.to(reduce_dtype) for g in hop]
        divisor = chunks if count is None else count
        unscale = divisor * (1.0 if scaler is None else scaler.scale)
        for mp, total in zip(masters, totals):
            mp.grad = None if total is None else total.float() / unscale
        finite = all(t is None or bool(torch.isfinite(t).all()) for t in totals)
        if scaler is not None:
            scaler.update(finite)
        if finite and max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_([mp for mp in masters if mp.grad is not None], max_grad_norm)
            finite = bool(torch.isfinite(norm))
        if (finite or (scaler is None and max_grad_norm is None)) and step_index not in skip_steps:
            opt.step()
        losses.append(loss_sum / divisor)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
