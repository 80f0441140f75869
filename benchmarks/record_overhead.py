"""What recording a run with stalwart's HindsightCallback costs, measured on this machine.

Part 1, wall-clock overhead of recording. The same seeded digits model (``examples/digits.py``)
is fitted with three variants, repetitions interleaved in rotating order:

* ``plain``: Lightning with ``enable_checkpointing=False, logger=False`` (the baseline);
* ``hindsight``: ``HindsightCallback`` (default materializer: on CPU a copy written by a
  background thread; default epsilon 1/15);
* ``modelckpt``: Lightning's ``ModelCheckpoint`` saving every training epoch (``save_top_k=-1``).

on two workloads: (a) a small checkpoint (the width-128 MLP, ~0.1 MB, the train set repeated 8x so
an epoch lasts about half a second) and (b) a large state with short epochs (width 4096, depth 3:
a 271 MB checkpoint of parameters plus SGD momentum, 2 batches and a validation pass per epoch).
Each fit is timed whole (``trainer.fit``), which includes waiting for the HindsightCallback's
background writers in ``on_train_end``: the forked children write concurrently on the same cores,
and that cost is part of the wall clock. Reported per variant: the median fit time, the overhead
against ``plain`` (median of the per-repetition paired ratios, their range, and the ratio of the
fastest fits), the checkpoints written and their size; for ``hindsight`` also its own accounting
(main-thread checkpoint time and measured interference of background writes with training,
as a fraction of compute) and the total time its background writers took; and a breakdown of
where each variant's fit time went (training batches, validation, the rest of the loop, after
``on_train_end``) with the CPU other processes used meanwhile, since a shared machine is noisy.

Part 2, main-thread cost of one checkpoint of the large model: its full Lightning checkpoint dict
(``dump_checkpoint`` after one epoch) is persisted, repetitions interleaved, by (1) an inline
``torch.save``, (2) Lightning's ``AsyncCheckpointIO`` (only the ``save_checkpoint`` call is timed;
it clones every tensor on the caller thread), (3) stalwart's ``ForkMaterializer.submit`` forking
(``small_bytes=0``) and (4) copying for its writer thread (the CPU default; only the submit is
timed), and (5) stalwart's ``InlineMaterializer`` (torch.save with a CRC and fsync). Each
writer is waited for outside the timed region. A fork child's file is loaded back and compared with
the original. Part 2 also measures what the fork defers: the first in-place write of the whole
state after a fork (copy-on-write faults, while the child still holds the pages) against the same
write with no child alive.

``--composer``: Composer's ``Hindsight`` algorithm on the Composer digits MLP in batches of 8
(``examples/composer_digits.py``; ~13 engine events a batch, Composer's worst case): plain vs a
no-op logger destination (what Composer charges for one more callback) vs the record with every
checkpoint vetoed vs the record, ``2 * --reps`` interleaved reps, the wall clock against the
record's own figure.

Run from the repository root (``--quick`` for a shorter run of about two minutes; the full run
takes about six to eight minutes on a 2-core machine)::

    .venv/bin/python benchmarks/record_overhead.py
    .venv/bin/python benchmarks/record_overhead.py --quick

``--matrix``: plain vs recorded over state size x epoch length x torch threads (``--sizes``,
``--epoch-seconds``, ``--matrix-threads``), each fit in a new Python process as a user's script
runs (``--process same``: all in this one). ``--malloc pinned`` runs both variants with glibc's
trim and mmap thresholds pinned: with the heap as it comes, a fresh process training a 10 MB
model faulted 1.8 million pages a plain fit and 38 thousand a recorded one (the record's copies
keep the heap from trimming), so the plain fit ran 22-32% slower than the recorded one beside it;
pinned, the two compare the record's own cost. ``--matrix --accelerator gpu`` trains the matrix's
models on a CUDA device (the record's writers run on the host either way; docs/gpu.md has what
one H100 gave). ``--matrix --floor`` adds a second plain fit to every round (an A/A comparison):
its ratio to the first is what this machine's wall clock reads as overhead when nothing is
recorded, side by side with the record's; the table also gives a distribution-free 95% interval of
each cell's median (none for fewer than 6 pairs) and, last, the median and interval of all
cells' pairs pooled; ``matrix.json`` keeps every fit's seconds. A second table says where each
cell's difference lands (training batches, the gaps between them, validation, the start and the
epochs' ends, the end of fit): the record's cost outside the batch loops, which identical fits
repeat to a few milliseconds, beside its own figure, apart from the batches, where the noise is.

``--write-path``: only what one background checkpoint write of each ``--sizes`` MB takes from a
Python loop on the main thread and the writer's CPU time, torch writing the file by name through
the page cache (as stalwart did) against torch writing past it into a ``DirectFile`` (as
``write_checkpoint`` does), interleaved, each write to a new file as a record's are.

``--copy-path``: only what the writer thread's copy of a ``--sizes`` MB checkpoint costs the
training thread: a fresh copy (freed once written; a CPU state's copies) against a copy into the
buffers of the last one written (a CUDA state's copies, into its pinned memory), interleaved, with
the page faults of each.

``--threads`` sets ``torch.set_num_threads`` for every variant (default 1, leaving the second core
of a 2-core machine to background writers, as a GPU job leaves CPU cores idle).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from scipy.stats import quantile_test
from torch.utils import _pytree as pytree
from torch.utils.data import TensorDataset

from stalwart.callbacks.lightning_internals import dump_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from digits import DigitsClassifier, DigitsDataModule  # noqa: E402

import stalwart  # noqa: E402
from stalwart import durable  # noqa: E402
from stalwart.hindsight.checkpoint_file import write_checkpoint  # noqa: E402
from stalwart.hindsight.materializer import (  # noqa: E402
    ForkMaterializer,
    InlineMaterializer,
    WriteJob,
    host_copy,
    python_slowdown,
    refill_copy,
)

EPSILON = 1 / 15
MB = 1e6
VARIANTS = ("plain", "hindsight", "modelckpt")
PLAIN_AGAIN = "plain again"  # the matrix's --floor: a second plain fit, the A/A comparison
FIT_PARTS = ("train", "gaps", "validation", "rest", "end")  # a fit's seconds (FitResult)


# -- workloads ----------------------------------------------------------------------------------


class RepeatedDigits(DigitsDataModule):
    """The digits data module with its train split repeated ``repeats`` times (longer epochs)."""

    def __init__(self, batch_size: int, train_size: int = 1437, repeats: int = 1) -> None:
        super().__init__(batch_size=batch_size, train_size=train_size)
        self.repeats = repeats

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        x, y = self.train.tensors
        self.train = TensorDataset(x.repeat(self.repeats, 1), y.repeat(self.repeats))


@dataclass(frozen=True)
class Workload:
    name: str
    width: int
    depth: int
    batch_size: int
    train_size: int
    repeats: int
    epochs: int

    def model(self) -> DigitsClassifier:
        L.seed_everything(0, verbose=False)
        return DigitsClassifier(width=self.width, depth=self.depth, lr=0.05)

    def data(self) -> RepeatedDigits:
        return RepeatedDigits(self.batch_size, self.train_size, self.repeats)

    def describe(self) -> str:
        params = 64 * self.width + (self.depth - 1) * self.width**2 + 10 * self.width
        return (
            f"width={self.width} depth={self.depth} (~{params / 1e6:.2f}M params), "
            f"batch={self.batch_size}, train={self.train_size}x{self.repeats} samples, "
            f"{self.epochs} epochs"
        )


#: Where the matrix trains (``--accelerator``); the other parts always run on CPU.
ACCELERATOR = {"name": "cpu"}
#: glibc's heap settings for the matrix's fresh processes (``--malloc``): ``pinned`` stops the
#: heap from handing large freed buffers back to the system and faulting them in again, a churn
#: that moved plain fits of 10-100 MB models by 10-30% with the process's history, and that a
#: record's own allocations shift either way (docs/measurements/hindsight.md).
MALLOC = {"default": {}, "pinned": {"MALLOC_TRIM_THRESHOLD_": "4294967296",
                                    "MALLOC_MMAP_THRESHOLD_": "4294967296"}}  # fmt: skip
CHILD_ENV: dict[str, str] = {}


def trainer(epochs: int, callbacks: list | None = None, checkpointing: bool = False) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator=ACCELERATOR["name"],
        devices=1,
        logger=False,
        enable_checkpointing=checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
    )


# -- helpers ------------------------------------------------------------------------------------


def settle() -> None:
    """Between measurements, outside any timing: free memory, flush dirty pages to disk."""
    gc.collect()
    os.sync()


def assert_children_reaped() -> None:
    """Fail if this process has a live or unreaped child left (e.g. a writer not waited for)."""
    if ACCELERATOR["name"] != "cpu":  # the CUDA runtime keeps helper children of its own
        return
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return
    raise RuntimeError(f"a child process was left behind (waitpid returned pid {pid})")


def source_revision(root: Path = ROOT) -> str:
    """The git commit of the benchmarked checkout, marked dirty if stalwart/ has local changes."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "stalwart"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git checkout"
    return f"commit {commit}{' + local changes' if dirty else ''}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def median_interval(values: list[float], coverage: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median (scipy's binomial quantile test, installed
    with scikit-learn), or None where there are too few values for ``coverage`` (e.g. 4 pairs:
    even min..max covers only 87.5%)."""
    test = quantile_test(values, q=statistics.median(values), p=0.5)
    low, high = test.confidence_interval(coverage)
    return None if math.isnan(low) else (float(low), float(high))


def rotated(items: tuple[str, ...], rep: int) -> list[str]:
    shift = rep % len(items)
    return [*items[shift:], *items[:shift]]


def dir_checkpoints(path: Path) -> list[Path]:
    return sorted(path.rglob("*.ckpt"))


def same_tree(a: Any, b: Any) -> bool:
    """Structural equality of nested checkpoint dicts; tensors compared whole (torch.equal)."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def state_tensors(checkpoint: dict) -> list[torch.Tensor]:
    """The model and optimizer tensors of a checkpoint (the ones training rewrites every step)."""
    leaves = pytree.tree_leaves([checkpoint["state_dict"], checkpoint["optimizer_states"]])
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.numel() > 1]


