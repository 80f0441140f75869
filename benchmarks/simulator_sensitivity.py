"""How flat Bamboo's value stays in the preemption SIMULATOR (a scale claim), per input.

For the default settings and one change at a time, prints Bamboo's value at each hourly
preemption probability, worst/best value (the "roughly flat" ratio; thesis Table 3.3: 0.76,
its real runs 0.70), fatal failures and the share of time paused, all from one run.

    python benchmarks/simulator_sensitivity.py [--runs 200]
"""

from __future__ import annotations

import argparse
import time

from bamboo_thesis import TABLE_3_3

from stalwart.pipeline.simulator import SimulationSettings, sweep

PROBABILITIES = (0.01, 0.05, 0.10, 0.25, 0.50)
VARIANTS: list[tuple[str, dict]] = [
    ("default (calibrated reconfig 42 s)", {}),
    ("reconfig 20 s", {"reconfig_seconds": 20.0}),
    ("reconfig 75 s", {"reconfig_seconds": 75.0}),
    ("reconfig 120 s", {"reconfig_seconds": 120.0}),
    ("recovery 5 s", {"recovery_seconds": 5.0}),
    ("recovery 60 s", {"recovery_seconds": 60.0}),
    ("bulks of 2 nodes", {"bulk_mean": 2.0}),
    ("40 micro-batches", {"num_microbatches": 40}),
    ("failover slowdown 1.25", {"failover_slowdown": 1.25}),
    ("allocation prob. <= 0.9", {"allocation_max": 0.9}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    started = time.monotonic()
    header = " ".join(f"{p:>5.2f}" for p in PROBABILITIES)
    print(f"SIMULATOR, Bamboo value at p = {header}   worst/best  fatal@0.5  paused@0.5")
    thesis = " ".join(f"{TABLE_3_3[p][6]:>5.2f}" for p in PROBABILITIES)
    print(f"{'thesis Table 3.3':<36}{thesis}      0.76     5.98")
    for name, change in VARIANTS:
        settings = SimulationSettings(runs=args.runs, **change)
        rows = sweep(PROBABILITIES, settings, strategies=("bamboo",))
        bamboo = [r for r in rows if r.strategy == "bamboo"]
        values = [r.value for r in bamboo]
        line = " ".join(f"{v:>5.2f}" for v in values)
        print(
            f"{name:<36}{line}      {min(values) / max(values):.2f}     "
            f"{bamboo[-1].fatal_failures:.2f}      {bamboo[-1].paused_share:.0%}",
            flush=True,
        )
    print(f"{args.runs} runs per point, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
