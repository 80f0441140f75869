"""The ``stalwart`` console script."""

from __future__ import annotations

import argparse
import sys

from stalwart.errors import StalwartError


def _runs(args: argparse.Namespace) -> None:
    from stalwart.hindsight import open as open_store

    store = open_store(args.dirpath)
    for run in store.runs():
        decisions = run.decisions()
        checkpoints = run.checkpoints()
        compute = decisions.compute_time.sum()
        spent = decisions.measured_cost.fillna(0).sum()
        overhead = f"{spent / compute:.2%}" if compute > 0 else "-"
        print(
            f"{run.name}  {run.status:<9}  epochs {len(decisions):>4}  "
            f"checkpoints {len(checkpoints):>4}  overhead {overhead:>7}  "
            f"metrics: {', '.join(run.metric_names())}"
        )


def _metrics(args: argparse.Namespace) -> None:
    from stalwart.hindsight import open as open_store

    run = open_store(args.dirpath).run(args.run)
    print(run.metrics(args.name).to_string(index=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart", description="Cheap-to-debug, cheap-to-recover training."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="list the runs recorded in a run directory")
    runs.add_argument("dirpath", nargs="?", default="runs")
    runs.set_defaults(func=_runs)
    metrics = commands.add_parser("metrics", help="print every value a run logged under a name")
    metrics.add_argument("dirpath")
    metrics.add_argument("name")
    metrics.add_argument("--run", default=None, help="run name (default: the latest)")
    metrics.set_defaults(func=_metrics)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except StalwartError as exc:
        print(f"stalwart: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
