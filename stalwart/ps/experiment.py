"""``stalwart ps-experiment``: the paper's experiment on scikit-learn digits.

Every mode, without failure and with one and two SIGKILLs of the parameter server, each a real
multi-process run. Writes ``accuracy.png`` (test accuracy of the committed weights vs wall-clock
time, kills marked), ``table.md`` and ``results.json`` to ``--out``, and prints the table:
gradients produced / applied / lost, gradients produced while the PS was down, worker idle time,
worker CPU utilisation, server CPU seconds, peak memory, time to reach the target accuracy; then
the time-to-target ratios of checkpointing to chain replication and to the stateless PS, side by
side, after one and after two kills (medians over ``--repeats``).

The comparison is fair by construction: every mode runs the same workers on the same data
(same seed), is killed at the same wall-clock times with the same downtime, and trains for the
same wall-clock time; modes run interleaved, so a change in the machine's load hits all of them.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import time

from stalwart import durable
from stalwart.errors import (
    ConfigurationError,
    RunDirectoryError,
    StalwartError,
    StoreUnavailableError,
)
from stalwart.ps.config import MODES, KillEvent, PSConfig
from stalwart.ps.result import PSRunResult
from stalwart.ps.runner import run_training
from stalwart.ps.store import connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's options."""
    parser.add_argument("--out", default="ps-experiment", help="output directory (new or empty)")
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--kills", default="0,1,2", help="kill counts to run, e.g. 0,1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=None, help="training time per run")
    parser.add_argument("--downtime", type=float, default=None, help="seconds the PS stays down")
    parser.add_argument("--target", type=float, default=0.9, help="accuracy for time-to-target")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting (seeds 0..)")
    parser.add_argument("--store", default=None, help="host:port of a running store (optional)")


#: Kill times as fractions of the run, per number of kills: the same for every mode. Early, so
#: that every mode is still below the target when the last kill fires (the fastest, stateless,
#: reaches 90% about 4-5 s into a failure-free full-length run): "time to the target after two
#: kills" then includes both failures for every mode (checked: see ``reached_before_last_kill``).
KILL_AT = {1: [0.1], 2: [0.1, 0.25]}
#: Each worker's gradient cap: runs are limited by --seconds, not by this.
STEP_CAP = 100_000
#: With this rate the slowest mode (checkpoint-sync) needs about half of a full-length run to
#: reach 90% without failure, so the kills land during training, as in the paper, and not after
#: convergence (at the PS default 0.1 every mode converges within ~3 s, before any kill). The
#: quick runs are shorter and use a smaller CNN, hence a larger rate.
EXPERIMENT_LR = 0.02
QUICK_LR = 0.05
#: (slower, faster) pairs whose time-to-target ratio the paper's claim is about.
PAIRS = (
    ("checkpoint-sync", "chain-sync"),
    ("checkpoint-async", "chain-async"),
    ("checkpoint-async", "stateless"),
    ("checkpoint-sync", "stateless"),
)


def kill_schedule(mode: str, kills: int, downtime: float, seconds: float) -> list[KillEvent]:
    """``kills`` SIGKILLs of the PS (the chain head) at the same wall-clock times in every mode."""
    targets = ("head",) if mode.startswith("chain") else ("ps",)
    fractions = KILL_AT.get(kills) or [(i + 1) / (kills + 2) for i in range(kills)]
    return [
        KillEvent(downtime=downtime, targets=targets, at_seconds=f * seconds) for f in fractions
    ]


