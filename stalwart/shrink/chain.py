"""A checkpoint folder's delta chain: which save is a keyframe, what a delta extends, and which
files may be deleted. Shared by the Lightning IO plugin and the Composer algorithm, which only
differ in where the weights sit inside their checkpoint objects."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart import durable
from stalwart.errors import ConfigurationError
from stalwart.shrink.api import (
    OPTIMIZER_MODES,
    ContinueTraining,
    ShrinkReport,
    load_with_extra,
    save,
)
from stalwart.shrink.background import ForkedCall
from stalwart.shrink.codec import ChainState, superseded_path
from stalwart.shrink.container import read_header, trailer_crc
from stalwart.shrink.entropy import DEFAULT_CODER
from stalwart.shrink.moments import MomentChoice, optimizer_signature, optimizer_states
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.search import ConfigSearch

RETIRED_FILE = ".shrink-retired.json"
log = logging.getLogger(__name__)


@dataclass
class ShrinkRequest:
    """What a caller adds to one save: the search's scoring (and screening) functions,
    gradients, layer types, and the optimizer state's continuation check."""

    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None = None
    screen: Callable[[Mapping[str, torch.Tensor]], float] | None = None
    gradients: Mapping[str, torch.Tensor] | None = None
    layer_types: Mapping[str, str] | None = None
    search: ConfigSearch | None = None
    continue_training: ContinueTraining | None = None
    parameter_shapes: list[Mapping[Any, tuple[int, ...]]] | None = None
    #: The run's share of its initial learning rate (``search.learning_rate_share``): the
    #: weights' search is held to ``tau * lr_share``.
    lr_share: float = 1.0
    #: A file the chain does not extend, for a path that is written again and again (Lightning's
    #: ``last.ckpt``): it is a delta on the chain's last file, which stays the chain's last file,
    #: so no delta is ever written against a file that is later overwritten.
    side: bool = False


def _search_from(search: ConfigSearch, previous: ChainState | None) -> None:
    """Where this save's search starts: a delta from the file it extends, a keyframe afresh."""
    if previous is None:
        # A keyframe extends nothing, so nothing ties it to the last choice: it gets the first
        # checkpoint's full search. Otherwise the neighbourhood's "never more aggressive" keeps a
        # chain at whatever one noisy checkpoint pushed it to (char transformer, seed 4: 12
        # levels from the fifth checkpoint to the last, 29.7x; searched afresh at the keyframe,
        # 30.8x, docs/measurements/shrink.md).
        search.previous = None
    elif previous.config is not None:
        # The file this delta extends is the truth about the last choice. A trainer's saved
        # search state is one checkpoint behind (Lightning and Composer collect callback state
        # before the IO runs this checkpoint's search), so a resumed run would otherwise search
        # from the choice before, which may be more aggressive than the file's.
        search.previous = previous.config


