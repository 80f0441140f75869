"""The gradient EMA that makes sensitivity (|g*w|) measurable at a checkpoint (paper §4.2)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from stalwart.errors import ConfigurationError


class GradientEMA:
    """``ema = beta * g + (1 - beta) * ema`` per parameter, kept on the CPU.

    Fed only during the window of batches before a checkpoint, and copied off the device
    non-blocking, so training outside the window pays nothing.

    Args:
        beta: weight of the newest gradient (the paper's 0.9).

    Example::

        ema = GradientEMA(beta=0.9)
        loss.backward()
        ema.update(model.named_parameters())
        gradients = ema.take()  # for stalwart.shrink.save(..., gradients=gradients)
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 < beta <= 1.0:
            raise ConfigurationError(f"grad_beta must be in (0, 1], got {beta}")
        self.beta = beta
        self._ema: dict[str, torch.Tensor] = {}

    def update(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, parameter in named_parameters:
                if parameter.grad is None:
                    continue
                grad = parameter.grad.detach().to("cpu", non_blocking=True)
                ema = self._ema.get(name)
                if ema is None:
                    self._ema[name] = grad.clone()
                else:
                    ema.mul_(1.0 - self.beta).add_(grad, alpha=self.beta)

    def take(self) -> dict[str, torch.Tensor] | None:
        """The EMA so far (None when nothing was captured), and start afresh."""
        ema, self._ema = self._ema, {}
        return ema or None
