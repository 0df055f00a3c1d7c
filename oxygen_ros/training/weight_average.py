"""An exponential moving average of a model's trained weights (openpi trains with one, decay 0.99,
and saves the average, not the last step's weights).

After every optimizer step ``average = decay * average + (1 - decay) * weights``: with decay 0.99
the average spans about the last 100 steps, so the checkpoint is not the draw of one batch's step.
The probes and the written checkpoint read the average (`WeightAverage.applied`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class WeightAverage:
    """The moving average of ``model``'s parameters that require a gradient.

    Raises:
        ValueError: ``decay`` outside (0, 1).
    """

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the weight average's decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.averages = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Move the average towards ``model``'s current weights (after an optimizer step)."""
        for name, p in model.named_parameters():
            if name in self.averages:
                self.averages[name].lerp_(p.detach(), 1.0 - self.decay)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """``model`` holds the averaged weights inside the block, its own again after it."""
        own = {n: p.detach().clone() for n, p in model.named_parameters() if n in self.averages}
        self.copy_to(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in own:
                        p.copy_(own[name])

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Write the averaged weights into ``model`` for good."""
        for name, p in model.named_parameters():
            if name in self.averages:
                p.copy_(self.averages[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.averages)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Raises: ValueError: ``state`` averages other parameters than this model trains."""
        if set(state) != set(self.averages):
            raise ValueError(
                "the resume file's weight average covers other parameters than this model "
                f"trains ({sorted(set(state) ^ set(self.averages))[:3]} ...)"
            )
        for name, value in state.items():
            self.averages[name].copy_(value)