def _make_out(out: str) -> None:
    """Create the output folder (new or empty) before the first run, so a path that cannot be
    one (under a file, not writable) fails with its reason instead of failing every run."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunDirectoryError(f"--out {out} is a file; choose a new directory.")
    if os.path.isdir(out) and os.listdir(out):
        raise RunDirectoryError(f"{out} is not empty; choose a new --out directory.")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise RunDirectoryError(
            f"--out {out} cannot be created ({error.strerror or error}); choose a directory "
            "whose parent folders exist or can be created and are writable."
        ) from error


def run(args: argparse.Namespace) -> None:
    """Run the experiment and write the plot and the table."""
    modes, kill_counts = _check_options(args)
    # Every mode trains for the same wall-clock time (the paper's x axis); a gradient budget
    # would favour the stateless workers, who never wait and spend theirs during the outage.
    seconds = args.seconds if args.seconds is not None else (8.0 if args.quick else 20.0)
    downtime = args.downtime if args.downtime is not None else (1.0 if args.quick else 2.0)
    hidden = 128 if args.quick else 512
    lr = args.lr if args.lr is not None else (QUICK_LR if args.quick else EXPERIMENT_LR)
    out = os.path.abspath(args.out)
    configs = []
    # Interleaved (repeat, kills, mode): a change in the host's load hits every mode alike.
    for seed in range(args.repeats):
        for kills in kill_counts:
            for mode in modes:
                config = PSConfig(
                    mode=mode, workers=args.workers, steps=STEP_CAP, duration=seconds,
                    hidden=hidden, lr=lr, seed=seed, store_address=args.store,
                    kills=kill_schedule(mode, kills, downtime, seconds),
                    run_dir=os.path.join(out, f"{mode}-{kills}kill-seed{seed}"),
                )  # fmt: skip
                config.validate()  # every bad option fails before the first run starts
                configs.append(config)
    if args.store is not None:
        _check_store(args.store)
    _make_out(out)
    started = time.time()
    results, failures = _run_all(configs)
    print(f"experiment: {len(results)} runs in {time.time() - started:.0f}s")
    table = format_table(results, args.target)
    ratios = time_to_target_ratios(results, args.target)
    summary = format_ratios(ratios, args.target)
    print(table)
    print(summary)
    durable.write_text(os.path.join(out, "table.md"), table + "\n\n" + summary + "\n")
    runs = [_to_json(r, args.target) for r in results]
    durable.write_text(
        os.path.join(out, "results.json"), json.dumps({"runs": runs, "ratios": ratios}, indent=1)
    )
    if results:
        print(f"wrote {plot(results, os.path.join(out, 'accuracy.png'), args.target)}")
    if failures:
        raise StalwartError(f"{len(failures)} run(s) failed:\n" + "\n".join(failures))


def _run_all(configs: list[PSConfig]) -> tuple[list[PSRunResult], list[str]]:
    """Run ``configs`` in order; the results to compare and a line per run that failed."""
    results: list[PSRunResult] = []
    failures: list[str] = []
    for n, config in enumerate(configs, 1):
        print(f"[{n}/{len(configs)}] {config.mode}, {len(config.kills)} kill(s), seed "
              f"{config.seed}", flush=True)  # fmt: skip
        try:
            result = run_training(config, progress=lambda line: print(line, flush=True))
        except StoreUnavailableError as exc:
            # The store is shared by every run: the ones left would wait for it in turn.
            failures.append(f"{config.mode} with {len(config.kills)} kill(s): {exc}")
            print(f"  FAILED: {exc}; the remaining runs are skipped", flush=True)
            break
        except StalwartError as exc:  # one failed run must not throw away the others
            failures.append(f"{config.mode} with {len(config.kills)} kill(s): {exc}")
            print(f"  FAILED: {exc}", flush=True)
            continue
        if result.unfired_kills:  # it would count among the runs with fewer kills
            failures.append(
                f"{config.mode} with {len(config.kills)} kill(s): "
                f"{len(result.unfired_kills)} never fired"
            )
            print("  FAILED: not every kill fired; left out of the comparison", flush=True)
            continue
        results.append(result)
    return results, failures


def _check_options(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The modes and the kill counts; a ConfigurationError naming the option for anything the
    runs cannot honour (PSConfig.validate checks the rest, before the first run too)."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        kill_counts = [int(k) for k in args.kills.split(",")]
    except ValueError:
        raise ConfigurationError(f"--kills {args.kills!r}: write counts like 0,1,2") from None
    # A negative count would run without a kill under its own label; a repeated mode or count
    # would run into the first one's directory halfway through the experiment.
    if any(k < 0 for k in kill_counts):
        raise ConfigurationError(f"--kills {args.kills!r}: kill counts are 0 or more.")
    for option, values in (("--modes", modes), ("--kills", kill_counts)):
        if not values or len(set(values)) != len(values):
            raise ConfigurationError(
                f"{option} {getattr(args, option[2:])!r}: list each value once, e.g. "
                f"{','.join(map(str, dict.fromkeys(values))) or 'stateless'}."
            )
    if args.repeats < 1:
        raise ConfigurationError(f"--repeats {args.repeats}: run each setting at least once.")
    if not 0 < args.target <= 1:
        raise ConfigurationError(
            f"--target {args.target}: a test accuracy between 0 and 1 (e.g. 0.9)."
        )
    # An explicit 0 is the user's value, not "unset": rejected, never silently replaced. NaN
    # fails no comparison, so finiteness is checked first (--seconds nan never stopped a run).
    for option in ("seconds", "downtime", "lr"):
        value = getattr(args, option)
        if value is not None and not math.isfinite(value):
            raise ConfigurationError(f"--{option} {value}: must be a finite number.")
    if args.seconds is not None and args.seconds <= 0:
        raise ConfigurationError(f"--seconds {args.seconds}: each run trains for > 0 seconds.")
    if args.lr is not None and args.lr <= 0:
        raise ConfigurationError(f"--lr {args.lr}: the SGD learning rate must be positive.")
    return modes, kill_counts


#: Seconds the store given by ``--store`` may take to answer before the experiment starts.
STORE_CHECK_PATIENCE = 3.0


def _check_store(address: str) -> None:
    """Fail before the first run if the store at ``address`` does not answer: every run would
    otherwise retry it for its whole patience, one after another."""
    try:
        store = connect(address, STORE_CHECK_PATIENCE, "ps-experiment")
    except StoreUnavailableError:
        raise ConfigurationError(
            f"--store {address}: no store answered there within {STORE_CHECK_PATIENCE:g} s. "
            "Start it first (a c10d TCPStore server, or give a redis://host:port/0 URL), or "
            "leave --store out: each run then starts its own."
        ) from None
    store.close()


def time_to_target_ratios(results: list[PSRunResult], target: float) -> dict:
    """Median time to ``target`` per (mode, kills), the ratios of :data:`PAIRS` and each mode's
    delay caused by the kills (time with k kills minus time without), medians over seeds.

    A ratio is computed per seed (the runs of one seed share data, initial weights and kill
    times) and then the median is taken; a run that never reached the target counts as its
    whole duration, which makes the ratio a bound (see :func:`_ratio`).
    """
    reach: dict[tuple[str, int], dict[int, tuple[float, bool]]] = {}
    for r in results:
        t = r.time_to_accuracy(target)
        reached = t is not None
        reach.setdefault((r.config.mode, len(r.kills)), {})[r.config.seed] = (
            t if reached else r.wall,
            reached,
        )

    times = {
        f"{mode} {kills}": {"median_s": _median([t for t, _ in runs.values()]),
                            "all_reached": all(ok for _, ok in runs.values())}
        for (mode, kills), runs in sorted(reach.items())
    }  # fmt: skip
    pairs: dict[str, dict] = {}
    left_out: dict[str, str] = {}
    for kills in sorted({k for _, k in reach}):
        for slow, fast in PAIRS:
            name = f"{slow} / {fast}, {kills} kill(s)"
            slow_runs, fast_runs = reach.get((slow, kills), {}), reach.get((fast, kills), {})
            reason = _left_out_reason(slow_runs, fast_runs)
            if reason:
                left_out[name] = reason
            elif set(slow_runs) & set(fast_runs):
                pairs[name] = _ratio(slow_runs, fast_runs)
    delays, delay_bounds = _kill_delays(reach, left_out)
    early = [
        f"{r.config.mode}, {len(r.kills)} kill(s), seed {r.config.seed}"
        for r in results
        if r.kills and (t := r.time_to_accuracy(target)) is not None and t < r.kills[-1]["killed"]
    ]
    return {
        "target": target, "time_to_target": times, "ratios": pairs, "delay_s": delays,
        "delay_bounds": delay_bounds, "reached_before_last_kill": early, "left_out": left_out,
    }  # fmt: skip


def _ratio(slow: dict[int, tuple[float, bool]], fast: dict[int, tuple[float, bool]]) -> dict:
    """The per-seed ratios of two modes' times to the target and their median, over the seeds
    where one of them reached it (:func:`_left_out_reason` says when there is none).

    A run that never reached the target counts as its whole duration: a seed where only the
    slower mode missed gives a lower bound of its ratio (``>=``), one where only the faster mode
    missed an upper bound (``<=``).
    """
    seeds = [s for s in sorted(set(slow) & set(fast)) if slow[s][1] or fast[s][1]]
    marks = {">=" if not slow[s][1] else "<=" for s in seeds if not (slow[s][1] and fast[s][1])}
    bound = marks.pop() if marks else ""
    return {
        "median": _median([slow[s][0] / fast[s][0] for s in seeds]),
        "runs": [round(slow[s][0] / fast[s][0], 3) for s in seeds],
        "bound": bound,
        "lower_bound": bound == ">=",
    }


def _left_out_reason(
    first: dict[int, tuple[float, bool]], second: dict[int, tuple[float, bool]]
) -> str:
    """Why two modes' times to the target cannot be compared ("" if they can, or if no seed
    ran both): in every seed both missed it (a ratio or difference of two durations says
    nothing), or the seeds' bounds point both ways (no median of them is a bound either way)."""
    common = sorted(set(first) & set(second))
    seeds = [s for s in common if first[s][1] or second[s][1]]
    if common and not seeds:
        return "neither run reached the target"
    marks = {first[s][1] for s in seeds if first[s][1] != second[s][1]}
    if len(marks) > 1:
        return "the seeds where one run missed the target give bounds pointing both ways"
    return ""