def rewrite(tensors: list[torch.Tensor]) -> float:
    """Write every byte of ``tensors`` in place without changing a value; return the seconds."""
    start = time.perf_counter()
    for tensor in tensors:
        tensor.mul_(1)
    return time.perf_counter() - start


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(
        h.rjust(w) if i else h.ljust(w)
        for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    )
    out = [line, "-" * len(line)]
    for row in rows:
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(out)


# -- part 1 -------------------------------------------------------------------------------------


class Clock(Callback):
    """Where a fit's time goes: training batches, the gaps between an epoch's batches (loading
    the next, the batch hooks of the callbacks listed after this one), validation, and the end of
    fit (after every callback's ``on_train_end`` starts, e.g. waiting for background writers).
    Listed first, in every variant alike; it costs two clock reads per batch."""

    def __init__(self) -> None:
        self.train = self.gaps = self.validation = 0.0
        self.train_end_at = 0.0
        self._started = 0.0
        self._last_end: float | None = None

    def on_train_epoch_start(self, *args: Any) -> None:
        self._last_end = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._started = time.perf_counter()
        if self._last_end is not None:
            self.gaps += self._started - self._last_end

    def on_train_batch_end(self, *args: Any) -> None:
        self._last_end = time.perf_counter()
        self.train += self._last_end - self._started

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.validation += time.perf_counter() - self._started

    def on_train_end(self, *args: Any) -> None:
        self.train_end_at = time.perf_counter()


