"""LightningModules that train stale GNN layers with weight stashing (manual optimization).

Lightning's training loop sees one step per epoch; inside it the
:class:`stalwart.gnn.StaleGatherEngine` runs every interval's tasks on the graph and tensor
pools and calls back here for each weight update (WU), which steps the optimizer on the latest
weights with the gradient summed over intervals.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from stalwart.datamodules.stale_gather import GatherRound, StaleGatherDataModule
from stalwart.errors import ConfigurationError
from stalwart.gnn.engine import StaleGatherEngine
from stalwart.gnn.layers import StaleGATConv, StaleGCNConv, StaleGNN


class StaleGNNModule(L.LightningModule):
    """Base class: subclasses say which stale layers to stack in :meth:`build_layers`.

    Train it with a :class:`StaleGatherDataModule`. Logs ``train_loss``, ``gate_lead`` (how
    far the fastest interval ran ahead of the slowest during the epoch), ``stale_reads``
    (fraction of gathered rows from another epoch), ``val_acc`` and ``test_acc``; the wall time
    of each epoch is ``self.epoch_seconds`` (not logged: a replay could not reproduce it).

    Args:
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
        dropout: dropout on every layer's input rows.
        num_features: input width; with ``num_classes``, the layers are built at once (so the
            module has its parameters before ``fit``, e.g. for ``Trainer.replay``); otherwise
            they are built in ``setup`` from the data module's graph.
        num_classes: output width.

    Example:
        >>> class MyGCN(StaleGNNModule):
        ...     def build_layers(self, num_features, num_classes):
        ...         return [StaleGCNConv(num_features, 32), StaleGCNConv(32, num_classes)]
        >>> stalwart.Trainer(max_epochs=100).fit(MyGCN(), StaleGatherDataModule("Cora"))
    """

    def __init__(
        self, lr: float = 0.01, weight_decay: float = 5e-4, dropout: float = 0.5,
        num_features: int | None = None, num_classes: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ConfigurationError(f"dropout={dropout}: pass a probability in [0, 1).")
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.gnn: StaleGNN | None = None
        self.engine: StaleGatherEngine | None = None
        self.epoch_seconds: list[float] = []
        #: The engine of the last fit (its gate log and staleness record), once it ended.
        self.last_engine: StaleGatherEngine | None = None

    def _build(self, num_features: int, num_classes: int) -> None:
        self.gnn = StaleGNN(self.build_layers(num_features, num_classes), self.hparams.dropout)

    def build_layers(self, num_features: int, num_classes: int) -> list[nn.Module]:
        raise NotImplementedError("subclasses return their stale layers, first to last")

    def _datamodule(self) -> StaleGatherDataModule:
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, StaleGatherDataModule):
            raise ConfigurationError(
                f"{type(self).__name__} trains on a StaleGatherDataModule: pass "
                "datamodule=StaleGatherDataModule(...) to fit/validate/test."
            )
        return dm

    def setup(self, stage: str) -> None:
        dm = self._datamodule()
        dm.setup(stage)
        graph = dm.graph
        if self.gnn is None:
            self._build(graph.num_features, graph.num_classes)
        declared = (self.hparams.num_features, self.hparams.num_classes)
        if declared != (None, None) and declared != (graph.num_features, graph.num_classes):
            raise ConfigurationError(
                f"the module was built for {declared[0]} features and {declared[1]} classes but "
                f"the graph has {graph.num_features} and {graph.num_classes}: fix num_features/"
                "num_classes (or leave both unset to take them from the graph)."
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )

    def on_train_epoch_start(self) -> None:
        if self.engine is None:  # first epoch of this fit (0, or where a resume starts)
            dm = self._datamodule()
            self.engine = StaleGatherEngine(
                dm.graph, self.gnn, dm.staleness, self._weight_update, workers=dm.workers,
                straggler=dm.straggler, seed=dm.seed, start_epoch=self.current_epoch,
            )  # fmt: skip
        elif self.engine.idle:
            # A checkpoint may have been loaded into the module since the engine copied its
            # weights; between epochs of sync and s=0 nothing is in flight.
            self.engine.refresh_weights()

    def on_train_end(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.last_engine, self.engine = self.engine, None

    def _weight_update(self, epoch: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        optimizer = self.optimizers()
        for name, param in self.gnn.named_parameters():
            param.grad = grads[f"{name}"]
        optimizer.step()
        optimizer.zero_grad()
        return dict(self.gnn.named_parameters())

    def training_step(self, batch: GatherRound, batch_idx: int) -> None:
        max_epochs = self.trainer.max_epochs
        last = max_epochs - 1 if max_epochs is not None and max_epochs >= 0 else 2**31
        record = self.engine.record
        seen, gate_seen = len(record.reads), len(self.engine.gate.log)
        result = self.engine.run_epoch(self.current_epoch, last)
        self.epoch_seconds.append(result.seconds)
        reads = record.reads[seen:]
        stale = sum(r[6] for r in reads if r[3] == "act")
        log = {"batch_size": 1}
        self.log("train_loss", result.loss, prog_bar=True, **log)
        lead = max(entry[4] for entry in self.engine.gate.log[gate_seen:])
        self.log("gate_lead", float(lead), **log)
        self.log("stale_reads", float(stale) / max(1, self._rows_per_epoch(reads)), **log)
        # The record is for tests and audits; keep only what the current epochs need.
        if len(record.reads) > 100_000:
            record.clear()
            self.engine.gate.log.clear()

    def _rows_per_epoch(self, reads: list) -> int:
        blocks = self._datamodule().graph.blocks
        return sum(blocks[r[0]].neighbors.numel() for r in reads if r[3] == "act")

    def _accuracy(self, mask_name: str) -> torch.Tensor:
        graph = self._datamodule().graph
        with torch.no_grad():
            logits = self.gnn.full_forward(graph.full_block, graph.x)
        mask = getattr(graph, mask_name)
        return (logits[mask].argmax(1) == graph.y[mask]).float().mean()

    def validation_step(self, batch: GatherRound, batch_idx: int) -> None:
        self.log("val_acc", self._accuracy("val_mask"), prog_bar=True, batch_size=1)

    def test_step(self, batch: GatherRound, batch_idx: int) -> None:
        self.log("test_acc", self._accuracy("test_mask"), batch_size=1)


class _StackedStaleGNN(StaleGNNModule):
    """``num_layers`` layers of ``conv``, ``hidden`` units wide between input and classes."""

    conv: type[nn.Module]

    def _stack(
        self, hidden: int, num_layers: int, num_features: int | None, num_classes: int | None
    ) -> None:
        if num_layers < 1 or hidden < 1:
            raise ConfigurationError("hidden and num_layers must be >= 1.")
        self.hidden, self.num_layers = hidden, num_layers
        if num_features is not None and num_classes is not None:
            self._build(num_features, num_classes)

    def build_layers(self, num_features: int, num_classes: int) -> list[nn.Module]:
        widths = [num_features] + [self.hidden] * (self.num_layers - 1) + [num_classes]
        return [self.conv(a, b) for a, b in zip(widths, widths[1:], strict=False)]


class StaleGCN(_StackedStaleGNN):
    """A GCN (Kipf & Welling) of stale GCN layers: ``hidden`` units per hidden layer.

    Args:
        hidden: hidden width.
        num_layers: layers (>= 1).
        lr, weight_decay, dropout, num_features, num_classes: as :class:`StaleGNNModule`.

    Example:
        >>> stalwart.Trainer(max_epochs=200).fit(StaleGCN(16), StaleGatherDataModule("Cora"))
    """

    conv = StaleGCNConv

    def __init__(
        self, hidden: int = 16, num_layers: int = 2, lr: float = 0.01, weight_decay: float = 5e-4,
        dropout: float = 0.5, num_features: int | None = None, num_classes: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(lr, weight_decay, dropout, num_features, num_classes)
        self._stack(hidden, num_layers, num_features, num_classes)


class StaleGAT(_StackedStaleGNN):
    """A single-head GAT of stale GAT layers (ApplyEdge: attention per edge).

    Args:
        hidden: hidden width.
        num_layers: layers (>= 1).
        lr, weight_decay, dropout, num_features, num_classes: as :class:`StaleGNNModule`.

    Example:
        >>> stalwart.Trainer(max_epochs=100).fit(StaleGAT(16), StaleGatherDataModule("Cora"))
    """

    conv = StaleGATConv

    def __init__(
        self, hidden: int = 16, num_layers: int = 2, lr: float = 0.005, weight_decay: float = 5e-4,
        dropout: float = 0.5, num_features: int | None = None, num_classes: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(lr, weight_decay, dropout, num_features, num_classes)
        self._stack(hidden, num_layers, num_features, num_classes)
