"""The correctness yardstick: single-process eager PyTorch on the same global batch.

Parity metric (design.md), per tensor: max|a - b| / max(max|b|, 1e-2) <= 1e-5 in fp32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

TOLERANCE = 1e-5


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max(max|b|, 1e-2): the parity metric of one tensor (b is the reference)."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-2)) if b.numel() else 0.0


def state_error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst parity error over the tensors of two state dicts, and which tensor it is."""
    if state.keys() != ref.keys():
        raise ValueError(f"state dict keys differ: {sorted(state.keys() ^ ref.keys())}")
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
