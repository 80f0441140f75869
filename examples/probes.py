"""Probes to add after training (hindsight logging): Lightning callbacks that call self.log."""

from __future__ import annotations

import lightning as L
import torch


class GradNormProbe(L.Callback):
    """Inner-loop probe: the global gradient norm before every optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        pl_module.log("grad_norm", torch.stack(grads).norm())


class WeightNormProbe(L.Callback):
    """Outer-loop probe: the first layer's weight norm and the learning rate at each epoch end."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        first = next(p for p in pl_module.parameters() if p.dim() > 1)
        pl_module.log("weight_norm", first.norm())
        pl_module.log("lr", trainer.optimizers[0].param_groups[0]["lr"])
