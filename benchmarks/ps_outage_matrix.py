"""Stateless PS vs checkpoint-async vs chain-async over outage regimes, interleaved.

The grid: outage length (``--downtimes``) x gradient rate (the default CNN and a cheaper one,
``--workloads``) x where the run ends (``soon``: 0.4 s after the last restart; ``late``:
3.5 s after it). Every run is a real multi-process run with two SIGKILLs of the PS at
the same wall-clock times in every mode; the modes of a cell run one after another for each
seed, so a change in the machine's load hits all of them alike.

Per cell it prints the median (and range over seeds) of the final test accuracy of the committed
weights and of the time to ``--target`` (a run that never got there counts as its whole length
and is marked ``>``), and whether the stateless PS is at least as good as checkpoint-async on
both. It writes ``results.json`` (after every run, so an interrupted matrix keeps what it did),
``table.md`` and ``accuracy.png`` (accuracy vs wall-clock time per cell, first seed) to ``--out``.

Run: ``.venv/bin/python benchmarks/ps_outage_matrix.py --out ps_matrix`` (~50 min on 2 cores;
``--quick``: one seed, two downtimes, for a smoke test; ``--resume`` completes an interrupted
matrix from its ``results.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.experiment import STEP_CAP
from stalwart.ps.result import PSRunResult
from stalwart.ps.runner import run_training

#: (dense width, batch size) of each gradient rate.
WORKLOADS = {"default": (512, 32), "cheap": (128, 8)}
MODES = ("stateless", "checkpoint-async", "chain-async")
#: The first kill (s), the training between the two outages (s), and how long a run goes on
#: after the last outage ends in a ``soon`` and in a ``late`` run.
FIRST, GAP, TAIL = 1.0, 1.5, {"soon": 0.4, "late": 3.5}


def schedule(downtime: float, end: str) -> tuple[float, list[float]]:
    """The run's length and its two kill times. The kills sit at the same times in both kinds
    of run, early, so that every mode is still learning when they fire and the time to the
    target measures the outages rather than the failure-free speed (which is the same in all
    three modes here: the PS is the bottleneck)."""
    second = FIRST + downtime + GAP
    return second + downtime + TAIL[end], [FIRST, second]


def run_one(out: str, mode: str, workload: str, downtime: float, end: str, seed: int,
            args: argparse.Namespace) -> PSRunResult:  # fmt: skip
    hidden, batch = WORKLOADS[workload]
    duration, times = schedule(downtime, end)
    targets = ("head",) if mode.startswith("chain") else ("ps",)
    run_dir = os.path.join(out, f"{workload}-{end}-{downtime}s-{mode}-seed{seed}")
    if args.resume and os.path.isdir(run_dir):
        # Not in results.json, so the matrix was interrupted during this run: start it again.
        print(f"removing the interrupted run {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    config = PSConfig(
        mode=mode, workers=args.workers, steps=STEP_CAP, duration=duration, hidden=hidden,
        batch_size=batch, lr=args.lr, seed=seed,
        kills=[KillEvent(at_seconds=t, downtime=downtime, targets=targets) for t in times],
        run_dir=run_dir,
    )  # fmt: skip
    return run_training(config)


def _cell_key(row: dict) -> tuple:
    return (row["workload"], row["end"], row["downtime"])


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def _reach(times: list[float], walls: list[float]) -> str:
    if not times:
        return "-"
    t = statistics.median(times)
    return f"> {max(walls):.1f}" if t == float("inf") else f"{t:.1f}"


def summarise(rows: list[dict], target: float) -> tuple[str, bool]:
    """The markdown table, one line per cell, and whether every cell passes."""
    cells = sorted({_cell_key(r) for r in rows}, key=lambda c: (c[0] != "default", c[1], c[2]))
    header = (
        "| workload | end | outage s | grad/s (stateless, no outage) | "
        + " | ".join(f"{m} final acc" for m in MODES)
        + " | "
        + " | ".join(f"{m} t to {target:.0%} s" for m in MODES)
        + " | stateless updates / largest backlog | stateless >= ckpt-async |"
    )
    lines = [header, "|" + "---|" * (6 + 2 * len(MODES))]
    every = True
    for cell in cells:
        runs = {m: [r for r in rows if _cell_key(r) == cell and r["mode"] == m] for m in MODES}
        acc = {m: [r["final_accuracy"] for r in runs[m]] for m in MODES}
        reach = {m: [r["time_to_target"] or float("inf") for r in runs[m]] for m in MODES}
        walls = {m: [r["wall_s"] for r in runs[m]] for m in MODES}

        ok = bool(acc["stateless"] and acc["checkpoint-async"]) and (
            statistics.median(acc["stateless"]) >= statistics.median(acc["checkpoint-async"])
            and statistics.median(reach["stateless"])
            <= statistics.median(reach["checkpoint-async"])
        )
        every &= ok
        stateless = runs["stateless"]
        rate = statistics.median(r["rate"] for r in stateless) if stateless else 0
        updates = statistics.median(r["updates"] for r in stateless) if stateless else 0
        largest = max((max(r["backlogs"], default=0) for r in stateless), default=0)
        lines.append(
            f"| {cell[0]} | {cell[1]} | {cell[2]} | {rate:.0f} | "
            + " | ".join(_spread(acc[m]) for m in MODES)
            + " | "
            + " | ".join(_reach(reach[m], walls[m]) for m in MODES)
            + f" | {updates:.0f} / {largest} | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines), every


def plot(rows: list[dict], path: str, target: float) -> None:
    """Accuracy vs wall-clock time, one panel per cell (first seed), outages shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({_cell_key(r) for r in rows}, key=lambda c: (c[0] != "default", c[1], c[2]))
    columns = sorted({(c[0], c[1]) for c in cells}, key=lambda c: (c[0] != "default", c[1]))
    downtimes = sorted({c[2] for c in cells})
    fig, axes = plt.subplots(len(downtimes), len(columns), squeeze=False,
                             figsize=(4.2 * len(columns), 2.8 * len(downtimes)))  # fmt: skip
    colours = {"stateless": "tab:purple", "checkpoint-async": "tab:orange",
               "chain-async": "tab:red"}  # fmt: skip
    seed = min(r["seed"] for r in rows)
    for i, downtime in enumerate(downtimes):
        for j, column in enumerate(columns):
            ax = axes[i][j]
            for r in rows:
                if (r["workload"], r["end"], r["downtime"], r["seed"]) != (*column, downtime, seed):
                    continue
                colour = colours[r["mode"]]
                ax.plot([p["t"] for p in r["timeline"]], [p["accuracy"] for p in r["timeline"]],
                        color=colour, label=r["mode"], linewidth=1.1,
                        drawstyle="steps-post")  # fmt: skip
                for kill in r["kills_at"]:
                    ax.axvspan(kill["killed"], kill["recovered"], color=colour, alpha=0.08)
            ax.axhline(target, color="grey", linewidth=0.6, linestyle="--")
            ax.set_ylim(0, 1)
            ax.set_title(f"{column[0]} CNN, ends {column[1]}, {downtime} s outages", fontsize=9)
            if i == len(downtimes) - 1:
                ax.set_xlabel("wall-clock s")
            if j == 0:
                ax.set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="ps-outage-matrix")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--downtimes", default="0.2,0.5,1,2")
    parser.add_argument("--workloads", default="default,cheap")
    parser.add_argument("--ends", default="soon,late")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--quick", action="store_true", help="one seed, outages 0.2 and 2 s")
    parser.add_argument("--resume", action="store_true", help="keep --out's finished runs")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.downtimes = 1, "0.2,2"
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    grid = [
        (workload, end, float(downtime))
        for workload in args.workloads.split(",")
        for end in args.ends.split(",")
        for downtime in args.downtimes.split(",")
    ]
    rows: list[dict] = []
    results = os.path.join(out, "results.json")
    if args.resume and os.path.exists(results):
        with open(results) as handle:
            rows = json.load(handle)["runs"]
    done = {(r["workload"], r["end"], r["downtime"], r["mode"], r["seed"]) for r in rows}
    started, total = time.time(), args.seeds * len(grid) * len(MODES)
    for seed in range(args.seeds):
        for workload, end, downtime in grid:
            for mode in MODES:
                if (workload, end, downtime, mode, seed) in done:
                    continue
                result = run_one(out, mode, workload, downtime, end, seed, args)
                summary = result.summary()
                # Failure-free gradient rate: the gradients produced before the first kill.
                first = result.kills[0]
                rate = first["produced_at_kill"] / first["killed"]
                rows.append({
                    **summary, "workload": workload, "end": end, "downtime": downtime,
                    "seed": seed, "rate": rate,
                    "time_to_target": result.time_to_accuracy(args.target),
                    "backlogs": [b["gradients"] for b in result.backlogs],
                    "kills_at": result.kills, "timeline": result.timeline,
                })  # fmt: skip
                print(f"[{len(rows)}/{total} {time.time() - started:.0f}s] {workload} {end} "
                      f"{downtime}s {mode} seed {seed}: final {summary['final_accuracy']:.3f}, "
                      f"t to target {rows[-1]['time_to_target']}, updates {summary['updates']}, "
                      f"backlogs {rows[-1]['backlogs']}", flush=True)  # fmt: skip
                with open(os.path.join(out, "results.json.tmp"), "w") as handle:
                    json.dump({"args": vars(args), "runs": rows}, handle)
                os.replace(os.path.join(out, "results.json.tmp"), results)
    table, every = summarise(rows, args.target)
    verdict = "PASS" if every else "FAIL"
    text = (f"{table}\n\nstateless at least as good as checkpoint-async (median final accuracy "
            f"and time to {args.target:.0%}) in every cell: {verdict}")  # fmt: skip
    print(text)
    with open(os.path.join(out, "table.md"), "w") as handle:
        handle.write(text + "\n")
    plot(rows, os.path.join(out, "accuracy.png"), args.target)
    print(f"wrote {out}/table.md, results.json, accuracy.png ({time.time() - started:.0f}s)")


if __name__ == "__main__":
    main()
