"""``stalwart simulate`` (the preemption simulator) and ``stalwart pipeline`` (run a
redundant-pipeline job locally, optionally with injected faults).

Example:
    stalwart simulate --runs 1000 --out value.png
    stalwart simulate --trace preemptions.csv
    stalwart pipeline --stages 4 --steps 20 --fault 2:10:backward --fault 0:15:forward:SIGTERM
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stalwart.errors import ConfigurationError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from stalwart.pipeline.simulator import Row

DEFAULT_PROBABILITIES = "0.01,0.05,0.10,0.25,0.50"


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from stalwart.pipeline.simulator import SimulationSettings

    parser.add_argument(
        "--probabilities", default=DEFAULT_PROBABILITIES,
        help="hourly preemption probabilities per node, comma separated",
    )  # fmt: skip
    parser.add_argument("--trace", help="CSV of time_hours,add|remove,node[,zone] to replay")
    parser.add_argument("--out", default="pipeline-simulation.png", help="PNG of value vs p")
    for f in dataclasses.fields(SimulationSettings):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag, type=type(f.default), default=f.default, help=f"(default {f.default})"
        )


def _settings(args: argparse.Namespace):
    from stalwart.pipeline.simulator import SimulationSettings

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimulationSettings)}
    return SimulationSettings(**values).validate()


def parse_probabilities(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigurationError(f"--probabilities {text!r}: write e.g. 0.01,0.1,0.5") from None
    if not values or any(not 0 <= v < 1 for v in values):
        raise ConfigurationError(f"--probabilities {text!r}: each must be in [0, 1).")
    return values


def format_rows(rows: Sequence[Row]) -> str:
    """The simulator's table: one line per strategy and preemption probability."""
    header = (
        f"{'strategy':<11} {'p':>5} {'preempt':>8} {'interval':>8} {'fatal':>8} "
        f"{'reconfig':>8} {'nodes':>6} {'thruput':>8} {'cost$/h':>8} {'value':>6} "
        f"{'useful':>6} {'paused':>6} {'hours':>6}"
    )
    lines = [header]

    def interval(r) -> str:
        return f"{r.interval:.2f}h" if r.preemptions else "-"

    for r in rows:
        lines.append(
            f"{r.strategy:<11} {r.probability:>5.2f} {r.preemptions:>8.1f} {interval(r):>8} "
            f"{r.fatal_failures:>8.3f} {r.reconfigurations:>8.1f} {r.nodes:>6.1f} "
            f"{r.throughput:>8.2f} {r.cost:>8.2f} {r.value:>6.2f} {r.useful_share:>6.0%} "
            f"{r.paused_share:>6.0%} {r.hours:>6.1f}"
        )
    return "\n".join(lines)


def value_figure(rows: Sequence[Row], runs: int | None = None) -> Figure:
    """A matplotlib figure of value, useful share and fatal failures vs preemption probability,
    one line per strategy; its three axes are ``figure.axes``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (value, useful, fatal) = plt.subplots(1, 3, figsize=(14, 4.2))
    for strategy, style in (("bamboo", "o-"), ("checkpoint", "s--"), ("on-demand", "k:")):
        pts = sorted((r for r in rows if r.strategy == strategy), key=lambda r: r.probability)
        ps = [r.probability for r in pts]
        value.plot(ps, [r.value for r in pts], style, label=strategy)
        useful.plot(ps, [r.useful_share for r in pts], style, label=strategy)
        if strategy != "on-demand":
            fatal.plot(ps, [r.fatal_failures for r in pts], style, label=strategy)
    value.set(ylabel="value (samples/s per $/h)", title="value", ylim=(0, None))
    useful.set(ylabel="share of wall time", title="useful (kept) training time", ylim=(0, 1.05))
    fatal.set(ylabel="fatal failures per run", yscale="symlog", title="fatal failures (restarts)")
    for ax in (value, useful, fatal):
        ax.set_xlabel("hourly preemption probability per node")
        ax.grid(alpha=0.3)
    fig.suptitle("Preemption simulator" + (f", {runs} runs per point" if runs else ""))
    return fig


def save_png(fig: Figure, path: str) -> str:
    """Write ``fig`` to ``path`` atomically (a reader never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    from stalwart.durable import write_atomic

    try:
        for ax in fig.axes:
            ax.legend(fontsize="small")
        fig.tight_layout()
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


def plot_value(rows: Sequence[Row], path: str, runs: int | None = None) -> str:
    """PNG of :func:`value_figure` at ``path``."""
    return save_png(value_figure(rows, runs), path)


def run_simulate(args: argparse.Namespace) -> None:
    from stalwart.pipeline.simulator import read_trace, replay_trace, sweep

    settings = _settings(args)
    print(
        "SIMULATOR (a model, not a measurement of this runtime): Bamboo vs checkpoint/restart vs "
        f"on-demand, D={settings.num_pipelines}, P={settings.num_stages}, "
        f"on-demand depth {settings.demand_stages}"
    )
    if args.trace:
        rows = list(replay_trace(read_trace(args.trace), settings).values())
        print(format_rows(rows))
        return
    probabilities = parse_probabilities(args.probabilities)
    start = time.monotonic()

    def progress(strategy: str, p: float, done: int, runs: int) -> None:
        elapsed = time.monotonic() - start
        print(f"  p={p:.2f} {strategy:<10} {done:>5}/{runs} runs  {elapsed:6.0f}s", file=sys.stderr,
              flush=True)  # fmt: skip

    print(f"{settings.runs} runs per strategy and probability; progress on stderr", flush=True)
    rows = sweep(probabilities, settings, progress=progress)
    print(format_rows(rows))
    print(f"wrote {plot_value(rows, args.out, settings.runs)}")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pipelines", type=int, default=1, help="data-parallel pipelines D")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--redundancy", default="eager", choices=["eager", "lazy", "none"])
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--workload", default="stalwart.pipeline.workloads:DigitsMLP")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--failure-timeout", type=float, default=10.0)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument(
        "--fault", action="append", default=[],
        help="rank:step[:forward|backward|start[:SIGKILL|SIGTERM]] (repeatable)",
    )  # fmt: skip


def run_pipeline(args: argparse.Namespace) -> None:
    from stalwart.pipeline.faults import Fault
    from stalwart.pipeline.job import PipelineJob
    from stalwart.pipeline.launch import launch

    job = PipelineJob(
        num_stages=args.stages, num_microbatches=args.microbatches, steps=args.steps,
        num_pipelines=args.pipelines,
        redundancy=args.redundancy, schedule=args.schedule, workload=args.workload,
        batch_size=args.batch_size, failure_timeout=args.failure_timeout,
        checkpoint_every=args.checkpoint_every, verify_replicas=True,
    )  # fmt: skip
    faults = [Fault.parse(f) for f in args.fault]
    # The launcher reports each step's loss through logging; this command shows it on stderr.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("stalwart.pipeline.launch").setLevel(logging.INFO)
    result = launch(job, faults=faults, progress=True, timeout=600)
    for event in result.events:
        print(f"recovery: {event}")
    mismatched = [k for k, v in result.digests.items() if len(v) == 2 and len(set(v.values())) > 1]
    print(
        f"{len(result.losses)} steps, final loss {result.losses[-1]:.5f}, "
        f"{len(result.events)} recoveries, replica mismatches: {len(mismatched)}, "
        f"exit codes {result.exit_codes}, {result.seconds:.1f}s"
    )
