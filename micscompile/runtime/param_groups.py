"""What the optimizer factory receives (``mc.compile(optimizer=...)``), and weight-decay groups.

The factory is called once with ``ShardParams``: a ``list`` of this rank's fp32 parameter pieces
(1-D, possibly empty), so ``lambda ps: torch.optim.AdamW(ps)`` works as with ``model.parameters()``.
It also knows each piece's name and the full parameter's shape, which a 1-D piece has lost:
``ps.named()`` gives ``(name, piece)`` like ``model.named_parameters()``, ``ps.full_shape(name)``
the shape. ``decay_groups`` builds the usual two parameter groups from them::

    optimizer=lambda ps: torch.optim.AdamW(mc.decay_groups(ps, weight_decay=0.1), lr=3e-4)

Every rank holds a piece of every parameter (empty where its share is padding), so the groups
have the same parameters, by name, on every rank, and a sharded checkpoint maps them by name
(``runtime.state_dict``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import nn

from micscompile.core.errors import InputError, InputTypeError


class ShardParams(list):
    """This rank's parameter pieces (a list of ``nn.Parameter``) with their names and full shapes."""

    def __init__(self, params: Iterable[nn.Parameter], names: Iterable[str], shapes: dict[str, tuple[int, ...]]):
        super().__init__(params)
        self.names = list(names)
        if len(self.names) != len(self):
            raise InputError(f"{len(self)} parameters but {len(self.names)} names")
        self.shapes = {n: tuple(shapes[n]) for n in self.names}

    def named(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, piece) pairs, like ``model.named_parameters()``."""
        return zip(self.names, self)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The unsharded parameter's shape (its piece is 1-D)."""
        return self.shapes[name]


def no_decay_by_shape(name: str, shape: tuple[int, ...]) -> bool:
    """The common rule (nanoGPT, torchtitan's and Hugging Face's recipes in effect): parameters of
    fewer than two dimensions (biases, norm weights) are not decayed."""
    return len(shape) < 2


def decay_groups(params: ShardParams, weight_decay: float,
                 no_decay: Callable[[str, tuple[int, ...]], bool] = no_decay_by_shape) -> list[dict]:
    """Two parameter groups, ``{"params": decayed, "weight_decay": weight_decay}`` and
    ``{"params": the rest, "weight_decay": 0.0}``, split by ``no_decay(name, full shape)``; a group
    with no parameter is left out (the same on every rank)."""
    if not isinstance(params, ShardParams):
        raise InputTypeError("decay_groups needs the ShardParams the optimizer factory is called with "
                        f"(names and full shapes), got {type(params).__name__}")
    groups = [{"params": [p for n, p in params.named() if not no_decay(n, params.full_shape(n))],
               "weight_decay": weight_decay},
              {"params": [p for n, p in params.named() if no_decay(n, params.full_shape(n))], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def probe_params(param: nn.Parameter, full_shape: tuple[int, ...]) -> ShardParams:
    """A one-parameter ``ShardParams`` (``optim_check``'s probe)."""
    return ShardParams([param], ["probe"], {"probe": tuple(full_shape)})
