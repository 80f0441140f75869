"""The preemption simulator's defaults beside the Bamboo thesis' published numbers.

Prints, from one run:

1. Table 3.3 (Bamboo, BERT-large, D=4, P=12) next to the simulator's rows: preemptions, interval
   between preemption events, fatal failures, nodes, throughput, cost and value; and the
   on-demand value (thesis: 1.10).
2. How flat value stays: worst/best value over p (Table 3.3: 0.76; the real runs of Table 3.2:
   0.70 from the 10% to the 33% rate) and the fall of value vs the fall of throughput from
   p=0.01 to p=0.5 (Table 3.3: 24% vs 54%).
3. Useful share of wall time at p=0.10, checkpoint/restart vs Bamboo (thesis, real runs: 23% vs
   84%).
4. Share of time spent reconfiguring over p = 0.10, 0.16, 0.33 (thesis, real runs: 7%), the
   figure the default ``reconfig_seconds`` is set from.
5. Throughput of 2 and 1 pipelines relative to 3 (8 stages, the global batch kept) against the
   inverse ratios of the BERT step times the thesis authors' simulator takes as input.

``--out FILE.png`` also writes the value/useful/fatal figure with Table 3.3's points on it.

    python benchmarks/pipeline_simulator_vs_thesis.py [--runs 200] [--out figure.png]
"""

from __future__ import annotations

import argparse
import time

from bamboo_thesis import (
    ON_DEMAND_VALUE,
    REAL_RUN_VALUES,
    RECONFIG_RATES,
    RECONFIG_SHARE,
    STEP_SECONDS,
    TABLE_3_3,
    USEFUL_SHARE,
)

from stalwart.pipeline.cli import save_png, value_figure
from stalwart.pipeline.simulator import Row, SimulationSettings, _throughput, simulate, sweep

PROBABILITIES = tuple(sorted(TABLE_3_3))


def table_3_3(bamboo: list[Row], demand: Row) -> None:
    print("1. Table 3.3, Bamboo: simulator / thesis")
    print(
        f"{'p':>5} {'preemptions':>15} {'interval h':>12} {'fatal':>12} {'nodes':>13} "
        f"{'throughput':>13} {'cost $/h':>13} {'value':>11}"
    )
    for row in bamboo:
        preempt, interval, fatal, nodes, thruput, cost, value = TABLE_3_3[row.probability]
        print(
            f"{row.probability:>5.2f} {row.preemptions:>7.1f}/{preempt:<7.1f} "
            f"{row.interval:>5.2f}/{interval:<6.2f} {row.fatal_failures:>5.2f}/{fatal:<6.2f} "
            f"{row.nodes:>6.1f}/{nodes:<6.1f} {row.throughput:>6.1f}/{thruput:<6.1f} "
            f"{row.cost:>6.1f}/{cost:<6.1f} {row.value:>5.2f}/{value:<5.2f}"
        )
    print(f"on-demand value {demand.value:.2f} / {ON_DEMAND_VALUE:.2f}")


def flatness(bamboo: list[Row]) -> None:
    values = [r.value for r in bamboo]
    thesis = [TABLE_3_3[p][6] for p in PROBABILITIES]
    real = min(REAL_RUN_VALUES) / max(REAL_RUN_VALUES)
    print(
        "2. worst/best value: simulator "
        f"{min(values) / max(values):.2f}, Table 3.3 {min(thesis) / max(thesis):.2f}, "
        f"real runs {real:.2f}"
    )
    first, last = bamboo[0], bamboo[-1]
    ours = (1 - last.value / first.value, 1 - last.throughput / first.throughput)
    lo, hi = TABLE_3_3[PROBABILITIES[0]], TABLE_3_3[PROBABILITIES[-1]]
    theirs = (1 - hi[6] / lo[6], 1 - hi[4] / lo[4])
    print(
        f"   value / throughput fall from p={first.probability} to p={last.probability}: "
        f"simulator {ours[0]:.0%} / {ours[1]:.0%}, Table 3.3 {theirs[0]:.0%} / {theirs[1]:.0%}"
    )


def useful_share(bamboo: Row, checkpoint: Row) -> None:
    print(
        f"3. useful share at p={bamboo.probability}: checkpoint/restart "
        f"{checkpoint.useful_share:.0%} / {USEFUL_SHARE['checkpoint']:.0%}, Bamboo "
        f"{bamboo.useful_share:.0%} / {USEFUL_SHARE['bamboo']:.0%} (simulator / thesis)"
    )


def reconfiguration(settings: SimulationSettings) -> None:
    shares = [
        simulate(p, settings, strategies=("bamboo",))["bamboo"].reconfig_share
        for p in RECONFIG_RATES
    ]
    listed = ", ".join(f"{s:.1%}" for s in shares)
    print(
        f"4. reconfiguring at p = {RECONFIG_RATES} ({settings.reconfig_seconds:.0f} s each): "
        f"{listed}, mean {sum(shares) / len(shares):.1%} / thesis {RECONFIG_SHARE:.0%}"
    )


def step_times(settings: SimulationSettings) -> None:
    full = max(STEP_SECONDS)
    s = SimulationSettings(num_pipelines=full, num_microbatches=settings.num_microbatches)
    base = _throughput(s, 8, full, 1.0)
    print(
        f"5. throughput of d pipelines of 8 stages relative to {full}, "
        f"M={s.num_microbatches}: simulator / thesis step times"
    )
    for d in sorted(STEP_SECONDS, reverse=True):
        ratio = _throughput(s, 8, d, 1.0) / base
        print(f"   d={d}: {ratio:.3f} / {STEP_SECONDS[full] / STEP_SECONDS[d]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="Bamboo runs per probability")
    parser.add_argument(
        "--checkpoint-runs",
        type=int,
        default=60,
        help="checkpoint/restart runs per probability (at high p they run to --max-hours)",
    )
    parser.add_argument("--max-hours", type=float, default=120.0)
    parser.add_argument("--out", help="also write the figure, with Table 3.3's points, here")
    args = parser.parse_args()
    started = time.monotonic()
    settings = SimulationSettings(runs=args.runs)
    bamboo = sweep(PROBABILITIES, settings, strategies=("bamboo",))
    slow = SimulationSettings(runs=args.checkpoint_runs, max_hours=args.max_hours)
    checkpoint = sweep(PROBABILITIES, slow, strategies=("checkpoint",))
    ours = [r for r in bamboo if r.strategy == "bamboo"]
    demand = next(r for r in bamboo if r.strategy == "on-demand")
    theirs = {r.probability: r for r in checkpoint if r.strategy == "checkpoint"}
    print(
        f"SIMULATOR vs the Bamboo thesis; {args.runs} Bamboo and {args.checkpoint_runs} "
        "checkpoint/restart runs per probability"
    )
    table_3_3(ours, demand)
    flatness(ours)
    at = {r.probability: r for r in ours}
    useful_share(at[0.10], theirs[0.10])
    reconfiguration(settings)
    step_times(settings)
    if args.out:
        fig = value_figure(bamboo + checkpoint, args.runs)
        value, _, fatal = fig.axes
        for axis, column in ((value, 6), (fatal, 2)):  # Table 3.3's value and fatal columns
            axis.plot(
                PROBABILITIES,
                [TABLE_3_3[p][column] for p in PROBABILITIES],
                "x:",
                color="gray",
                label="Bamboo, thesis Table 3.3",
            )
        print(f"wrote {save_png(fig, args.out)}")
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