class ChainWriter:
    """Writes successive checkpoints as a delta chain and reads any of them back.

    Args:
        tau: quality bound for saves that come with an ``evaluate`` function.
        config: fixed :class:`~stalwart.shrink.QuantConfig` for saves without a search.
        keyframe_every: a full (non-delta) checkpoint every this many saves.
        compress_optimizer: ``"auto"`` (default: the most compressed moment setting whose short
            continuation of training is within ``tau``, see :mod:`stalwart.shrink.moments`;
            lossless when a save brings no continuation check), ``"lossless"`` or ``"lossy"``
            (every floating tensor of ``extra`` quantized, unchecked).
        coder: entropy coder of the index streams: ``"auto"`` (default: per stream the
            smallest of rANS per previous level, rANS, and run lengths + zstd), ``"ans-grouped"``,
            ``"ans"``, ``"zstd"`` or ``"huffman"``.
        recheck_optimizer_every: with ``"auto"``, the continuation check runs at least every
            this many saves (1: at every save). In between, a setting whose last check came out
            within ``tau / 4`` is reused unchecked by the deltas of its keyframe segment: the
            check is ~2 x ``continue_steps`` training steps plus two held-out evaluations, the
            largest share of a save's time, and on the runs measured a setting that passed
            once passed again by a wide margin (continuations +0.000..+0.019, tau 0.05).
            A keyframe, an optimizer change or a resumed chain checks again.
        background: run each save in a forked child while the caller goes on (training, under
            Lightning); :meth:`save` then returns None and the save's report, and the chain
            state the next delta extends, are collected at the next :meth:`save`,
            :meth:`load`, :meth:`remove` or :meth:`wait` (a process exiting with a save in
            flight waits for its file first). The child scores on one thread at a
            lower priority, so its choices may differ in the last bits from a save that takes
            every core. CPU tensors only (a forked child cannot use CUDA).

    A file written again at its path (Lightning's ``last.ckpt``) must never be the base of
    another: a save with :attr:`ShrinkRequest.side`, or to a path this writer wrote before, is a
    delta on the chain's last file that the chain does not extend (a run resumed from it extends
    that file too). Where a live delta still needs what a path holds when it is written again
    (a path the chain extended before it was written again), that content is first moved aside,
    hidden as ``.<name>.superseded-<crc32>`` and retired, where loading the delta finds it.

    A delta is only ever written against a file in its own folder: a save into another folder
    than the chain's last file (a filename with a ``/``, a run resumed into a new folder) starts
    a keyframe, so each folder restores on its own, whatever is retired or deleted elsewhere.

    Example::

        chain = ChainWriter(keyframe_every=5)
        chain.save(model.state_dict(), {"optimizer": opt.state_dict()}, "ckpt/ep1.shrunk")
        weights, extra = chain.load("ckpt/ep1.shrunk")
    """

    def __init__(
        self,
        tau: float = 0.05,
        config: QuantConfig | None = None,
        keyframe_every: int = 10,
        compress_optimizer: str = "auto",
        coder: str = DEFAULT_CODER,
        recheck_optimizer_every: int = 5,
        background: bool = False,
    ) -> None:
        if keyframe_every < 1:
            raise ConfigurationError(f"keyframe_every must be >= 1, got {keyframe_every}")
        if recheck_optimizer_every < 1:
            raise ConfigurationError(
                f"recheck_optimizer_every must be >= 1, got {recheck_optimizer_every}"
            )
        if compress_optimizer not in OPTIMIZER_MODES:
            raise ConfigurationError(
                f"compress_optimizer must be one of {OPTIMIZER_MODES}, got {compress_optimizer!r}"
            )
        self.tau = tau
        self.config = config
        self.keyframe_every = keyframe_every
        self.compress_optimizer = compress_optimizer
        self.coder = coder
        self.recheck_optimizer_every = recheck_optimizer_every
        self.chain: ChainState | None = None
        self.reports: list[ShrinkReport] = []
        self._checked: MomentChoice | None = None  # the last continuation check's choice
        self._unchecked = 0  # saves since that check that reused its choice
        if background and not hasattr(os, "fork"):
            raise ConfigurationError(
                "background saves fork a child, and this platform has no fork; pass "
                "background=False (each save then runs while the caller waits)."
            )
        self.background = background
        self._pending: tuple[ForkedCall, ConfigSearch | None] | None = None
        # Paths this writer has written: a path written again is a side save (see ShrinkRequest).
        self._written: set[Path] = set()
        self._warned_folders = False  # whether a keyframe for a change of folder was warned of

    def save(
        self,
        weights: Mapping[str, torch.Tensor],
        extra: Any,
        path: str | os.PathLike,
        request: ShrinkRequest | None = None,
    ) -> ShrinkReport | None:
        """Write ``weights`` (quantized; a delta when the chain allows) and ``extra``; the report,
        or None with ``background`` (see :meth:`wait`)."""
        self.wait()
        request = request or ShrinkRequest()
        path = Path(path)
        if self.chain is not None and self._in_another_folder(self.chain, path):
            self.chain = None  # decided here, not in a background child: its notes die with it
        side = self._is_side(path, request)
        self._written.add(_location(path))
        if not self.background:
            return self._save_now(weights, extra, path, request, side)
        if any(t.is_cuda for t in weights.values() if isinstance(t, torch.Tensor)):
            raise ConfigurationError(
                "background saves fork a child, which cannot use CUDA, and these weights are "
                "on the GPU; pass background=False (the save then runs while training waits)."
            )
        call = ForkedCall(
            lambda: self._child_save(weights, extra, path, request, side), what=str(path)
        )
        self._pending = (call, request.search)
        return None

    def _is_side(self, path: Path, request: ShrinkRequest) -> bool:
        """Whether the save to ``path`` is one the chain does not extend from (see
        :attr:`ShrinkRequest.side`): asked for, or a path this writer wrote before. Extending a
        file that is written again would break the delta on it when it is."""
        if self.chain is not None and _location(self.chain.path) == _location(path):
            return False  # the chain's last file itself is replaced: the new one takes its place
        return request.side or _location(path) in self._written

    def busy(self) -> bool:
        """Whether a background save is still running (it is not collected here)."""
        return self._pending is not None and not self._pending[0].done()

    def wait(self) -> ShrinkReport | None:
        """Collect the background save in flight, if any: its report (also appended to
        :attr:`reports`), after which :attr:`chain` is the file it wrote (a side save's: the
        file before). Raises :class:`~stalwart.errors.BackgroundSaveError` if that save failed
        (its file was not written and the chain still ends at the file before)."""
        if self._pending is None:
            return None
        (call, search), self._pending = self._pending, None
        report, search_state = call.result()
        if search is not None and search_state is not None:
            search.load_state_dict(search_state)  # what the child's search chose
        self._saved(report)
        return report

    def _child_save(
        self,
        weights: Mapping[str, torch.Tensor],
        extra: Any,
        path: Path,
        request: ShrinkRequest,
        side: bool,
    ) -> tuple[ShrinkReport, dict | None]:
        report = self._save_now(weights, extra, path, request, side)
        return report, None if request.search is None else request.search.state_dict()

    def _saved(self, report: ShrinkReport) -> None:
        """Note a written file (in a background save: in the child, and again in the parent
        when it collects the report, since the child's notes die with it)."""
        self._note_choice(report)
        self.chain = report.chain  # a side save's is the file it extends: the chain stays there
        self.reports.append(report)
        self.collect_retired(Path(report.path).parent)

    def _save_now(
        self,
        weights: Mapping[str, torch.Tensor],
        extra: Any,
        path: Path,
        request: ShrinkRequest,
        side: bool,
    ) -> ShrinkReport:
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = self.chain
        if previous is not None and self._optimizer_changed(previous, extra):
            previous = None
        if previous is not None and (
            previous.position + 1 >= self.keyframe_every
            or not _still_holds(previous)
            or _location(previous.path) == _location(path)
            or {n: tuple(t.shape) for n, t in weights.items()} != previous.shapes
        ):
            previous = None
        _set_aside_if_needed(path, self.chain)
        if request.search is not None:
            _search_from(request.search, previous)
            request.search.lr_share = request.lr_share
        report = save(
            weights,
            path,
            previous=previous,
            evaluate=request.evaluate,
            screen=request.screen,
            tau=self.tau,
            gradients=request.gradients,
            config=self.config if request.evaluate is None else None,
            search=request.search,
            layer_types=request.layer_types,
            extra=extra,
            compress_optimizer=self.compress_optimizer,
            continue_training=request.continue_training,
            parameter_shapes=request.parameter_shapes,
            optimizer_choice=self._reusable_choice(previous, request),
            coder=self.coder,
            side=side,
        )
        self._saved(report)
        return report

    def _reusable_choice(
        self, previous: ChainState | None, request: ShrinkRequest
    ) -> MomentChoice | None:
        """The last check's choice, when this save may reuse it (see recheck_optimizer_every)."""
        checked = self._checked
        if (
            checked is None
            or previous is None  # a keyframe (or a new optimizer) is checked afresh
            or request.continue_training is None
            or self.compress_optimizer != "auto"
            or checked.setting.lossless  # a fallback: look for a compressed setting again
            or checked.degradation is None
            or checked.degradation > self.tau / 4
            or self._unchecked + 1 >= self.recheck_optimizer_every
        ):
            return None
        return checked

    def _note_choice(self, report: ShrinkReport) -> None:
        if report.optimizer is not None and report.optimizer.reused:
            self._unchecked += 1
        elif report.optimizer is not None and report.optimizer.degradation is not None:
            self._checked, self._unchecked = report.optimizer, 0  # a check ran
        else:
            self._checked, self._unchecked = None, 0

    def _in_another_folder(self, previous: ChainState, path: Path) -> bool:
        """Whether ``path`` is in another folder than the file the chain would extend: then it
        starts a keyframe, so that every folder restores on its own. Retiring files (save_top_k,
        Composer's rotation) looks at one folder, and users delete whole folders (an old run's,
        once a run resumed from it into a new one writes elsewhere): a delta on a file in
        another folder broke when either happened."""
        if _location(previous.path).parent == _location(path).parent:
            return False
        # Once loudly (it costs compression, and a filename with a "/" in it, e.g. a metric
        # named "val/acc", puts every checkpoint in a folder of its own), then quietly.
        say = log.info if self._warned_folders else log.warning
        self._warned_folders = True
        say(
            "%s is in another folder than %s, the file the chain would extend: it starts a new "
            "keyframe, so that each folder's checkpoints restore without the other's. To keep "
            "deltas, save into the folder the chain is in: resume into the same dirpath (not a "
            "new version_N folder of the logger's), with no '/' in the filename.",
            path, previous.path,
        )  # fmt: skip
        return True

    @staticmethod
    def _optimizer_changed(previous: ChainState, extra: Any) -> bool:
        if previous.optimizer_signature is None:
            return False  # a file from before signatures were recorded
        now = [optimizer_signature(state) for state in optimizer_states(extra)]
        if now == previous.optimizer_signature:
            return False
        log.warning(
            "the optimizer changed since %s (state keys / hyperparameters %s -> %s): this "
            "checkpoint starts a new keyframe",
            previous.path.name, previous.optimizer_signature, now,
        )  # fmt: skip
        return True

    def before_plain_save(self, path: str | os.PathLike) -> None:
        """Before another writer (``torch.save``, Lightning's own IO) writes ``path``: if a live
        delta was written against what it holds, that is moved aside first, as for a save of
        this writer's (nothing happens for a path no delta needs). The save in flight is waited
        for: it may be such a delta."""
        self.wait()
        _set_aside_if_needed(Path(path), self.chain)

    def load(
        self, path: str | os.PathLike, *, weights_only: bool = True
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """The weights and ``extra`` saved at ``path``; a resumed run continues this chain.
        ``weights_only`` as in :func:`stalwart.shrink.load_with_extra`."""
        self.wait()
        weights, extra, chain = load_with_extra(path, weights_only=weights_only)
        self.chain = chain
        return weights, extra

    def remove(self, path: str | os.PathLike) -> None:
        """Retire a checkpoint: deleted now if no live file depends on it, else once none does."""
        self.wait()  # the save in flight may be the file that still needs this one
        path = Path(path)
        retired = _read_retired(path.parent)
        retired.add(path.name)
        _write_retired(path.parent, retired)
        self.collect_retired(path.parent)

    def collect_retired(self, directory: Path) -> None:
        """Delete retired files that no live file depends on, directly or through others.

        A live file whose chain cannot be followed (a base missing or replaced, bases in a loop)
        may still need any of them, as far as anyone can tell: then nothing is deleted (a
        warning names the file) until it is restorable again or removed.
        """
        retired = _read_retired(directory)
        if not retired:
            return
        folder = _Folder.read(directory)
        live = [name for name in folder.crcs if name not in retired]
        live += _tip_names(self.chain, directory)
        needed, broken = folder.needed_by(live)
        if broken:
            log.warning(
                "%s: the base of %s was deleted or replaced, so it cannot be restored; no "
                "retired checkpoint is deleted while it may need one. Remove it if it is beyond "
                "repair.",
                directory, ", ".join(sorted(broken)),
            )  # fmt: skip
            return
        for name in sorted(retired - needed):
            (directory / name).unlink(missing_ok=True)
        _write_retired(directory, retired & needed)


def _still_holds(previous: ChainState) -> bool:
    """Whether the chain's last file still holds what this writer wrote there (or read from it).

    A file written over it since (``trainer.save_checkpoint`` by hand onto the newest
    checkpoint's path writes a plain file; a shrunken one from another writer has another
    CRC-32) is no base: a delta on it would be written against content no longer on disk and
    could never be restored, nor could any file after it. The next save is a keyframe instead.
    """
    if trailer_crc(previous.path) == previous.crc32:
        return True
    if previous.path.exists():
        log.warning(
            "%s was replaced since the chain wrote it (a plain save by hand to its path?): the "
            "next checkpoint starts a new keyframe instead of a delta on it",
            previous.path,
        )
    return False


def _location(path: Path) -> Path:
    """Where a write to ``path`` lands: its folder resolved, not a link at its name (a write
    replaces the link itself, not the file it points to)."""
    return path.parent.resolve() / path.name


@dataclass
class _Folder:
    """Who depends on whom in one checkpoint folder: each shrunken file's CRC-32 and the base it
    was written against, as (name, CRC-32); a base outside the folder is not followed (a
    :class:`ChainWriter` writes none: a save into another folder starts a keyframe)."""

    crcs: dict[str, int]
    bases: dict[str, tuple[str, int] | None]

    @classmethod
    def read(cls, directory: Path) -> _Folder:
        crcs: dict[str, int] = {}
        bases: dict[str, tuple[str, int] | None] = {}
        for candidate in directory.iterdir():
            # A killed writer's temp file may hold a whole header: it is no file of the chain.
            if durable.is_temp(candidate) or not candidate.is_file():
                continue
            header, crc = read_header(candidate), trailer_crc(candidate)
            if header is None or crc is None:
                continue
            crcs[candidate.name] = crc
            base = header.get("base")
            inside = base is not None and Path(base["file"]).parent == Path(".")
            bases[candidate.name] = (base["file"], base["crc32"]) if inside else None
        return cls(crcs, bases)

    def needed_by(self, live: list[str]) -> tuple[set[str], set[str]]:
        """The files ``live`` need (themselves included), and the files on their chains whose
        base cannot be found (missing, replaced, or bases in a loop)."""
        needed: set[str] = set()
        broken: set[str] = set()
        for root in live:
            walked: list[str] = []
            name: str | None = root
            while name is not None and name not in needed:
                if name in walked or (name not in self.crcs and walked):
                    broken.add(walked[-1])
                    break
                if name not in self.crcs:
                    break  # a live name that is no readable file (the tip, deleted) needs nothing
                walked.append(name)
                name = self._base_of(name)
            needed.update(walked)
        return needed, broken

    def _base_of(self, name: str) -> str | None:
        """The file holding what ``name`` was written against (the file at its base's path, or
        the copy set aside when that path was written again); None for a keyframe."""
        base = self.bases.get(name)
        if base is None:
            return None
        base_name, crc = base
        if self.crcs.get(base_name) == crc:
            return base_name
        return superseded_path(Path(base_name), crc).name  # missing from crcs: broken


def _set_aside_if_needed(path: Path, tip: ChainState | None) -> None:
    """Before ``path`` is written again: if a live file is a delta on what it holds now
    (directly or through others), move that aside (hidden, named by its CRC-32, where
    :func:`~stalwart.shrink.codec.chain_files` finds it) so the delta stays restorable.

    Side saves keep this from happening in ``ShrinkCheckpoint``; it happens where a caller
    writes a path again that the chain extended, e.g. Lightning's ``last.ckpt`` through
    :class:`~stalwart.plugins.ShrinkCheckpointIO` alone, once (from then on this writer
    writes that path as a side save). The copy is retired: deleted once nothing needs it.
    """
    if path.is_symlink() or not path.is_file():
        return  # writing over a link leaves the file it points to alone
    directory = path.parent
    folder = _Folder.read(directory)
    if path.name not in folder.crcs:
        return  # not a shrunken file
    retired = _read_retired(directory)
    live = [name for name in folder.crcs if name not in retired]
    live += _tip_names(tip, directory)
    needed, _ = folder.needed_by([name for name in live if name != path.name])
    if path.name in needed:
        kept = superseded_path(path, folder.crcs[path.name])
        os.replace(path, kept)
        durable.fsync_directory(directory)
        retired.add(kept.name)
        log.info("%s is written again; its former content is kept as %s: a delta needs it",
                 path, kept.name)  # fmt: skip
    if path.name in retired or path.name in needed:
        retired.discard(path.name)  # the file about to be written is live
        _write_retired(directory, retired)


def _tip_names(tip: ChainState | None, directory: Path) -> list[str]:
    """The chain's last file's name if it is in ``directory`` (live, even if retired: the
    next delta extends it)."""
    if tip is None or _location(tip.path).parent != directory.resolve():
        return []
    return [tip.path.name]


def _read_retired(directory: Path) -> set[str]:
    try:
        return set(json.loads((directory / RETIRED_FILE).read_text()))
    except (FileNotFoundError, ValueError):
        return set()


def _write_retired(directory: Path, names: set[str]) -> None:
    durable.write_json(directory / RETIRED_FILE, sorted(names))