class ForeignCpu:
    """CPU seconds that processes other than this one and its reaped children used meanwhile
    (from /proc/stat; kernel threads doing our writeback count as other), per second of wall."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
        busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
        own = sum(os.times()[:4])
        return busy, own, time.perf_counter()

    def cores(self) -> float:
        end = self._sample()
        if self._start is None or end is None:
            return float("nan")
        (busy0, own0, t0), (busy1, own1, t1) = self._start, end
        return max((busy1 - busy0) - (own1 - own0), 0.0) / (t1 - t0)


@dataclass
class FitResult:
    seconds: float
    train: float = 0.0
    validation: float = 0.0
    end: float = 0.0
    gaps: float = 0.0  # between the batches of an epoch
    other_cores: float = 0.0
    checkpoints: int = 0
    initial: int = 0
    decided: int = 0
    ckpt_bytes: int = 0
    policy_overhead: float = 0.0
    main_thread_seconds: float = 0.0
    interference_seconds: float = 0.0
    background_seconds: float = 0.0
    max_gap: int = 0
    gap_bound: int = 0
    faults: int = 0  # minor page faults of this process during fit (the C heap's churn)
    forks: int = 0  # checkpoints the materializer wrote from a forked child
    copies: int = 0  # ... and from a copy handed to its writer thread

    @property
    def rest(self) -> float:
        """The fit outside the epochs' batch loops: its start (setup, sanity check, the first
        batch's data) and the epochs' ends (hooks, checkpoints, the next epoch's start)."""
        return self.seconds - self.train - self.gaps - self.validation - self.end


def fit_once(workload: Workload, variant: str) -> FitResult:
    settle()
    model, data = workload.model(), workload.data()
    with tempfile.TemporaryDirectory(prefix=f"stalwart-bench-{variant}-") as tmp:
        tmpdir = Path(tmp)
        clock = Clock()
        if variant in ("plain", PLAIN_AGAIN):
            fit_trainer = trainer(workload.epochs, [clock])
        elif variant == "hindsight":
            materializer = ForkMaterializer()  # the default, kept to read the path it took
            callback = stalwart.HindsightCallback(
                dirpath=tmpdir, epsilon=EPSILON, materializer=materializer
            )
            fit_trainer = trainer(workload.epochs, [clock, callback])
        else:
            callback = ModelCheckpoint(
                dirpath=tmpdir,
                every_n_epochs=1,
                save_top_k=-1,
                save_on_train_epoch_end=True,
            )
            fit_trainer = trainer(workload.epochs, [clock, callback], checkpointing=True)
        foreign = ForeignCpu()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        fit_trainer.fit(model, data)
        end = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        other_cores = foreign.cores()
        assert_children_reaped()
        result = FitResult(
            end - start,
            clock.train,
            clock.validation,
            end - clock.train_end_at,
            gaps=clock.gaps,
            other_cores=other_cores,
        )
        result.faults = faults
        if variant == "hindsight":
            store = stalwart.hindsight.open(tmpdir)
            try:
                run = store.run()
                decisions = run.decisions()
                written = store.query(
                    "SELECT epoch, nbytes, write_seconds FROM checkpoints WHERE run_id = ?",
                    (run.run_id,),
                )
                # Epoch checkpoints; a state-before-training one (epoch < 0) is counted apart.
                result.checkpoints = int((written["epoch"] >= 0).sum())
                result.initial = int((written["epoch"] < 0).sum())
                result.decided = int(decisions["checkpoint"].sum())
                result.ckpt_bytes = int(written["nbytes"].max()) if len(written) else 0
                result.background_seconds = float(written["write_seconds"].sum())
                result.main_thread_seconds = float(decisions["measured_cost"].fillna(0.0).sum())
                if "interference" in decisions:  # slowdown of batches by background writes
                    result.interference_seconds = float(decisions["interference"].sum())
                # The record's own figure, as its summary prints it: checkpoints (main thread,
                # deferred writes, interference) plus start, finish and log capture.
                result.policy_overhead = callback.policy.overhead
                result.max_gap, result.gap_bound = checkpoint_coverage(decisions, EPSILON)
                result.forks, result.copies = materializer.forks, materializer.copies
            finally:
                store.close()
        elif variant == "modelckpt":
            files = dir_checkpoints(tmpdir)
            result.checkpoints = result.decided = len(files)
            result.ckpt_bytes = max((f.stat().st_size for f in files), default=0)
    del fit_trainer, model, data
    return result


def fit_in_fresh_process(workload: Workload, variant: str) -> FitResult:
    """``fit_once`` in a new Python process, as a user's training script runs: no earlier fit's
    heap, caches or threads carry over (the C heap's history moved a 100 MB cell's plain fits
    by 10-20% within one process). Only ``fit`` is timed, in the child, as in ``fit_once``
    (which also settles the machine there first)."""
    request = {
        "workload": asdict(workload),
        "variant": variant,
        "threads": torch.get_num_threads(),
        "accelerator": ACCELERATOR["name"],
    }
    child = subprocess.run(
        [sys.executable, __file__, "--one-fit", json.dumps(request)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **CHILD_ENV},
    )
    if child.returncode != 0:
        raise RuntimeError(f"a {variant} fit in a fresh process failed:\n{child.stderr[-4000:]}")
    return FitResult(**json.loads(child.stdout.strip().splitlines()[-1]))


def one_fit(request: str) -> None:
    """The child's side of ``fit_in_fresh_process``: one fit, its result as a JSON line."""
    spec = json.loads(request)
    torch.set_num_threads(spec["threads"])
    ACCELERATOR["name"] = spec["accelerator"]
    result = fit_once(Workload(**spec["workload"]), spec["variant"])
    print(json.dumps(asdict(result)), flush=True)


def checkpoint_coverage(decisions: Any, epsilon: float) -> tuple[int, int]:
    """The most epochs a replay of one epoch re-executes (from the checkpoint before it; -1 is
    the initial state) and its bound ``ceil(r / eps) + 1``, r = the median cost the policy
    decided with (measured main thread, deferred write and interference of recent checkpoints)
    / mean compute. Epoch ``e`` replays from the last checkpoint before it, so after the last
    checkpoint ``c`` the run's last epoch ``L`` costs ``L - c``; the record never checkpoints
    ``L`` itself (no replay starts there)."""
    taken = [-1, *decisions.epoch[decisions.checkpoint == 1].tolist()]
    last = int(decisions.epoch.max())
    gaps = [b - a for a, b in zip(taken, [*taken[1:], last], strict=True)]
    costs = decisions.materialize_cost.dropna()
    if costs.empty:
        return max(gaps), 0
    ratio = float(costs.median()) / float(decisions.compute_time.mean())
    return max(gaps), math.ceil(ratio / epsilon) + 1


def gap_over_bound(max_gap: int, gap_bound: int) -> bool:
    """Whether a record went longer without a checkpoint than its bound (0: no cost measured)."""
    return gap_bound > 0 and max_gap > gap_bound


def part1(workload: Workload, reps: int) -> dict[str, Any]:
    print(f"\n== Part 1{workload.name}: {workload.describe()}", flush=True)
    fit_once(replace(workload, epochs=2), "plain")  # warm-up (imports, allocator): not reported
    results: dict[str, list[FitResult]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for variant in rotated(VARIANTS, rep):
            results[variant].append(fit_once(workload, variant))
        times = "  ".join(
            f"{v}={results[v][-1].seconds:.2f}s (other CPU {results[v][-1].other_cores:.2f})"
            for v in VARIANTS
        )
        print(f"  rep {rep + 1}/{reps}: {times}", flush=True)

    plain = [r.seconds for r in results["plain"]]
    rows = []
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        runs = results[variant]
        secs = [r.seconds for r in runs]
        paired = [r.seconds / p - 1 for r, p in zip(runs, plain, strict=True)]
        overhead = median(paired)
        summary[variant] = overhead
        ckpts = sorted({r.checkpoints for r in runs})
        decided = sorted({r.decided for r in runs})
        size = max(r.ckpt_bytes for r in runs) / MB
        is_plain = variant == "plain"
        within_budget = "-" if is_plain else "yes" if overhead <= EPSILON else "no"
        if variant == "hindsight" and overhead > EPSILON:
            within_budget = "NO"  # the target; for ModelCheckpoint it is informational
        rows.append(
            [
                variant,
                f"{median(secs):.2f}",
                "-" if is_plain else f"{overhead:+.1%}",
                "-" if is_plain else f"{min(paired):+.1%}..{max(paired):+.1%}",
                "-" if is_plain else f"{min(secs) / min(plain) - 1:+.1%}",
                "/".join(map(str, ckpts))
                + ("" if decided == ckpts else f" (decided {decided})")
                + (" + initial" if any(r.initial for r in runs) else ""),
                f"{size:.1f}" if size else "-",
                within_budget,
            ]
        )
    headers = [
        "variant",
        "fit s (median)",
        "overhead (median)",
        "range",
        "overhead (min/min)",
        "checkpoints",
        "ckpt MB",
        f"<= eps {EPSILON:.2%}",
    ]
    print(table(headers, rows))
    hindsight = results["hindsight"]
    print(
        "  overhead: median over repetitions of (fit time / plain fit time of the same"
        " repetition) - 1, with its\n  range; min/min: fastest fit / fastest plain fit - 1"
        " (robust to noise that only adds time);\n  checkpoints: files written per fit (each"
        " distinct count over the repetitions).\n  HindsightCallback's own accounting, median"
        f" per fit: main thread {median([r.main_thread_seconds for r in hindsight]):.2f} s +"
        " interference with\n  training batches"
        f" {median([r.interference_seconds for r in hindsight]):.2f} s ="
        f" {median([r.policy_overhead for r in hindsight]):.2%} of compute; its forked children"
        " wrote for\n  "
        f"{median([r.background_seconds for r in hindsight]):.2f} s in total (serialize + CRC +"
        " fsync, concurrently with training)."
    )
    breakdown = []
    for variant in VARIANTS:
        runs = results[variant]
        parts = {
            "train batches": [r.train for r in runs],
            "validation": [r.validation for r in runs],
            "rest of loop": [r.seconds - r.train - r.validation - r.end for r in runs],
            "after on_train_end": [r.end for r in runs],
        }
        breakdown.append(
            [variant, *(f"{median(v):.2f}" for v in parts.values())]
            + [f"{median([r.other_cores for r in runs]):.2f}"]
        )
    print("  where the fit time went (medians, seconds):")
    print(
        table(
            [
                "variant",
                "train batches",
                "validation",
                "rest of loop",
                "after on_train_end",
                "other CPU (cores)",
            ],
            breakdown,
        )
    )
    print(
        "  rest of loop: setup, sanity check, epoch ends (checkpoint calls, batch-end hooks);"
        " after on_train_end:\n  waiting for background writers, teardown; other CPU: cores"
        " busy with other processes meanwhile."
    )
    summary["ckpt_mb"] = max(r.ckpt_bytes for r in results["modelckpt"]) / MB
    return summary


# -- part 2 -------------------------------------------------------------------------------------


@dataclass
class Part2:
    blocked: dict[str, list[float]] = field(default_factory=dict)
    until_done: dict[str, list[float]] = field(default_factory=dict)
    verified: bool = False


def time_writer(name: str, checkpoint: dict, directory: Path, rep: int, part: Part2) -> None:
    path = directory / f"{name}-{rep}.ckpt"
    wait: Callable[[], None]
    if name == "torch.save":
        start = time.perf_counter()
        torch.save(checkpoint, path)
        blocked = time.perf_counter() - start

        def wait() -> None:
            pass
    elif name == "AsyncCheckpointIO":
        io = AsyncCheckpointIO(TorchCheckpointIO())
        start = time.perf_counter()
        io.save_checkpoint(checkpoint, path)
        blocked = time.perf_counter() - start
        wait = io.teardown
    elif name in ("Fork submit", "Copy submit"):
        materializer = ForkMaterializer(small_bytes=0 if name == "Fork submit" else None)
        start = time.perf_counter()
        materializer.submit(WriteJob(checkpoint, path))
        blocked = time.perf_counter() - start

        def wait() -> None:
            materializer.close()
            if materializer.failures:
                raise RuntimeError(f"fork materializer failed: {materializer.failures}")
    else:
        materializer = InlineMaterializer()
        start = time.perf_counter()
        materializer.submit(WriteJob(checkpoint, path))
        blocked = time.perf_counter() - start

        def wait() -> None:
            pass

    wait()
    done = time.perf_counter() - start
    assert_children_reaped()
    if name == "Fork submit" and not part.verified:
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        if not same_tree(loaded, checkpoint):
            raise RuntimeError(f"{path} written by the fork materializer differs from the original")
        part.verified = True
        del loaded
    path.unlink()
    part.blocked.setdefault(name, []).append(blocked)
    part.until_done.setdefault(name, []).append(done)


def cow_penalty(checkpoint: dict, reps: int) -> tuple[float, float, float]:
    """Median seconds of rewriting the state in place: no child, right after a fork whose child
    holds the pages (as a writer does), and that fork's own cost."""
    tensors = state_tensors(checkpoint)
    rewrite(tensors)
    alone, after_fork, forks = [], [], []
    for _ in range(reps):
        settle()
        alone.append(rewrite(tensors))
        read_fd, write_fd = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # hold the copy-on-write snapshot until the parent is done, then leave
            os.close(write_fd)
            os.read(read_fd, 1)
            os._exit(0)
        forks.append(time.perf_counter() - start)
        os.close(read_fd)
        after_fork.append(rewrite(tensors))
        os.write(write_fd, b"x")
        os.close(write_fd)
        os.waitpid(pid, 0)
    return median(alone), median(after_fork), median(forks)


def part2(workload: Workload, reps: int) -> dict[str, float]:
    print(f"\n== Part 2: main-thread cost of one checkpoint of the large model ({reps} reps)")
    settle()
    model, data = workload.model(), workload.data()
    one_epoch = trainer(1)
    one_epoch.fit(model, data)
    checkpoint = dump_checkpoint(one_epoch)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(checkpoint))
    print(f"  checkpoint tensors: {nbytes / MB:.1f} MB (parameters + SGD momentum)")
    names = ("torch.save", "AsyncCheckpointIO", "Fork submit", "Copy submit", "InlineMaterializer")
    part = Part2()
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-part2-") as tmp:
        for rep in range(reps):
            for name in rotated(names, rep):
                settle()
                time_writer(name, checkpoint, Path(tmp), rep, part)
            print(
                f"  rep {rep + 1}/{reps}: "
                + "  ".join(f"{n}={part.blocked[n][-1] * 1e3:.0f}ms" for n in names),
                flush=True,
            )
    fork = median(part.blocked["Fork submit"])
    rows = [
        [
            n,
            f"{median(part.blocked[n]) * 1e3:.1f}",
            f"{min(part.blocked[n]) * 1e3:.1f}..{max(part.blocked[n]) * 1e3:.1f}",
            f"{median(part.until_done[n]):.2f}",
            f"{fork / median(part.blocked[n]):.3f}",
        ]
        for n in names
    ]
    print(table(["writer", "blocked ms (med)", "range ms", "until written s", "fork / this"], rows))
    print(
        "  blocked: time the calling thread spent in the call; until written: call to file"
        " complete\n  (torch.save and AsyncCheckpointIO leave data in the page cache, stalwart"
        " fsyncs)."
    )
    print(
        f"  fork child's file loads back with torch.load and equals the original: {part.verified}"
    )
    alone, after_fork, fork_cost = cow_penalty(checkpoint, reps)
    print(
        f"  deferred copy-on-write: rewriting the {nbytes / MB:.0f} MB of state in place takes"
        f" {alone * 1e3:.0f} ms alone,\n  {after_fork * 1e3:.0f} ms right after a fork"
        f" ({fork_cost * 1e3:.0f} ms) while the child holds the pages:"
        f" +{(after_fork - alone) * 1e3:.0f} ms that training pays\n  on its next optimizer step"
        " and no timer of the fork sees."
    )
    ratios = {
        "fork/torch.save": fork / median(part.blocked["torch.save"]),
        "fork/async": fork / median(part.blocked["AsyncCheckpointIO"]),
        "verified": float(part.verified),
    }
    del checkpoint, one_epoch, model, data
    return ratios


# -- main ---------------------------------------------------------------------------------------


# -- the matrix (--matrix) -----------------------------------------------------------------------

MATRIX_STATE_MB = (1, 10, 100, 500)
MATRIX_EPOCH_SECONDS = (0.1, 1.0, 5.0)
MATRIX_THREADS = (1, 2)
CELL_BUDGET_SECONDS = 20 * 60
MAX_REPS = 12  # pairs per cell at most, however short its fits
VALIDATION_SAMPLES = 360  # digits' validation split


def step_seconds(width: int, depth: int, batch_size: int) -> float:
    """Seconds of one training step (forward, backward, SGD step) of the model, measured."""
    device = "cuda" if ACCELERATOR["name"] == "gpu" else "cpu"
    model = DigitsClassifier(width=width, depth=depth).net.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, 64, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def width_for(state_mb: float) -> int:
    """The width of a depth-3 digits MLP whose weights + SGD momentum are ~state_mb."""
    return max(8, int(math.sqrt(state_mb * MB / 8 / 2)))  # 2 hidden layers of width^2 weights


def sized_workload(state_mb: float, epoch_seconds: float, epochs: int) -> Workload | str:
    """A digits MLP whose checkpoint (weights + SGD momentum) is ~state_mb and whose epoch lasts
    ~epoch_seconds on this machine now; or why no such workload fits."""
    depth, batch_size = 3, 32
    width = width_for(state_mb)
    step = step_seconds(width, depth, batch_size)
    validation = VALIDATION_SAMPLES / batch_size * step / 3  # forward only
    batches = round((epoch_seconds - validation) / step)
    if batches < 1:
        return f"one step + validation take {step + validation:.2f} s > {epoch_seconds} s"

    def sized(batches: int, epochs: int) -> Workload:
        samples = batches * batch_size
        train_size = min(samples, 1437)
        return Workload(
            f" {state_mb} MB / {epoch_seconds} s",
            width=width,
            depth=depth,
            batch_size=batch_size,
            train_size=train_size,
            repeats=math.ceil(samples / train_size),
            epochs=epochs,
        )

    # A Lightning batch costs more than the bare step (the loop, its hooks, data loading): a
    # small model's epoch sized from the step alone ran 2-3x too long. One epoch of a plain fit
    # is timed as the difference of a 2- and a 1-epoch fit (the fit's start cancels out), three
    # times, the median kept: sized from one difference, the same cell's epochs came out 0.07 s
    # in one run and 0.19 s in another (two-thread fits here are bimodal), and its fixed costs
    # weighed 2.6x as much in the one as in the other.
    probe = sized(max(1, min(batches, round(1.0 / step))), 1)
    probe_batches = math.ceil(probe.train_size * probe.repeats / batch_size)
    timings = []
    for _ in range(3):
        one, two = fit_once(probe, "plain"), fit_once(replace(probe, epochs=2), "plain")
        timings.append((two.seconds - one.seconds - two.validation / 2, two.validation / 2))
    per_epoch, validation = statistics.median(timings)
    per_batch = per_epoch / probe_batches
    batches = round((epoch_seconds - validation) / per_batch)
    if batches < 1:
        return f"one batch + validation take {per_batch + validation:.2f} s > {epoch_seconds} s"
    return sized(batches, epochs)


def write_path(sizes_mb: list[float], reps: int) -> None:
    """What a writer thread's checkpoint takes from a Python loop on the main thread (the
    interpreter lock) and how much CPU it uses, interleaved: torch writing the file by name
    through the page cache (``write_checkpoint`` before 2026-11-30) against torch writing into a
    :class:`stalwart.durable.DirectFile`, past the page cache (``write_checkpoint`` now, from
    ``DIRECT_WRITE_BYTES``). Every write goes to a new file kept to the end of its row, as a
    record keeps its checkpoints: a file written over the last one reuses its pages and hides
    what fresh ones cost."""
    print(f"\n== Write path: a writer thread's checkpoint vs a Python loop ({reps} reps)")
    rows = [write_path_row(state_mb, reps) for state_mb in sizes_mb]
    headers = ["checkpoint", "loop lost ms, page cache (median, range)", "direct",
               "writer CPU ms, page cache (median, range)", "direct",
               "writer CPU, direct / page cache"]  # fmt: skip
    print(table(headers, rows))


def one_epoch_checkpoint(state_mb: float) -> tuple[dict, int]:
    """The Lightning checkpoint of a ~``state_mb`` MB digits MLP after one epoch, and the bytes
    of its model and optimizer tensors."""
    workload = Workload("", width_for(state_mb), 3, 32, train_size=64, repeats=1, epochs=1)
    one_epoch = trainer(1)
    one_epoch.fit(workload.model(), workload.data())
    checkpoint = dump_checkpoint(one_epoch)
    return checkpoint, sum(t.numel() * t.element_size() for t in state_tensors(checkpoint))


def median_range(values: list[float], suffix: str = "") -> str:
    """``median (min..max)``, two decimals."""
    return f"{median(values):.2f}{suffix} ({min(values):.2f}..{max(values):.2f})"


def write_path_row(state_mb: float, reps: int) -> list[str]:
    checkpoint, nbytes = one_epoch_checkpoint(state_mb)
    checkpoint = host_copy(checkpoint)
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-write-") as tmp:
        ways: dict[str, Callable[[Path], Any]] = {
            "page cache": lambda path: durable.save_torch(checkpoint, path, seal=False),
            "direct": lambda path: write_checkpoint(checkpoint, path, direct=True),
        }
        lost: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for rep in range(reps):
            for name in rotated(tuple(ways), rep):
                path = Path(tmp) / f"{name.replace(' ', '-')}-{rep}.ckpt"
                taken, used = python_slowdown(lambda: ways[name](path))  # noqa: B023
                lost[name].append(taken * 1e3)
                cpu[name].append(used * 1e3)
    ratios = [new / was for new, was in zip(cpu["direct"], cpu["page cache"], strict=True)]
    return [
        f"{nbytes / MB:.1f} MB", median_range(lost["page cache"]), median_range(lost["direct"]),
        median_range(cpu["page cache"]), median_range(cpu["direct"]), median_range(ratios, "x"),
    ]  # fmt: skip


#: The callback's hooks at a fit's start and end, where the record's fixed cost is spent.
START_HOOKS = ("setup", "on_fit_start", "on_train_start")
END_HOOKS = ("on_train_end", "teardown")


def start_end(reps: int) -> None:
    """What the record adds at a fit's start (the store, the hooks' fingerprints, ``init.ckpt``'s
    copy) and end (the last writes, the run's row, the store's close), hook by hook over ``reps``
    recorded fits of a ~1 MB state in 20 short epochs (the 1 MB / 0.1 s cell), in this process.
    Run it with another checkout first on ``PYTHONPATH`` to compare two versions side by side."""
    workload = Workload(" 1 MB", width=250, depth=3, batch_size=32, train_size=224, repeats=1,
                        epochs=20)  # fmt: skip
    seconds: dict[str, list[float]] = {hook: [] for hook in START_HOOKS + END_HOOKS}
    fits = []
    for rep in range(reps + 1):  # the first fit warms imports and caches: not counted
        with tempfile.TemporaryDirectory(prefix="stalwart-bench-start-end-") as tmp:
            callback = stalwart.HindsightCallback(dirpath=tmp, epsilon=EPSILON)
            for hook in seconds:
                setattr(callback, hook, _timed(getattr(callback, hook), seconds[hook], rep > 0))
            start = time.perf_counter()
            trainer(workload.epochs, [callback]).fit(workload.model(), workload.data())
            if rep > 0:
                fits.append(time.perf_counter() - start)
    rows = [[hook, median_range([t * 1e3 for t in seconds[hook]])] for hook in seconds]
    for name, hooks in (("start", START_HOOKS), ("end", END_HOOKS)):
        sums = [sum(seconds[hook][i] for hook in hooks) * 1e3 for i in range(reps)]
        rows.append([f"**{name}**", median_range(sums)])
    checkout = Path(stalwart.__file__).parent.parent
    print(f"\n== The record's start and end ({reps} fits of {median(fits):.2f} s, stalwart at "
          f"{checkout}, {source_revision(checkout)})")  # fmt: skip
    print(table(["callback hook", "ms (median, range)"], rows))


def _timed(hook: Callable[..., Any], into: list[float], keep: bool) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            if keep:
                into.append(time.perf_counter() - start)

    return timed


def copy_path(sizes_mb: list[float], reps: int) -> None:
    """What the writer thread's copy of a checkpoint costs the training thread, interleaved: a
    fresh copy (allocated, then freed once written: a CPU state's copies) against a copy into
    the buffers of the last one written (``refill_copy``: a CUDA state's copies, into pinned
    memory), with the minor page faults each takes; CPU state, this process's heap as it comes.
    Cheaper on the training thread is not cheaper for the fit: docs/measurements/hindsight.md has
    why a CPU state's copies stay fresh."""
    print(f"\n== Copy path: a checkpoint's copy for the writer thread ({reps} reps)")
    rows = [copy_path_row(state_mb, reps) for state_mb in sizes_mb]
    headers = ["checkpoint", "fresh copy ms (median, range)", "page faults",
               "into the last copy ms", "page faults", "fresh / into the last"]  # fmt: skip
    print(table(headers, rows))


def copy_path_row(state_mb: float, reps: int) -> list[str]:
    checkpoint, nbytes = one_epoch_checkpoint(state_mb)
    last = host_copy(checkpoint)  # the copy the writer thread wrote last
    if refill_copy(last, checkpoint) is None:
        raise RuntimeError("a Lightning checkpoint could not be copied into its own last copy")

    def fresh() -> None:
        copied = host_copy(checkpoint)
        del copied  # written and dropped, as the writer thread did

    ways = {"fresh": fresh, "into the last": lambda: refill_copy(last, checkpoint)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    faults: dict[str, list[int]] = {name: [] for name in ways}
    for rep in range(reps):
        for name in rotated(tuple(ways), rep):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            ways[name]()
            seconds[name].append((time.perf_counter() - start) * 1e3)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    ratios = [a / b for a, b in zip(seconds["fresh"], seconds["into the last"], strict=True)]
    return [
        f"{nbytes / MB:.1f} MB", median_range(seconds["fresh"]),
        f"{median(faults['fresh']):.0f}", median_range(seconds["into the last"]),
        f"{median(faults['into the last']):.0f}", median_range(ratios, "x"),
    ]  # fmt: skip


def matrix(args: argparse.Namespace) -> None:
    """Plain vs recorded over state size x epoch length x torch threads, interleaved."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "matrix.json"
    done = json.loads(results_path.read_text()) if results_path.exists() else {}
    sizes = [float(v) for v in args.sizes.split(",")]
    lengths = [float(v) for v in args.epoch_seconds.split(",")]
    threads = [int(v) for v in args.matrix_threads.split(",")]
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for size in sizes:
            for length in lengths:
                key = f"{size:g}MB/{length:g}s/{n_threads}t"
                if key in done:
                    continue
                fits = 3 if args.floor else 2  # plain + recorded (+ plain again)
                pair = fits * (args.epochs * length * 1.1 + 2)  # seconds, one of each
                # Short cells are cheap and as noisy as long ones (pairs range over +-5 points
                # here): more pairs where they fit the per-cell time, --reps at least.
                reps = max(args.reps, min(MAX_REPS, int(args.cell_seconds / pair)))
                estimate = reps * pair
                workload = sized_workload(size, length, args.epochs)
                if isinstance(workload, str) or estimate > CELL_BUDGET_SECONDS:
                    why = workload if isinstance(workload, str) else f"~{estimate:.0f} s > budget"
                    done[key] = {"skipped": why}
                    print(f"{key}: skipped ({why})", flush=True)
                else:
                    done[key] = matrix_cell(
                        workload, reps, fresh=args.process == "fresh", floor=args.floor
                    )
                    print(f"{key}: {done[key]}", flush=True)
                results_path.write_text(json.dumps(done, indent=1))
    print_matrix(done)


def matrix_cell(
    workload: Workload, reps: int, fresh: bool = False, floor: bool = False
) -> dict[str, Any]:
    """``reps`` rounds of plain and recorded fits in rotating order; with ``floor`` a second
    plain fit joins each round, and the two plain fits' ratio is what the wall clock of this
    machine reads as overhead when there is none (an A/A comparison, measured side by side)."""
    fit = fit_in_fresh_process if fresh else fit_once
    if not fresh:
        fit_once(replace(workload, epochs=2), "plain")  # warm-up
    variants = ("plain", "hindsight", PLAIN_AGAIN) if floor else ("plain", "hindsight")
    fits: dict[str, list[FitResult]] = {v: [] for v in variants}
    for rep in range(reps):
        for variant in rotated(variants, rep):
            fits[variant].append(fit(workload, variant))
    plain, recorded = fits["plain"], fits["hindsight"]
    ratios = [r.seconds / p.seconds - 1 for p, r in zip(plain, recorded, strict=True)]
    # Where the difference lands, per pair, in seconds: the batches and the gaps between them
    # carry the machine's noise (and what background writes take from them); the fit outside the
    # batch loops barely varies between identical fits (its start, the epochs' ends, its end), so
    # the record's cost there is read from outside to a few milliseconds.
    parts = {
        part: [getattr(r, part) - getattr(p, part) for p, r in zip(plain, recorded, strict=True)]
        for part in FIT_PARTS
    }
    floors = {}
    if floor:
        again = zip(plain, fits[PLAIN_AGAIN], strict=True)
        floors = {"floor_ratios": [a.seconds / p.seconds - 1 for p, a in again]}
    return {
        "epoch_s": median([p.seconds for p in plain]) / workload.epochs,
        "state_mb": median([r.ckpt_bytes for r in recorded]) / MB,
        "plain_s": median([p.seconds for p in plain]),
        "recorded_s": median([r.seconds for r in recorded]),
        "wall": median(ratios),
        "wall_min": min(ratios),
        "wall_max": max(ratios),
        "ratios": ratios,  # per pair, for intervals and pooling over cells
        "seconds": {variant: [f.seconds for f in runs] for variant, runs in fits.items()},
        "parts": parts,  # recorded - plain, seconds per pair, by FIT_PARTS
        "policy": median([r.policy_overhead for r in recorded]),
        "checkpoints": median([r.checkpoints for r in recorded]),
        "max_gap": max(r.max_gap for r in recorded),
        "gap_bound": max(r.gap_bound for r in recorded),
        # Per fit: the largest gap and bound are of different fits when the bound varies.
        "coverage_misses": sum(gap_over_bound(r.max_gap, r.gap_bound) for r in recorded),
        "pairs": reps,
        "forks": median([r.forks for r in recorded]),
        "copies": median([r.copies for r in recorded]),
        "faults_plain": median([p.faults for p in plain]),
        "faults_recorded": median([r.faults for r in recorded]),
        **floors,
    }


def spread_text(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{median(ratios):+.1%} ({min(ratios):+.1%}..{max(ratios):+.1%})"


def interval_text(ratios: list[float]) -> str:
    interval = median_interval(ratios)
    return "-" if interval is None else f"{interval[0]:+.1%}..{interval[1]:+.1%}"


def cell_coverage_misses(cell: dict[str, Any]) -> int:
    """How many of a cell's recorded fits went longer without a checkpoint than their bound."""
    if "coverage_misses" in cell:
        return cell["coverage_misses"]
    # A matrix.json written before misses were counted per fit: its largest gap and bound.
    return int(gap_over_bound(cell["max_gap"], cell["gap_bound"]))


def print_matrix(done: dict[str, Any]) -> None:
    rows, measured = [], []
    for key, cell in done.items():
        if "skipped" in cell:
            rows.append([key, "skipped: " + cell["skipped"], *[""] * 10])
            continue
        measured.append(cell)
        misses = cell_coverage_misses(cell)
        coverage = "yes" if not misses else "NO"
        if misses and "coverage_misses" in cell:
            coverage += f", {misses} of {cell['pairs']} fits"
        rows.append([
            key,
            f"{cell['state_mb']:.1f} MB, {cell['epoch_s']:.2f} s/epoch",
            str(cell.get("pairs", "")),
            f"{cell['wall']:+.1%} ({cell['wall_min']:+.1%}..{cell['wall_max']:+.1%})",
            spread_text(cell.get("floor_ratios", [])),
            interval_text(cell.get("ratios", [])),
            f"{cell['policy']:.1%}",
            f"{abs(cell['wall'] - cell['policy']) * 100:.1f}",
            f"{cell['checkpoints']:.0f}" + (" (fork)" if cell.get("forks") else ""),
            f"{cell['max_gap']} / {cell['gap_bound']}: {coverage}",
            "yes" if cell["wall"] <= EPSILON else "NO",
            f"{cell.get('faults_plain', 0) / 1e3:.0f}k / {cell.get('faults_recorded', 0) / 1e3:.0f}"
            "k",
        ])  # fmt: skip
    print("\n== Matrix: wall-clock overhead of HindsightCallback (median of paired ratios)")
    print(table(["cell", "measured workload", "pairs", "wall clock", "floor: plain / plain",
                 "wall clock's median, 95% CI", "policy", "|diff| pp", "ckpts",
                 "max gap / bound: each fit within", "<= eps", "page faults plain / rec"],
                rows))  # fmt: skip
    if measured:
        walls = [c["wall"] for c in measured]
        diffs = [abs(c["wall"] - c["policy"]) for c in measured]
        print(f"\ncells within eps {EPSILON:.2%}: {sum(w <= EPSILON for w in walls)} of "
              f"{len(walls)}; median over cells {statistics.median(walls):+.2%} (target <= 2%); "
              f"policy within 2 pp of the wall clock in {sum(d <= 0.02 for d in diffs)} of "
              f"{len(diffs)} cells; every fit within its coverage bound in "
              f"{sum(cell_coverage_misses(c) == 0 for c in measured)} of {len(measured)} "
              "cells")  # fmt: skip
        floors = [median(c["floor_ratios"]) for c in measured if "floor_ratios" in c]
        if floors:
            print(f"the floor (a second plain fit against the first, nothing recorded): median "
                  f"over cells {statistics.median(floors):+.2%}, cells {min(floors):+.2%}.."
                  f"{max(floors):+.2%}")  # fmt: skip
        print_parts({key: cell for key, cell in done.items() if "skipped" not in cell})
        # Every pair of every cell at once: a cell's few pairs cannot resolve a point or two.
        pooled = [r for c in measured for r in c.get("ratios", [])]
        pooled_floor = [r for c in measured for r in c.get("floor_ratios", [])]
        for name, ratios in (("recorded / plain", pooled), ("floor", pooled_floor)):
            if ratios:
                print(f"pooled over cells, {name}: median {statistics.median(ratios):+.2%} of "
                      f"{len(ratios)} pairs, 95% CI {interval_text(ratios)}")  # fmt: skip


def print_parts(cells: dict[str, dict[str, Any]]) -> None:
    """Where the recorded fits' extra seconds land: each part's median paired difference, as a
    share of the plain fit, with its range over pairs."""
    rows = []
    for key, cell in cells.items():
        if "parts" not in cell:
            continue
        plain = cell["plain_s"]
        shares = {part: [d / plain for d in cell["parts"][part]] for part in FIT_PARTS}
        outside = [rest + end for rest, end in zip(shares["rest"], shares["end"], strict=True)]
        rows.append([key, *(spread_text(shares[p]) for p in FIT_PARTS),
                     spread_text(outside), f"{cell['policy']:.1%}"])  # fmt: skip
    if rows:
        print("\n== Where it lands: recorded - plain per pair, as a share of the plain fit")
        print(table(["cell", "training batches", "between batches", "validation",
                     "start and epoch ends", "end of fit", "outside the batch loops", "figure"],
                    rows))  # fmt: skip


# -- Composer (--composer) ----------------------------------------------------------------------

COMPOSER_VARIANTS = ("plain", "destination", "no checkpoints", "hindsight")


def composer_fit(variant: str, epochs: int, tmpdir: Path) -> tuple[float, float | None]:
    """One fit of the Composer digits MLP in batches of 8 (~13 engine events a batch); returns
    the wall clock of ``fit`` and the record's own figure (None without a record)."""
    from composer.core import Algorithm, Event
    from composer.loggers import LoggerDestination
    from composer_digits import digits_loaders, make_trainer

    from stalwart.algorithms import Hindsight

    class Vetoed(Hindsight):
        def should_checkpoint(self, state: Any, policy_says: bool) -> bool:
            return False

    class NoOpDestination(Algorithm):
        """Adds a logger destination that does nothing: what Composer charges for one."""

        def match(self, event: Event, state: Any) -> bool:
            return event is Event.INIT

        def apply(self, event: Event, state: Any, logger: Any) -> None:
            destination = LoggerDestination()
            logger.destinations = (*logger.destinations, destination)
            state.callbacks.append(destination)

    algorithms = {
        "plain": list,
        "destination": lambda: [NoOpDestination()],
        "no checkpoints": lambda: [Vetoed(tmpdir)],
        "hindsight": lambda: [Hindsight(tmpdir)],
    }[variant]()
    fit_trainer = make_trainer(
        epochs=epochs, algorithms=algorithms, train_dataloader=digits_loaders(8)[0]
    )
    start = time.perf_counter()
    fit_trainer.fit()
    seconds = time.perf_counter() - start
    fit_trainer.close()
    record = next((a for a in algorithms if isinstance(a, Hindsight)), None)
    return seconds, None if record is None else record.recorder.policy.overhead


def composer_part(reps: int, epochs: int) -> None:
    """Composer's Hindsight: plain vs a no-op logger destination vs the record with every
    checkpoint vetoed vs the record, interleaved; the wall clock against the record's figure."""
    print(f"\n== Composer: digits MLP, batches of 8, {epochs} epochs, {reps} interleaved reps")
    results: dict[str, list[tuple[float, float | None]]] = {v: [] for v in COMPOSER_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-composer-") as tmp:
        composer_fit("plain", 1, Path(tmp) / "warm-up")
        for rep in range(reps):
            for variant in rotated(COMPOSER_VARIANTS, rep):
                results[variant].append(composer_fit(variant, epochs, Path(tmp) / f"{rep}"))
    plain = [seconds for seconds, _ in results["plain"]]
    rows = []
    for variant, runs in results.items():
        paired = [seconds / p - 1 for (seconds, _), p in zip(runs, plain, strict=True)]
        figures = [figure for _, figure in runs if figure is not None]
        rows.append([
            variant, f"{median([s for s, _ in runs]):.2f} s",
            f"{median(paired):+.1%} ({min(paired):+.1%}..{max(paired):+.1%})",
            f"{median(figures):.1%}" if figures else "",
        ])  # fmt: skip
    print(table(["variant", "fit (median)", "vs plain (median, range)", "record's figure"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and epochs")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument(
        "--matrix", action="store_true",
        help="plain vs recorded over state size x epoch length x torch threads",
    )  # fmt: skip
    parser.add_argument("--sizes", default=",".join(map(str, MATRIX_STATE_MB)), help="MB")
    parser.add_argument(
        "--epoch-seconds", default=",".join(map(str, MATRIX_EPOCH_SECONDS)), help="seconds"
    )
    parser.add_argument("--matrix-threads", default=",".join(map(str, MATRIX_THREADS)))
    parser.add_argument("--reps", type=int, default=3, help="matrix: repetitions per cell")
    parser.add_argument("--epochs", type=int, default=20, help="matrix: epochs per fit")
    parser.add_argument(
        "--cell-seconds", type=float, default=0.0,
        help="matrix: more pairs (up to 12) in cells whose --reps pairs take less than this",
    )  # fmt: skip
    parser.add_argument(
        "--accelerator", choices=("cpu", "gpu"), default="cpu",
        help="matrix: where the model trains (the record's writers run on the host either way)",
    )  # fmt: skip
    parser.add_argument(
        "--process", choices=("fresh", "same"), default="fresh",
        help="matrix: every fit in a new Python process, as a user runs one (default), or all "
        "in this one (earlier fits' heap and caches carry over)",
    )  # fmt: skip
    parser.add_argument(
        "--malloc", choices=tuple(MALLOC), default="default",
        help="matrix, fresh processes: glibc's heap as it comes, or with its trim and mmap "
        "thresholds pinned (no trimming of freed buffers) in plain and recorded fits alike",
    )  # fmt: skip
    parser.add_argument(
        "--floor", action="store_true",
        help="matrix: a second plain fit in every round, interleaved; its ratio to the first "
        "is what this machine's wall clock reads as overhead when nothing is recorded",
    )  # fmt: skip
    parser.add_argument("--one-fit", help=argparse.SUPPRESS)  # fit_in_fresh_process's child
    parser.add_argument(
        "--composer", action="store_true",
        help="Composer's Hindsight algorithm instead: its wall clock against its own figure",
    )  # fmt: skip
    parser.add_argument(
        "--write-path", action="store_true",
        help="only what a background checkpoint write of --sizes MB takes from a Python loop "
        "and its CPU: torch writing into a file object, by name with the CRC-32 read back, now",
    )  # fmt: skip
    parser.add_argument(
        "--copy-path", action="store_true",
        help="only what the writer thread's copy of a --sizes MB checkpoint costs the calling "
        "thread: a fresh copy against a copy into the buffers of the last one written",
    )  # fmt: skip
    parser.add_argument(
        "--start-end", action="store_true",
        help="only the record's cost at a fit's start and end, hook by hook (10 x --reps fits "
        "of a ~1 MB state in 20 short epochs)",
    )  # fmt: skip
    parser.add_argument(
        "--out", default="record_overhead_matrix", help="matrix: folder of matrix.json "
        "(cells already in it are not measured again: an interrupted run resumes)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Checkpoint directory.*exists and is not empty.*")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.one_fit:
        one_fit(args.one_fit)
        return
    if args.composer:
        print(f"record_overhead --composer: stalwart {stalwart.__version__} "
              f"({source_revision()}), load average {os.getloadavg()[0]:.2f}")  # fmt: skip
        composer_part(reps=args.reps * 2, epochs=6)
        return
    if args.write_path:
        write_path([float(v) for v in args.sizes.split(",")], reps=args.reps * 10)
        return
    if args.start_end:
        start_end(reps=args.reps * 10)
        return
    if args.copy_path:
        copy_path([float(v) for v in args.sizes.split(",")], reps=args.reps * 10)
        return
    if args.matrix:
        ACCELERATOR["name"] = args.accelerator
        if args.malloc != "default" and args.process != "fresh":
            parser.error("--malloc applies to fresh processes (--process fresh)")
        CHILD_ENV.update(MALLOC[args.malloc])
        print(
            f"record_overhead --matrix: stalwart {stalwart.__version__} ({source_revision()}), "
            f"{os.cpu_count()} CPUs, accelerator {args.accelerator}, {args.process} process "
            f"per fit, malloc {args.malloc}, "
            f"load average {os.getloadavg()[0]:.2f}", flush=True
        )  # fmt: skip
        matrix(args)
        return
    quick = args.quick
    small = Workload(
        "a (small checkpoint)",
        width=128,
        depth=1,
        batch_size=64,
        train_size=1437,
        repeats=8,
        epochs=6 if quick else 12,
    )
    large = Workload(
        "b (large state, short epochs)",
        width=4096,
        depth=3,
        batch_size=64,
        train_size=128,
        repeats=1,
        epochs=10 if quick else 25,
    )
    reps_a, reps_b, reps_2 = (2, 2, 3) if quick else (5, 3, 5)
    started = time.perf_counter()
    print(
        f"record_overhead: stalwart {stalwart.__version__} ({source_revision()}), "
        f"torch {torch.__version__}, lightning {L.__version__}\n  {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, {'quick' if quick else 'full'} run, "
        f"tempdir {tempfile.gettempdir()}, load average {os.getloadavg()[0]:.2f}"
    )
    result_a = part1(small, reps_a)
    result_b = part1(large, reps_b)
    result_2 = part2(large, reps_2)

    print("\n== Acceptance targets")
    checks = [
        (
            f"recording overhead <= {EPSILON:.2%}, workload a",
            result_a["hindsight"] <= EPSILON,
            f"{result_a['hindsight']:+.1%}",
        ),
        (
            f"recording overhead <= {EPSILON:.2%}, workload b",
            result_b["hindsight"] <= EPSILON,
            f"{result_b['hindsight']:+.1%}",
        ),
        (
            "ModelCheckpoint overhead > 25%, workload b",
            result_b["modelckpt"] > 0.25,
            f"{result_b['modelckpt']:+.1%} ({result_b['ckpt_mb']:.0f} MB checkpoint)",
        ),
        (
            "fork submit <= 1/4 of inline torch.save",
            result_2["fork/torch.save"] <= 0.25,
            f"ratio {result_2['fork/torch.save']:.3f}",
        ),
        (
            "fork submit < AsyncCheckpointIO.save_checkpoint",
            result_2["fork/async"] < 1.0,
            f"ratio {result_2['fork/async']:.3f}",
        ),
        ("fork-written checkpoint loads back equal", bool(result_2["verified"]), ""),
    ]
    print(
        table(
            ["target", "holds", "measured"], [[n, "yes" if ok else "NO", m] for n, ok, m in checks]
        )
    )
    print(
        f"\ntotal benchmark time {time.perf_counter() - started:.0f} s, load average now"
        f" {os.getloadavg()[0]:.2f} (> ~1 means other processes competed for the cores)"
    )


if __name__ == "__main__":
    main()
