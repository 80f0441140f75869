"""``StaleGatherDataModule``: a PyG graph split into vertex intervals for Dorylus-style training.

The data module plays the graph servers' part: it owns the graph, its intervals and the
staleness setting, and yields one :class:`GatherRound` per Lightning epoch; the module
(:class:`stalwart.datamodules.StaleGNNModule`) runs the rounds' (interval, epoch) work through
the :class:`stalwart.gnn.StaleGatherEngine` in whatever order the staleness gate allows.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L

from stalwart.errors import ConfigurationError, DatasetUnavailableError
from stalwart.gnn.gate import parse_staleness
from stalwart.gnn.graph import IntervalGraph
from stalwart.gnn.scheduler import Straggler
from stalwart.gnn.synthetic import stochastic_block_graph

#: Overrides the default Planetoid root (see :func:`default_planetoid_root`).
PLANETOID_ROOT_ENV = "STALWART_PLANETOID"
#: (features, classes) of each Planetoid graph: the fallback SBM graph takes the same shape, so
#: a module configured for the dataset still fits it.
PLANETOID_SHAPES = {"Cora": (1433, 7), "CiteSeer": (3703, 6), "PubMed": (500, 3)}


class GatherRound:
    """One Lightning epoch's worth of work: run until every interval has finished it."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = epoch


class _Rounds:
    """A one-item loader: Lightning's epoch boundary is the gate's min_epoch advancing."""

    def __iter__(self) -> Iterator[GatherRound]:
        yield GatherRound()

    def __len__(self) -> int:
        return 1


def default_planetoid_root() -> Path:
    """``$STALWART_PLANETOID`` if set, else ``planetoid/`` under PyG's home (``~/.cache/pyg``)."""
    configured = os.environ.get(PLANETOID_ROOT_ENV)
    if configured:
        return Path(configured)
    import torch_geometric

    return Path(torch_geometric.get_home_dir()) / "planetoid"


def load_planetoid(name: str, root: str | os.PathLike | None = None) -> Any:
    """PyG's ``Planetoid(root, name)[0]``: read from ``root``, downloaded there when absent.

    Args:
        name: ``"Cora"``, ``"CiteSeer"`` or ``"PubMed"``.
        root: the folder holding ``<name>/raw`` (PyG writes ``<name>/processed`` next to it);
            default :func:`default_planetoid_root`.

    Raises:
        DatasetUnavailableError: the files are not under ``root`` and cannot be downloaded
            (no network), or ``root`` cannot be written (PyG saves the processed graph there).
    """
    from torch_geometric.datasets import Planetoid

    base = Path(root) if root is not None else default_planetoid_root()
    raw = base / name / "raw"
    try:
        return Planetoid(str(base), name)[0]
    except OSError as exc:  # urllib's and aiohttp's connection errors are OSErrors too
        if any(raw.glob("ind.*")):
            raise DatasetUnavailableError(
                f"Planetoid {name} at {raw} could not be read ({exc}). PyG writes "
                f"{name}/processed/ next to raw/: pass root= a writable folder holding a copy "
                f"of {name}/raw/."
            ) from exc
        raise DatasetUnavailableError(
            f"no Planetoid {name} at {raw}, and downloading it there failed ({exc}). Put PyG's "
            f"raw files (ind.{name.lower()}.x, .y, .tx, .ty, .allx, .ally, .graph, .test.index) "
            f"in that folder, or pass root= (--data.root=, or set {PLANETOID_ROOT_ENV}) to a "
            f"folder holding {name}/raw/; or use data='sbm' for a generated graph."
        ) from exc


