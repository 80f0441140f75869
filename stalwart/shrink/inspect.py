"""``stalwart shrink inspect|restore``: look into a chain; turn a shrunken file into a plain one."""

from __future__ import annotations

import argparse
from pathlib import Path

from stalwart import durable
from stalwart.errors import ConfigurationError
from stalwart.shrink.api import load_with_extra
from stalwart.shrink.codec import entries_bytes
from stalwart.shrink.container import is_shrunk_file, read_container
from stalwart.shrink.partition import QuantConfig


def describe(path: Path) -> dict:
    """One row of ``inspect``: what the file is, what it depends on, how small it is."""
    container = read_container(path)
    header = container.header
    weight_stored = container.size - (
        0 if header["extra"] is None else _extra_bytes(header["extra"])
    )
    config = header["config"]
    optimizer = header.get("optimizer") or {}  # absent before format 4
    return {
        "file": path.name,
        "kind": header["kind"],
        "base": None if header["base"] is None else Path(header["base"]["file"]).name,
        "position": header["chain_position"],
        "config": "lossless" if config is None else QuantConfig.from_dict(config).describe(),
        "degradation": header["degradation"],
        "degradation_on": header.get("degradation_on"),  # absent in older files
        "bound": header.get("bound"),  # absent in older files
        "search": header.get("search"),  # absent in older files
        "weight_ratio": header["weight_bytes"] / max(weight_stored, 1),
        "total_ratio": (header["weight_bytes"] + header["extra_bytes"]) / container.size,
        "bytes": container.size,
        "weight_bytes": header["weight_bytes"],
        "weight_stored": weight_stored,
        "optimizer_ratio": (
            optimizer["bytes"] / max(optimizer["stored"], 1) if optimizer.get("bytes") else None
        ),
        "optimizer_setting": optimizer.get("setting"),
        "optimizer_degradation": optimizer.get("degradation"),
        "optimizer_reused": bool(optimizer.get("reused")),
        "raw_bytes": header["weight_bytes"] + header["extra_bytes"],
    }


def _extra_bytes(packed: dict) -> int:
    return packed["skeleton"][1] + entries_bytes(dict(enumerate(packed["tensors"])))


def _chain_files(target: Path) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """The folder's files, each once (oldest first), and its links as (link, the file listed).

    Composer keeps ``latest-rank0.pt`` as a symlink to the newest file: counted as a file of its
    own, it showed that checkpoint twice and counted its bytes twice in the totals.
    """
    entries = sorted(p for p in target.iterdir() if not p.name.startswith(".") and p.is_file())
    listed = {p.resolve(): p for p in entries if not p.is_symlink()}
    links = []
    for link in (p for p in entries if p.is_symlink()):
        # A link to a file outside the folder is that file's only entry here: it is listed.
        file = listed.setdefault(link.resolve(), link)
        if file != link:
            links.append((link, file))
    return sorted(listed.values(), key=lambda p: p.stat().st_mtime), links