def _score(accuracy: float | None) -> str:
    return "-" if accuracy is None else f"{accuracy:.3f}"


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _kill_delays(
    reach: dict[tuple[str, int], dict[int, tuple[float, bool]]], left_out: dict[str, str]
) -> tuple[dict[str, float], dict[str, str]]:
    """Each mode's delay to the target caused by its kills (time with k kills minus without,
    median over seeds), and the marks of those that are bounds; ``left_out`` gets the reason
    for each delay that cannot be given (:func:`_left_out_reason`).

    A run that never reached the target counts as its whole duration: a seed whose killed run
    missed it gives a lower bound (``>=``), one whose failure-free run missed it an upper bound
    (``<=``).
    """
    delays: dict[str, float] = {}
    bounds: dict[str, str] = {}
    for (mode, kills), runs in sorted(reach.items()):
        base = reach.get((mode, 0), {})
        seeds = [s for s in sorted(set(runs) & set(base)) if runs[s][1] or base[s][1]]
        name = f"{mode} {kills}"
        reason = _left_out_reason(runs, base) if kills else ""
        if reason:
            left_out[f"delay of {name} kill(s)"] = reason
        if not kills or reason or not seeds:
            continue
        marks = {">=" if not runs[s][1] else "<=" for s in seeds if not (runs[s][1] and base[s][1])}
        delays[name] = _median([runs[s][0] - base[s][0] for s in seeds])
        if marks:
            bounds[name] = marks.pop()
    return delays, bounds


