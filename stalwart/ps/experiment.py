"""``stalwart ps-experiment``: the paper's experiment on scikit-learn digits.

Every mode, with one and with two SIGKILLs of the parameter server, each a real multi-process
run. Writes ``accuracy.png`` (test accuracy of the committed weights vs wall-clock time, kills
marked), ``table.md`` and ``results.json`` to ``--out``, and prints the table: gradients
produced / applied / lost, gradients produced while the PS was down, worker idle time, worker CPU
utilisation, server CPU seconds, peak memory, time to reach the target accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from stalwart.errors import ConfigurationError, RunDirectoryError, StalwartError
from stalwart.ps.config import MODES, KillEvent, PSConfig
from stalwart.ps.runner import RunResult, run_training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's options."""
    parser.add_argument("--out", default="ps-experiment", help="output directory (new or empty)")
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--kills", default="1,2", help="kill counts to run, e.g. 1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=None, help="training time per run")
    parser.add_argument("--downtime", type=float, default=None, help="seconds the PS stays down")
    parser.add_argument("--target", type=float, default=0.8, help="accuracy for time-to-target")
    parser.add_argument("--store", default=None, help="host:port of a running store (optional)")


#: Gradients (all workers together) at which the PS is killed, per number of kills.
KILL_AT = {1: [200], 2: [150, 450]}
#: Each worker's gradient cap: runs are limited by --seconds, not by this.
STEP_CAP = 100_000


def kill_schedule(mode: str, kills: int, downtime: float) -> list[KillEvent]:
    """``kills`` SIGKILLs of the PS (the chain head), at fixed gradient counts for every mode."""
    targets = ("head",) if mode.startswith("chain") else ("ps",)
    at = KILL_AT.get(kills) or [150 * (i + 1) for i in range(kills)]
    return [KillEvent(n, downtime, targets) for n in at]


def run(args: argparse.Namespace) -> None:
    """Run the experiment and write the plot and the table."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        kill_counts = [int(k) for k in args.kills.split(",")]
    except ValueError:
        raise ConfigurationError(f"--kills {args.kills!r}: write counts like 1,2") from None
    # Every mode trains for the same wall-clock time (the paper's x axis); a gradient budget
    # would favour the stateless workers, who never wait and spend theirs during the outage.
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    downtime = args.downtime if args.downtime is not None else (1.0 if args.quick else 3.0)
    hidden = 128 if args.quick else 512
    out = os.path.abspath(args.out)
    if os.path.isdir(out) and os.listdir(out):
        raise RunDirectoryError(f"{out} is not empty; choose a new --out directory.")
    configs = []
    for kills in kill_counts:
        for mode in modes:
            config = PSConfig(
                mode=mode, workers=args.workers, steps=STEP_CAP, duration=seconds, hidden=hidden,
                kills=kill_schedule(mode, kills, downtime),
                run_dir=os.path.join(out, f"{mode}-{kills}kill"), store_address=args.store,
            )  # fmt: skip
            config.validate()  # every bad option fails before the first run starts
            configs.append(config)
    results: list[RunResult] = []
    failures: list[str] = []
    started = time.time()
    for n, config in enumerate(configs, 1):
        print(f"[{n}/{len(configs)}] {config.mode}, {len(config.kills)} kill(s)", flush=True)
        try:
            results.append(run_training(config, progress=lambda line: print(line, flush=True)))
        except StalwartError as exc:  # one failed run must not throw away the others
            failures.append(f"{config.mode} with {len(config.kills)} kill(s): {exc}")
            print(f"  FAILED: {exc}", flush=True)
    print(f"experiment: {len(results)} runs in {time.time() - started:.0f}s")
    table = format_table(results, args.target)
    print(table)
    with open(os.path.join(out, "table.md"), "w") as handle:
        handle.write(table + "\n")
    with open(os.path.join(out, "results.json"), "w") as handle:
        json.dump([_to_json(r, args.target) for r in results], handle, indent=1)
    if results:
        print(f"wrote {plot(results, os.path.join(out, 'accuracy.png'), args.target)}")
    if failures:
        raise StalwartError(f"{len(failures)} run(s) failed:\n" + "\n".join(failures))


def _to_json(result: RunResult, target: float) -> dict:
    return {
        **result.summary(), "kills_at": result.kills, "recoveries": result.recoveries,
        "timeline": result.timeline, f"time_to_{target}": result.time_to_accuracy(target),
    }  # fmt: skip


def format_table(results: list[RunResult], target: float) -> str:
    """A markdown table, one row per run."""
    header = (
        "| mode | kills | produced | applied | lost | produced while down | worker idle s "
        f"| worker CPU util | server CPU s | peak RSS PS / worker MB | t to {target:.0%} s "
        "| final acc |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in results:
        reach = r.time_to_accuracy(target)
        server_rss = max(r.peak_rss_mb.get("ps", 0), r.peak_rss_mb.get("replica", 0))
        lines.append(
            f"| {r.config.mode} | {len(r.kills)} | {r.produced} | {r.applied} | {r.lost} "
            f"| {r.produced_during_downtime} | {sum(r.worker_idle):.1f} "
            f"| {r.worker_cpu_utilisation:.0%} | {r.server_cpu:.1f} "
            f"| {server_rss:.0f} / {r.peak_rss_mb.get('worker', 0):.0f} "
            f"| {'-' if reach is None else f'{reach:.1f}'} | {r.final_accuracy:.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[RunResult], path: str, target: float) -> str:
    """Accuracy vs wall-clock time, one panel per kill count, kills marked; the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({len(r.kills) for r in results})
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.5), squeeze=False)
    colours = dict(
        zip(MODES, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"], strict=True)
    )
    for ax, count in zip(axes[0], counts, strict=True):
        for r in (r for r in results if len(r.kills) == count):
            colour = colours.get(r.config.mode, "black")
            ax.plot([p["t"] for p in r.timeline], [p["accuracy"] for p in r.timeline],
                    label=r.config.mode, color=colour, linewidth=1.4)  # fmt: skip
            for kill in r.kills:
                ax.axvspan(kill["killed"], kill["recovered"], color=colour, alpha=0.08)
                ax.axvline(kill["killed"], color=colour, linestyle=":", linewidth=0.9)
        ax.axhline(target, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(f"{count} PS kill(s) (dotted: SIGKILL, shaded: down)")
        ax.set_xlabel("wall-clock time since workers started (s)")
        ax.set_ylabel("test accuracy of the committed weights")
        ax.set_ylim(0, 1)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