class StaleGatherDataModule(L.LightningDataModule):
    """A node-classification graph split into intervals, trained with bounded-staleness Gather.

    Args:
        data: a PyG ``Data`` (with ``x``, ``y``, ``edge_index``, ``train_mask``, ``val_mask``,
            ``test_mask``), a Planetoid name (``"Cora"``, ``"CiteSeer"``) loaded by
            :func:`load_planetoid` from ``root``, or ``"sbm"`` for a generated stochastic block
            model graph.
        num_intervals: vertex intervals (units of work); 1 <= num_intervals <= vertices.
        staleness: ``"sync"`` (barrier per layer: full-graph training), ``0`` (barrier per
            epoch) or ``S`` (intervals may run S epochs ahead of the slowest).
        root: folder holding ``<name>/raw`` Planetoid files, downloaded there when absent
            (default: :func:`default_planetoid_root`, ``~/.cache/pyg/planetoid``).
        fallback_sbm: if the Planetoid files are absent and cannot be downloaded, warn and use
            a generated SBM graph of the same feature width and class count instead of raising
            :class:`~stalwart.errors.DatasetUnavailableError` (off by default: a run never
            trains on other data than it names unless asked to).
        workers: threads per pool (graph tasks and tensor tasks); 0 runs tasks inline in a
            seeded order.
        straggler_delay: seconds added to every task of one tensor worker (0: no straggler).
        seed: seed of dropout masks, of the inline order and of the generated graph.

    Example:
        >>> dm = StaleGatherDataModule("Cora", num_intervals=8, staleness=0)
        >>> trainer = stalwart.Trainer(max_epochs=200)
        >>> trainer.fit(StaleGCN(), dm)
    """

    def __init__(
        self,
        data: Any = "Cora",
        num_intervals: int = 8,
        staleness: int | str = "sync",
        root: str | None = None,
        fallback_sbm: bool = False,
        workers: int = 2,
        straggler_delay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.staleness = parse_staleness(staleness)
        if (
            isinstance(num_intervals, bool)
            or not isinstance(num_intervals, int)
            or num_intervals < 1
        ):
            raise ConfigurationError(f"num_intervals={num_intervals!r}: pass a whole number >= 1.")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigurationError(
                f"workers={workers!r}: pass 0 (inline) or a whole number >= 1."
            )
        if straggler_delay < 0:
            raise ConfigurationError(f"straggler_delay={straggler_delay}: pass seconds >= 0.")
        if straggler_delay > 0 and workers < 2:
            raise ConfigurationError(
                "a straggler needs at least 2 workers per pool (workers >= 2)."
            )
        self.data = data
        self.num_intervals = num_intervals
        self.root = root
        self.fallback_sbm = fallback_sbm
        self.workers = workers
        self.straggler = Straggler(delay=straggler_delay) if straggler_delay > 0 else None
        self.seed = seed
        self.graph: IntervalGraph | None = None

    def _load(self) -> Any:
        if not isinstance(self.data, str):
            return self.data
        if self.data.lower() == "sbm":
            return stochastic_block_graph(seed=self.seed)
        if self.data not in PLANETOID_SHAPES:
            raise ConfigurationError(
                f"data={self.data!r}: pass a PyG Data, one of "
                f"{', '.join(PLANETOID_SHAPES)} or 'sbm'."
            )
        try:
            return load_planetoid(self.data, self.root)
        except DatasetUnavailableError as exc:
            if not self.fallback_sbm:
                raise
            features, classes = PLANETOID_SHAPES[self.data]
            warnings.warn(
                f"{exc} Falling back to a generated SBM graph with {self.data}'s shape "
                f"({features} features, {classes} classes).", stacklevel=2,
            )  # fmt: skip
            return stochastic_block_graph(
                num_nodes=700, num_classes=classes, num_features=features, seed=self.seed
            )

    def setup(self, stage: str | None = None) -> None:
        if self.graph is not None:
            return
        data = self._load()
        get = data.get if isinstance(data, dict) else lambda k: getattr(data, k, None)
        self.graph = IntervalGraph.build(
            get("x"), get("y"), get("edge_index"), get("train_mask"), get("val_mask"),
            get("test_mask"), self.num_intervals,
        )  # fmt: skip

    def train_dataloader(self) -> _Rounds:
        return _Rounds()

    def val_dataloader(self) -> _Rounds:
        return _Rounds()

    def test_dataloader(self) -> _Rounds:
        return _Rounds()

    def describe(self) -> dict[str, Any]:
        """Sizes of the intervals and their inter-interval edge counts."""
        graph = self.graph
        if graph is None:
            raise ConfigurationError("call setup() first.")
        return {
            "sizes": graph.intervals.sizes().tolist(),
            "inter_interval_edges": graph.intervals.inter_interval_edges(graph.edge_index).tolist(),
            "staleness": "sync" if self.staleness is None else self.staleness,
        }