def format_target(target: float) -> str:
    """The target as asked, e.g. ``99.9%`` (``:.0%`` printed 0.999 as 100%)."""
    return f"{target * 100:g}%"


def format_ratios(ratios: dict, target: float) -> str:
    """The side-by-side ratios as text (> 1: checkpointing needs more time to the target)."""
    lines = [
        f"time to {format_target(target)} test accuracy, ratio slower / faster (median over seeds):"
    ]
    for name, entry in ratios["ratios"].items():
        bound = entry.get("bound", ">=" if entry["lower_bound"] else "")
        runs = ", ".join(f"{v:.2f}" for v in entry["runs"])
        lines.append(f"  {name:<45} {bound}{entry['median']:.2f}  (per seed: {runs})")
    if not ratios["ratios"]:
        lines.append("  none could be computed (see the ones left out below)")
    if ratios["delay_s"]:
        lines += _format_delays(ratios["delay_s"], ratios.get("delay_bounds", {}))
    left_out = ratios.get("left_out", {})
    if left_out:
        lines.append("left out (no number can be given):")
        lines += [f"  {name:<45} {reason}" for name, reason in left_out.items()]
    if ratios["reached_before_last_kill"]:
        lines.append(
            "NOTE: these runs reached the target before their last kill (schedule the kills "
            "earlier for a comparison after all kills): "
            + "; ".join(ratios["reached_before_last_kill"])
        )
    return "\n".join(lines)


