"""Refuse an optimizer whose result sharding would change, before any collective.

Each rank steps the optimizer on its own flat 1-D pieces of the parameters
(``sharding.py``). That equals stepping the whole parameters only for an optimizer that
treats every element on its own (SGD, Adam, AdamW, RMSprop, ...). A factored or
matrix-level optimizer (Adafactor's row and column statistics, Muon's orthogonalised
updates, a global-norm rule) or one that needs a closure (LBFGS) would train something
else, silently. The probe runs the user's factory on a small parameter whole and, as
ranks would, on two uneven flat pieces each in its own optimizer, for a few steps, and
compares. It runs on the device the shards live on (``mc.compile``'s), so an optimizer
that only steps tensors there (fused CUDA kernels, ``capturable=True``) is probed as it
will run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from micscompile.core.optim import prefer_fused
from micscompile.core.plan import PlanError
from micscompile.runtime.param_groups import probe_params

PROBE_SHAPE = (4, 6)
PROBE_CUT = 7  # pieces [0, 7) and [7, 24): neither a whole row nor an even split
PROBE_STEPS = 3


def check_elementwise(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                      device: torch.device | str = "cpu", rtol: float = 1e-5) -> None:
    """Raise ``PlanError`` unless stepping flat pieces separately gives the whole parameter's result
    (parameters and gradients on ``device``, drawn from the CPU generator)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(PROBE_SHAPE, generator=gen).to(device)
    grads = [torch.randn(PROBE_SHAPE, generator=gen).to(device) for _ in range(PROBE_STEPS)]
    whole = nn.Parameter(start.clone())
    pieces = [nn.Parameter(start.reshape(-1)[:PROBE_CUT].clone()), nn.Parameter(start.reshape(-1)[PROBE_CUT:].clone())]
    try:
        opt_whole = factory(probe_params(whole, PROBE_SHAPE))
        name = type(opt_whole).__name__
        opts = [factory(probe_params(p, PROBE_SHAPE)) for p in pieces]
        for opt in (opt_whole, *opts):  # as the step will run them
            prefer_fused(opt)
        for g in grads:
            whole.grad = g.clone()
            opt_whole.step()
            for p, lo, hi in ((pieces[0], 0, PROBE_CUT), (pieces[1], PROBE_CUT, g.numel())):
                p.grad = g.reshape(-1)[lo:hi].clone()
            for opt in opts:
                opt.step()
    except Exception as exc:  # noqa: BLE001 - reported with the reason sharding needs
        raise PlanError(
            f"the optimizer factory failed on flat 1-D parameter shards on {torch.device(device)} "
            f"({type(exc).__name__}: {exc}); "
            "micscompile steps each rank's flat pieces on their own, so it needs an elementwise optimizer "
            "(SGD, Adam, AdamW, ...) that steps without a closure") from exc
    sharded = torch.cat([p.detach() for p in pieces])
    reference = whole.detach().reshape(-1)
    err = float((sharded - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
    if not err <= rtol:  # also catches NaN
        raise PlanError(
            f"optimizer {name} is not elementwise: stepping the flat shards ranks hold gives a different "
            f"result from stepping the whole parameter (relative difference {err:.2e} after {PROBE_STEPS} "
            "steps on a probe), so sharding would change what it trains; use an elementwise optimizer "
            "(SGD, Adam, AdamW, RMSprop, ...)")
