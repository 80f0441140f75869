"""Must-show 5: bad input is a ConfigurationError that says what to do."""

from __future__ import annotations

import pytest
import torch

from stalwart import Trainer
from stalwart.datamodules import StaleGatherDataModule, StaleGCN, default_planetoid_root
from stalwart.errors import ConfigurationError, DatasetUnavailableError
from stalwart.gnn import IntervalGraph, StaleGatherEngine, Straggler
from tests.gnn.graphs import adam_update, gcn, interval_graph, sbm

torch_geometric = pytest.importorskip("torch_geometric")


def pyg_data(**drop):
    from torch_geometric.data import Data

    tensors = {k: v for k, v in sbm(num_nodes=60).items() if k not in drop}
    return Data(**tensors)


@pytest.mark.parametrize("missing", ["x", "y", "train_mask", "val_mask", "test_mask"])
def test_graph_without_features_labels_or_masks(missing):
    dm = StaleGatherDataModule(pyg_data(**{missing: True}), num_intervals=4)
    with pytest.raises(ConfigurationError, match=f"the graph has no {missing}"):
        dm.setup("fit")


def test_more_intervals_than_vertices():
    dm = StaleGatherDataModule(pyg_data(), num_intervals=61)
    with pytest.raises(ConfigurationError, match="more than the graph's 60 vertices"):
        dm.setup("fit")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_num_intervals(bad):
    with pytest.raises(ConfigurationError, match="num_intervals"):
        StaleGatherDataModule(pyg_data(), num_intervals=bad)


@pytest.mark.parametrize("bad", [-1, "s=-2", "eventually"])
def test_negative_or_unknown_staleness(bad):
    with pytest.raises(ConfigurationError, match="staleness"):
        StaleGatherDataModule(pyg_data(), num_intervals=4, staleness=bad)


def test_malformed_tensors():
    t = sbm(num_nodes=60)
    with pytest.raises(ConfigurationError, match="edge_index refers to vertices outside"):
        IntervalGraph.build(**{**t, "edge_index": t["edge_index"] + 100}, num_intervals=2)
    with pytest.raises(ConfigurationError, match="train_mask must be a bool"):
        IntervalGraph.build(**{**t, "train_mask": t["train_mask"].long()}, num_intervals=2)
    with pytest.raises(ConfigurationError, match="selects no vertex"):
        IntervalGraph.build(**{**t, "val_mask": torch.zeros(60, dtype=torch.bool)}, num_intervals=2)
    with pytest.raises(ConfigurationError, match="y must be integer"):
        IntervalGraph.build(**{**t, "y": t["y"].float()}, num_intervals=2)


def test_missing_planetoid_folder(tmp_path, monkeypatch):
    # No files under root and nothing to download them from (a port nothing listens on).
    monkeypatch.setattr(torch_geometric.datasets.Planetoid, "url", "http://127.0.0.1:9/data")
    dm = StaleGatherDataModule("Cora", num_intervals=4, root=str(tmp_path))
    with pytest.raises(ConfigurationError, match="no Planetoid Cora") as info:
        dm.setup("fit")
    assert isinstance(info.value, DatasetUnavailableError)
    message = str(info.value)
    assert str(tmp_path / "Cora" / "raw") in message and "pass root=" in message
    assert dm.graph is None, "a missing dataset must not be replaced by another graph"
    fallback = StaleGatherDataModule("Cora", num_intervals=4, root=str(tmp_path), fallback_sbm=True)
    with pytest.warns(UserWarning, match="Falling back to a generated SBM"):
        fallback.setup("fit")
    assert (fallback.graph.num_nodes, fallback.graph.num_features, fallback.graph.num_classes) == (
        700,
        1433,
        7,
    )
    with pytest.raises(ConfigurationError, match="data='Reddit'"):
        StaleGatherDataModule("Reddit").setup("fit")


def test_planetoid_root_defaults_to_the_users_pyg_home(monkeypatch, tmp_path):
    monkeypatch.delenv("STALWART_PLANETOID", raising=False)
    monkeypatch.setenv("PYG_HOME", str(tmp_path / "pyg"))
    assert default_planetoid_root() == tmp_path / "pyg" / "planetoid"
    monkeypatch.setenv("STALWART_PLANETOID", str(tmp_path / "mine"))
    assert default_planetoid_root() == tmp_path / "mine"


def test_bad_engine_and_straggler_arguments():
    graph = interval_graph(sbm(num_nodes=60), 3)
    model = gcn(graph)
    with pytest.raises(ConfigurationError, match="needs worker threads"):
        StaleGatherEngine(graph, model, 0, adam_update(model), workers=0, straggler=Straggler())
    with pytest.raises(ConfigurationError, match="straggler worker 5 does not exist"):
        StaleGatherEngine(
            graph, model, 0, adam_update(model), workers=2, straggler=Straggler(worker=5)
        )
    with pytest.raises(ConfigurationError, match="straggler pool"):
        Straggler(pool="lambda")
    with pytest.raises(ConfigurationError, match="straggler needs at least 2 workers"):
        StaleGatherDataModule(pyg_data(), workers=1, straggler_delay=0.01)


def test_module_needs_the_stale_gather_datamodule():
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    trainer = Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigurationError, match="trains on a StaleGatherDataModule"):
        trainer.fit(StaleGCN(), BoringDataModule())