def _format_delays(delays: dict[str, float], bounds: dict[str, str]) -> list[str]:
    legend = ""
    if bounds:
        legend = "; >= or <=: a run that never reached it counts its whole duration"
    if "<=" in bounds.values():
        legend += (
            " (<= means the failure-free run missed it: a negative bound says the killed run "
            "reached it before the failure-free run ended)"
        )
    lines = [f"delay to the target caused by the kills (s, vs the same mode without{legend}):"]
    lines += [
        f"  {name:<22} {bounds[name] + ' ' if name in bounds else ''}{delay:+.1f}"
        for name, delay in delays.items()
    ]
    return lines


def _to_json(result: PSRunResult, target: float) -> dict:
    return {
        **result.summary(), "kills_at": result.kills, "recoveries": result.recoveries,
        "timeline": result.timeline, f"time_to_{target}": result.time_to_accuracy(target),
    }  # fmt: skip


def format_table(results: list[PSRunResult], target: float) -> str:
    """A markdown table, one row per run."""
    header = (
        "| mode | kills | seed | produced | applied | lost | produced while down "
        "| updates | largest backlog (gradients / workers) "
        "| worker idle s | worker CPU util | server CPU s | peak RSS PS / worker MB "
        f"| t to {format_target(target)} s | final acc |"
    )
    lines = [header, "|" + "---|" * 15]
    for r in results:
        reach = r.time_to_accuracy(target)
        server_rss = max(r.peak_rss_mb.get("ps", 0), r.peak_rss_mb.get("replica", 0))
        largest = max(r.backlogs, key=lambda b: b["gradients"], default=None)
        backlog = "-" if largest is None else f"{largest['gradients']} / {largest['workers']}"
        lines.append(
            f"| {r.config.mode} | {len(r.kills)} | {r.config.seed} | {r.produced} | {r.applied} "
            f"| {r.lost} "
            f"| {r.produced_during_downtime} | {r.updates} | {backlog} | {sum(r.worker_idle):.1f} "
            f"| {r.worker_cpu_utilisation:.0%} | {r.server_cpu:.1f} "
            f"| {server_rss:.0f} / {r.peak_rss_mb.get('worker', 0):.0f} "
            f"| {'-' if reach is None else f'{reach:.1f}'} | {_score(r.final_accuracy)} |"
        )
    return "\n".join(lines)


def plot(results: list[PSRunResult], path: str, target: float) -> str:
    """Accuracy vs wall-clock time, one panel per kill count (the first seed), kills marked;
    the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({len(r.kills) for r in results})
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.5), squeeze=False)
    colours = dict(
        zip(MODES, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"], strict=True)
    )
    for ax, count in zip(axes[0], counts, strict=True):
        first_seed = min(r.config.seed for r in results)
        for r in (r for r in results if len(r.kills) == count and r.config.seed == first_seed):
            colour = colours.get(r.config.mode, "black")
            # Steps: the committed weights keep their accuracy until the next commit (flat while
            # the PS is down), rather than a line drawn across the outage.
            ax.plot([p["t"] for p in r.timeline], [p["accuracy"] for p in r.timeline],
                    label=r.config.mode, color=colour, linewidth=1.2,
                    drawstyle="steps-post")  # fmt: skip
            for kill in r.kills:
                ax.axvspan(kill["killed"], kill["recovered"], color=colour, alpha=0.08)
                ax.axvline(kill["killed"], color=colour, linestyle=":", linewidth=0.9)
        ax.axhline(target, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(
            f"{count} PS kill(s) (dotted: SIGKILL, shaded: down)" if count else "no failure"
        )
        ax.set_xlabel("wall-clock time since workers started (s)")
        ax.set_ylabel("test accuracy of the committed weights")
        ax.set_ylim(0, 1)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    durable.write_atomic(path, image.getvalue())
    return path