def inspect(args: argparse.Namespace) -> None:
    target = Path(args.path)
    links: list[tuple[Path, Path]] = []
    if target.is_dir():
        files, links = _chain_files(target)
    elif target.exists():
        files = [target]
    else:
        raise ConfigurationError(f"{target} does not exist; pass a shrunken file or its directory")
    rows = [describe(p) for p in files if is_shrunk_file(p)]
    links = [(link, file) for link, file in links if file.name in {r["file"] for r in rows}]
    if not rows:
        raise ConfigurationError(f"no shrunken checkpoints in {target}")
    print(
        f"{'file':28} {'kind':8} {'base':28} {'weights':>8} {'optim.':>7} {'total':>7} "
        f"{'degr.':>7} {'bound':>6} {'cont.':>7}  weights config | optimizer moments"
    )
    for row in rows:
        degradation = "-" if row["degradation"] is None else f"{row['degradation']:+.3f}"
        if row["degradation_on"] == "screen":
            degradation += "*"
        optimizer = "-" if row["optimizer_ratio"] is None else f"{row['optimizer_ratio']:.1f}x"
        bound = "-" if row["bound"] is None else f"{row['bound']:.3f}"
        check = row["optimizer_degradation"]
        check = "reused" if row["optimizer_reused"] else "-" if check is None else f"{check:+.3f}"
        print(
            f"{row['file']:28} {row['kind']:8} {row['base'] or '-':28} "
            f"{row['weight_ratio']:7.1f}x {optimizer:>7} {row['total_ratio']:6.1f}x "
            f"{degradation:>7} {bound:>6} {check:>7}  "
            f"{row['config']}{' (full search)' if row['search'] == 'full' else ''} | "
            f"{row['optimizer_setting'] or 'lossless'}"
        )
    for link, file in links:
        print(f"{link.name} -> {file.name} (a link, counted once)")
    raw = sum(row["weight_bytes"] for row in rows)
    stored = sum(row["weight_stored"] for row in rows)
    whole = sum(row["raw_bytes"] for row in rows) / max(sum(row["bytes"] for row in rows), 1)
    print(
        f"{len(rows)} checkpoint(s); weights {raw / max(stored, 1):.1f}x smaller overall, whole "
        f"files {whole:.1f}x (tensor bytes / file bytes)"
    )
    print(
        "degr.: held-out loss of the restored weights vs exact; bound: what it was held to (tau "
        "times the learning rate's share of its initial value, or tau where nothing met "
        "that); cont.: loss after a short "
        "continuation from the stored optimizer state vs the exact state (reused: the last "
        "check's setting, within tau / 4 there)"
    )
    if any(row["degradation_on"] == "screen" for row in rows):
        print("* degradation measured on the screen (accepted within its margin), not confirmed")


def _is_composer(extra: object) -> bool:
    """Whether ``extra`` is what Composer Shrink stores: Composer's checkpoint less its weights
    (``state`` without ``model``, see ``stalwart.algorithms.Shrink._write``)."""
    return (
        isinstance(extra, dict)
        and isinstance(extra.get("state"), dict)
        and "timestamp" in extra["state"]
        and "model" not in extra["state"]
        and "pytorch-lightning_version" not in extra
    )


def restore(args: argparse.Namespace) -> None:
    source, out = Path(args.path), Path(args.out)
    # Checked before decoding: a chain can take a while, and torch's own error is a traceback.
    if not out.parent.is_dir():
        raise ConfigurationError(
            f"the folder {out.parent} for {out.name} does not exist; create it first "
            f"(mkdir -p {out.parent}) or write OUT into an existing folder"
        )
    if out.is_dir():
        raise ConfigurationError(
            f"{out} is a folder; pass OUT as a file path such as {out}/plain.pt"
        )
    if out.exists() and not args.force:
        raise ConfigurationError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and is_shrunk_file(out):
        # Even with --force: a later delta may be written against it.
        raise ConfigurationError(
            f"{out} is a shrunken checkpoint (later deltas may need it); write OUT elsewhere"
        )
    if source.is_file() and not is_shrunk_file(source):
        raise ConfigurationError(
            f"{source} is not a shrunken checkpoint (torch.load reads it as it is); "
            "`stalwart shrink restore` converts files written by ShrinkCheckpoint or Shrink"
        )
    weights, extra, _ = load_with_extra(source)
    checkpoint = dict(extra or {})
    if _is_composer(extra):
        # Composer loads the weights from state["model"] and ignores any other key: weights
        # anywhere else would resume the right step with the untrained model, silently.
        checkpoint["state"] = {**extra["state"], "model": weights}
        kind = "Composer"
    else:
        checkpoint["state_dict"] = weights
        kind = "Lightning"
    written = durable.save_torch(checkpoint, out, seal=False)  # plain: torch.load reads it
    print(f"wrote {out} ({written.nbytes} bytes): a plain {kind} checkpoint of {source}")


def add_arguments(commands: argparse._SubParsersAction) -> None:
    shrink = commands.add_parser("shrink", help="inspect or restore shrunken checkpoints")
    actions = shrink.add_subparsers(dest="shrink_command", required=True)
    look = actions.add_parser("inspect", help="the chain: kind, base, ratio, config per file")
    look.add_argument("path", help="a shrunken checkpoint or the directory holding a chain")
    look.set_defaults(func=inspect)
    back = actions.add_parser("restore", help="write a plain Lightning or Composer checkpoint")
    back.add_argument("path")
    back.add_argument("out")
    back.add_argument("--force", action="store_true", help="overwrite OUT")
    back.set_defaults(func=restore)
