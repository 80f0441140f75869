"""The ``stalwart`` console script.

``stalwart fit|validate --config run.yaml`` are LightningCLI with :class:`stalwart.Trainer`;
``stalwart replay --config run.yaml --probe pkg.module:Probe`` replays that run with a new probe;
``stalwart runs [DIR]`` and ``stalwart metrics DIR NAME`` read a record.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

from stalwart.errors import ConfigurationError, StalwartError
from stalwart.shrink import inspect as shrink_cli

LIGHTNING_COMMANDS = ("fit", "validate")


def _runs(args: argparse.Namespace) -> None:
    from stalwart.hindsight import open as open_store
    from stalwart.hindsight.figure import plot_metric

    if args.plot and args.out:
        # Checked before the record is read and plotted: matplotlib would only fail at the end,
        # with a traceback from savefig.
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            raise ConfigurationError(
                f"--out: the folder {folder} for {os.path.basename(args.out)} does not exist; "
                f"create it first (mkdir -p {folder}) or write the PNG into an existing folder."
            )
    store = open_store(args.dirpath)
    if args.decisions:
        run = store.run(args.run)
        print(f"{run.name}: the checkpoint policy's decision per epoch (seconds)")
        print(run.decisions().to_string(index=False, float_format=lambda v: f"{v:.4f}"))
        return
    if args.plot:
        run = store.run(args.run)
        out = args.out or f"{run.name}-{args.plot}.png"
        print(f"wrote {plot_metric(run, args.plot, out)}")
        return
    partial = False
    for run in store.runs():
        decisions = run.decisions()
        checkpoints = run.checkpoints()
        overhead = _overhead(run, decisions)
        partial = partial or overhead.endswith(CHECKPOINTS_ONLY)
        epochs = [c.epoch for c in checkpoints]
        print(
            f"{run.name}  {run.status:<9}  epochs {len(decisions):>4}  "
            f"checkpoints {len(checkpoints):>4} {epochs}  overhead {overhead}  "
            f"metrics: {', '.join(run.metric_names())}"
        )
    if partial:
        print(
            f"{CHECKPOINTS_ONLY}: the run keeps no overhead figure of its record's own (recorded "
            "before stalwart kept it, or its process ended before the record finished), so this "
            "is its checkpoints' measured costs and the slowdown they caused, without the "
            "record's start, finish and per-epoch bookkeeping that its fit's summary counted."
        )


#: How ``stalwart runs`` marks an overhead summed from a run's checkpoint decisions alone.
CHECKPOINTS_ONLY = "(checkpoints only)"


def _overhead(run: Any, decisions: Any) -> str:
    """A run's record overhead as its fit's summary printed it (the figure the record kept when
    it finished); for a run without one, the part its checkpoint decisions hold, marked so."""
    from stalwart.hindsight.store import format_overhead

    if run.overhead is not None:
        return format_overhead(run.overhead)
    compute = decisions.compute_time.sum()
    if compute <= 0:
        return "-"
    spent = decisions.measured_cost.fillna(0).sum() + decisions.interference.sum()
    return f"{spent / compute:.2%} {CHECKPOINTS_ONLY}"


def _metrics(args: argparse.Namespace) -> None:
    from stalwart.hindsight import open as open_store

    run = open_store(args.dirpath).run(args.run)
    print(run.metrics(args.name).to_string(index=False))


def parse_epochs(text: str | None) -> list[int] | None:
    """``"3:7"`` (inclusive), ``"2,5,9"`` or ``None`` (all)."""
    if text is None:
        return None
    try:
        if ":" not in text:
            return [int(part) for part in text.split(",")]
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigurationError(
            f"--epochs {text!r}: write a range 3:7 (inclusive) or a list 2,5,9."
        ) from None
    if last < first:
        raise ConfigurationError(
            f"--epochs {text!r}: the range ends before it starts; write it first:last, "
            f"e.g. {last}:{first}."
        )
    return list(range(first, last + 1))


def load_object(spec: str) -> Any:
    """``pkg.module:Name`` -> the object (a class is instantiated without arguments)."""
    from lightning.pytorch.callbacks import Callback

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--probe {spec!r}: write it as package.module:ProbeClass.")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--probe {spec!r} cannot be imported: {exc}") from None
    except Exception as exc:  # the module itself failed: a SyntaxError, or its code raised
        said = (
            f"{exc.msg} ({exc.filename}, line {exc.lineno})"
            if isinstance(exc, SyntaxError)
            else exc
        )
        raise ConfigurationError(
            f"--probe {spec!r}: importing {module_name} failed with {type(exc).__name__}: "
            f"{said}. Fix the module and run again."
        ) from None
    if isinstance(obj, type) and issubclass(obj, Callback):
        _check_takes_no_arguments(spec, obj)
        return obj()
    return obj


def _check_takes_no_arguments(spec: str, probe_class: type) -> None:
    """Refuse a probe class whose constructor needs arguments: the command builds it with none.
    (Checked on its signature, so that a TypeError its constructor raises stays its own.)"""
    try:
        inspect.signature(probe_class).bind()
    except ValueError:
        return  # no signature to read (a builtin): let the call say
    except TypeError as exc:
        raise ConfigurationError(
            f"--probe {spec!r}: the probe class's constructor must take no arguments ({exc}); "
            "give its parameters defaults, or point --probe at a function and name its --hook."
        ) from None


@contextlib.contextmanager
def _command_line(args: list[str]) -> Iterator[None]:
    """``sys.argv`` as LightningCLI should read it: ``args`` after the program's name.

    LightningCLI reads the command line itself; given ``args=`` while ``sys.argv`` holds the
    whole ``stalwart ...`` line, it warns that both were given.
    """
    saved = sys.argv
    sys.argv = [saved[0] if saved else "stalwart", *args]
    try:
        yield
    finally:
        sys.argv = saved


def _shrunk_hparams(path: str, *, weights_only: bool) -> dict:
    """The ``hyper_parameters`` saved in a shrunken checkpoint (the file's own non-tensor part;
    its weights and delta chain are not decoded: the fit that resumes from it does that)."""
    from stalwart.shrink.codec import unpack_object
    from stalwart.shrink.container import read_container

    container = read_container(path)
    packed = container.header.get("extra")
    extra = unpack_object(container, packed, weights_only=weights_only) if packed else None
    return dict((extra or {}).get("hyper_parameters") or {})


def _lightning_cli(**kwargs: Any) -> Any:
    """LightningCLI with :class:`stalwart.Trainer`, and a ``--ckpt_path`` that may name a
    shrunken checkpoint (a ShrinkCheckpoint file).

    Before it builds the model, LightningCLI reads the checkpoint's hyperparameters into the
    config with ``torch.load``, which cannot read the shrunken format; for such a file they are
    read with stalwart's loader instead, then merged the way Lightning merges them.
    (Imported here, not at the top: ``stalwart runs`` should not wait for Lightning.)
    """
    from lightning.pytorch.cli import LightningCLI

    from stalwart.shrink.container import is_shrunk_file
    from stalwart.trainer import Trainer

    class StalwartCLI(LightningCLI):
        def _parse_ckpt_path(self) -> None:
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if not ckpt_path or not is_shrunk_file(ckpt_path):
                super()._parse_ckpt_path()
                return
            # `--weights_only false` is how a trusted file with custom objects is resumed.
            trusted = self.config[subcommand].get("weights_only") is False
            hparams = _shrunk_hparams(ckpt_path, weights_only=not trusted)
            hparams.pop("_instantiator", None)
            if not hparams:
                return
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            try:
                self.config = self.parser.parse_object(
                    {subcommand: {"model": hparams}}, self.config
                )
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")  # as Lightning
                raise

    return StalwartCLI(
        trainer_class=Trainer, save_config_callback=None,
        subclass_mode_model=True, subclass_mode_data=True, **kwargs,
    )  # fmt: skip


def _replay(args: argparse.Namespace, rest: list[str]) -> None:
    from stalwart.callbacks.replay import FunctionProbe
    from stalwart.trainer import quiet_replay

    probe = load_object(args.probe) if args.probe else None
    if probe is not None and not hasattr(probe, "state_key") and callable(probe):
        if not args.hook:
            raise ConfigurationError(
                "a function probe needs --hook, e.g. --hook on_train_epoch_end"
            )
        probe = FunctionProbe(args.hook, probe)
    with _command_line(rest):
        cli = _lightning_cli(run=False)
    # The plan or summary is printed below, once, with what the command adds to it.
    with quiet_replay():
        result = cli.trainer.replay(
            cli.model, cli.datamodule, probe=probe, run=args.run,
            epochs=parse_epochs(args.epochs), workers=args.workers, init=args.init,
            dirpath=args.dirpath, dry_run=args.dry_run,
        )  # fmt: skip
    if args.dry_run:
        print(result)
        return
    print(result.summary())
    logged = result.run.store.query(
        "SELECT DISTINCT name FROM metrics WHERE replay_id = ? ORDER BY name", (result.replay_id,)
    ).name.tolist()
    for name in logged:
        by_epoch = result.metrics(name).groupby("epoch").value.agg(["count", "mean", "last"])
        print(f"\n{name} (per epoch):\n{by_epoch.to_string()}")
    for mismatch in result.mismatches:
        print(f"MISMATCH {mismatch}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart",
        description="Cheap-to-debug, cheap-to-recover training. "
        "`stalwart fit|validate --config run.yaml` run LightningCLI with stalwart.Trainer.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="list the runs recorded in a run directory")
    runs.add_argument("dirpath", nargs="?", default="runs")
    runs.add_argument("--plot", metavar="METRIC", help="write a PNG of METRIC, record vs replays")
    runs.add_argument(
        "--decisions", action="store_true", help="print a run's policy decision per epoch"
    )
    runs.add_argument(
        "--run", default=None, help="run name for --plot/--decisions (default: the latest)"
    )
    runs.add_argument("--out", default=None, help="PNG path for --plot")
    runs.set_defaults(func=_runs)
    metrics = commands.add_parser("metrics", help="print every value a run logged under a name")
    metrics.add_argument("dirpath")
    metrics.add_argument("name")
    metrics.add_argument("--run", default=None, help="run name (default: the latest)")
    metrics.set_defaults(func=_metrics)
    replay = commands.add_parser(
        "replay", help="replay a recorded run with a probe (other arguments go to LightningCLI)"
    )
    replay.add_argument("--probe", help="package.module:ProbeClass (a Lightning Callback)")
    replay.add_argument("--hook", help="the hook, when --probe names a plain function")
    replay.add_argument("--epochs", help="3:7 (inclusive) or 2,5,9; default: all")
    replay.add_argument("--workers", type=int, default=1)
    replay.add_argument("--run", default=None, help="run name (default: the latest)")
    replay.add_argument("--init", choices=["weak", "strong"], default="weak")
    replay.add_argument(
        "--dirpath", default=None,
        help="the record's directory (default: the config's HindsightCallback dirpath)",
    )  # fmt: skip
    replay.add_argument(
        "--dry-run", action="store_true", help="print the plan and its estimated cost; run nothing"
    )
    replay.set_defaults(func=None)
    from stalwart.pipeline import cli as pipeline_cli

    simulate = commands.add_parser("simulate", help="preemption simulator: Bamboo vs checkpoint")
    pipeline_cli.add_simulate_arguments(simulate)
    simulate.set_defaults(func=pipeline_cli.run_simulate)
    pipeline = commands.add_parser("pipeline", help="run a redundant pipeline with faults")
    pipeline_cli.add_pipeline_arguments(pipeline)
    pipeline.set_defaults(func=pipeline_cli.run_pipeline)
    shrink_cli.add_arguments(commands)
    from stalwart.ps import experiment as ps_experiment

    ps = commands.add_parser(
        "ps-experiment", help="parameter-server modes under SIGKILL: accuracy plot and table"
    )
    ps_experiment.add_arguments(ps)
    ps.set_defaults(func=ps_experiment.run)
    for name in LIGHTNING_COMMANDS:
        commands.add_parser(name, help=f"LightningCLI {name} with stalwart.Trainer", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Like `python -m`, find the user's modules (class_path in YAML, --probe) in the cwd.
    sys.path.insert(0, os.getcwd())
    try:
        if argv and argv[0] in LIGHTNING_COMMANDS:
            with _command_line(argv):
                _lightning_cli()
            return 0
        args, rest = build_parser().parse_known_args(argv)
        if args.command == "replay":
            _replay(args, rest)
        elif rest:
            build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
        else:
            args.func(args)
    except StalwartError as exc:
        print(f"stalwart: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
