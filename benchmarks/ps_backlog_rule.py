"""How should a stateless PS apply the gradients that queued up while it was down?

All k queued gradients were computed on the same (stale) weights w0. Side by side, from the same
w0 and the same k gradients, the test accuracy after one update of ``w0 - lr * scale * sum``:

* ``mean``     scale 1/k: one large-batch step at the base rate (the rule before local steps);
* ``4/k``      four times that (the gentler rule an earlier version used);
* ``1/sqrt``   scale 1/sqrt(k): the square-root large-batch scaling;
* ``sum``      scale 1: every gradient at full rate, as if each were fresh;

and the rules for k gradients that ``--workers`` workers computed on local copies, each
applying its own gradients as it goes (local SGD from w0, k / workers steps each; what the
stateless workers do while the PS is down):

* ``traj mean``  scale 1/workers: the mean of the trajectories' end points (what
  ``backlog_scale`` does now);
* ``traj sum``   scale 1: every trajectory added in full;
* ``traj xR``    scale R/workers for each ``--outer`` rate R (DiLoCo-style outer rates: the
  trajectories' mean delta applied R times over);

and, for reference, ``fresh``: k ordinary SGD steps, each on a new gradient at the current
weights (what a live PS would have done with the same work; an upper bound). w0 is reached by
plain SGD from the seed's initial weights for ``--before`` steps (early, middle and late in
training). The paper's CNN on scikit-learn digits, batch 32.

Run: ``.venv/bin/python benchmarks/ps_backlog_rule.py`` (``--quick``: fewer settings).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from stalwart.flat import flatten, unflatten_into
from stalwart.ps.update import apply_update
from stalwart.ps.workload import DigitsWorkload

RULES = {"mean": lambda k: 1 / k, "4/k": lambda k: 4 / k, "1/sqrt": lambda k: k**-0.5,
         "sum": lambda k: 1.0}  # fmt: skip


def _gradient(
    workload: DigitsWorkload, model: nn.Module, weights: torch.Tensor, batches
) -> torch.Tensor:
    unflatten_into(model.parameters(), weights)
    model.train()
    model.zero_grad(set_to_none=True)
    workload.loss(model, next(batches)).backward()
    return flatten([p.grad for p in model.parameters()])


def _accuracy(workload: DigitsWorkload, model: nn.Module, weights: torch.Tensor) -> float:
    unflatten_into(model.parameters(), weights)
    return workload.evaluate(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--before", default="40,100,200", help="SGD steps before the outage")
    parser.add_argument("--backlog", default="20,100,300", help="queued gradients k")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3, help="local trajectories")
    parser.add_argument("--outer", default="", help="outer rates R, e.g. 1.5,2: traj xR columns")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    outer = [float(v) for v in args.outer.split(",") if v]
    torch.set_num_threads(1)
    befores = [int(v) for v in args.before.split(",")]
    backlogs = [int(v) for v in args.backlog.split(",")]
    seeds = range(1 if args.quick else args.seeds)
    if args.quick:
        befores, backlogs = befores[1:2], backlogs[1:2]
    workload = DigitsWorkload(hidden=512)
    model = workload.model()
    print(f"lr {args.lr}; test accuracy after applying a backlog of k gradients computed on w0")
    outer_columns = "".join(f"traj x{r:g} | " for r in outer)
    print(f"| seed | steps before | acc(w0) | k | {' | '.join(RULES)} | traj mean | traj sum "
          f"| {outer_columns}fresh (k SGD steps) |")  # fmt: skip
    print("|---" * (7 + len(RULES) + len(outer)) + "|")
    for seed in seeds:
        for before in befores:
            torch.manual_seed(seed)
            batches = workload.batches(worker=0, seed=seed)
            weights = workload.initial_weights(seed)
            for _ in range(before):
                weights = weights - args.lr * _gradient(workload, model, weights, batches)
            base = _accuracy(workload, model, weights)
            for k in backlogs:
                total = torch.stack(
                    [_gradient(workload, model, weights, batches) for _ in range(k)]
                ).sum(0)
                after = [
                    _accuracy(workload, model, apply_update(weights, total, args.lr, rule(k)))
                    for rule in RULES.values()
                ]
                # Local trajectories: each worker's gradients, at its own moving weights.
                local_total = torch.zeros_like(weights)
                for _ in range(args.workers):
                    local = weights.clone()
                    for _ in range(k // args.workers):
                        g = _gradient(workload, model, local, batches)
                        local = apply_update(local, g, args.lr, 1.0)
                        local_total += g
                after += [
                    _accuracy(workload, model, apply_update(weights, local_total, args.lr, scale))
                    for scale in (1 / args.workers, 1.0, *(r / args.workers for r in outer))
                ]
                fresh = weights.clone()
                for _ in range(k):
                    fresh = fresh - args.lr * _gradient(workload, model, fresh, batches)
                cells = " | ".join(f"{a:.3f}" for a in after)
                print(f"| {seed} | {before} | {base:.3f} | {k} | {cells} | "
                      f"{_accuracy(workload, model, fresh):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
