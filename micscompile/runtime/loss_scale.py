"""Dynamic loss scaling for fp16 training (``Plan.param_dtype=torch.float16``), as
``torch.amp.GradScaler`` does it.

The traced backward is seeded with the scale (``trace(loss_scale=True)``: an fp32 scalar graph
input, ``trace.LOSS_SCALE``), so small fp16 gradients do not flush to zero. At the boundary the
step measures the global gradient norm (one all-reduce over the world, so every rank sees the same
value), divides the gradients by the scale, and if the norm is not finite skips the optimizer step
and backs the scale off; after ``growth_interval`` finite steps in a row it grows. The scale is a
host number, the same on every rank; the step writes it into the graph's input before each step.

``init_scale`` is 2**15, not GradScaler's 2**16: the graph computes the loss in fp16 (FSDP2-style
mixed precision, no autocast), and 2**16 is above fp16's largest value (65504), so the seed would
be inf and the first step always skipped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    """Finite steps in a row since the last change."""

    def update(self, finite: bool) -> None:
        """GradScaler.update's rule: back off on a non-finite step; grow after ``growth_interval``
        finite ones."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.growth_tracker = float(sd["scale"]), int(sd["growth_tracker"])
