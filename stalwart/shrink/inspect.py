"""``stalwart shrink inspect|restore``: look into a chain; turn a shrunken file into a plain one."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from stalwart import durable
from stalwart.errors import ConfigurationError, CorruptCheckpointError
from stalwart.shrink.api import load_with_extra
from stalwart.shrink.codec import entries_bytes, real_file, superseded_path
from stalwart.shrink.container import is_shrunk_file, read_container, read_header, trailer_crc
from stalwart.shrink.partition import QuantConfig


def describe(path: Path) -> dict:
    """One row of ``inspect``: what the file is, what it depends on, how small it is."""
    real = real_file(path)
    container = read_container(real)
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
        # Where restore looks for it: relative to the file's folder, as the header records it
        # (the folder of the file a link points to, not the link's: as the decoder reads it).
        "base_path": None if header["base"] is None else real.parent / header["base"]["file"],
        "base_crc32": None if header["base"] is None else header["base"]["crc32"],
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
    """The folder's files, its subfolders' too, each once (oldest first), and its links as (link,
    the file listed). Hidden files and folders are left out: a hidden file is a base kept aside
    (``.<name>.superseded-<crc>``) or the writer's own notes, not a checkpoint to list.

    Subfolders: a ``ShrinkCheckpoint(filename="{epoch}/model")``, or a metric named ``val/acc``
    in the filename, puts each checkpoint in a folder of its own, and the top level alone showed
    "no shrunken checkpoints". Composer keeps ``latest-rank0.pt`` as a symlink to the newest
    file: counted as a file of its own, it showed that checkpoint twice and counted its bytes
    twice in the totals.
    """
    entries = []
    for folder, subfolders, names in os.walk(target):  # symlinked folders are not followed
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        entries += [Path(folder, name) for name in names if not name.startswith(".")]
    entries = sorted(p for p in entries if p.is_file())
    listed = {p.resolve(): p for p in entries if not p.is_symlink()}
    links = []
    for link in (p for p in entries if p.is_symlink()):
        # A link to a file outside the folder is that file's only entry here: it is listed.
        file = listed.setdefault(link.resolve(), link)
        if file != link:
            links.append((link, file))
    return sorted(listed.values(), key=lambda p: p.stat().st_mtime), links


def _base_on_disk(base_path: Path, crc32: int) -> tuple[Path | None, str]:
    """The file a delta's base is read from, as restore reads it (the file at the recorded
    path, or the copy set aside when that path was written again, with the checksum the delta
    was written against); else None and what is wrong with it."""
    if trailer_crc(base_path) == crc32:
        return base_path, ""
    kept = superseded_path(base_path, crc32)
    if trailer_crc(kept) == crc32:
        return kept, ""
    if base_path.exists():
        # A folder copied without its hidden files (cp dir/*.ckpt) lost the copy set aside.
        return None, (
            "which was replaced by a different checkpoint (checksum differs), and no copy of it "
            f"is kept as {kept.name}"
        )
    return None, "which is missing"


def _chain_problem(
    path: Path, folder: Path, known: dict[Path, str | None], damaged: dict[Path, str]
) -> str | None:
    """Why ``path`` cannot be restored, found from the headers alone (nothing is decoded):
    a base on its chain missing, replaced, torn or corrupt (``damaged``: the listed files that
    did not read, by resolved path), or bases in a loop; None when nothing stops it.
    ``known`` holds the answers for files already walked: a chain is shared by its files."""
    walked: list[Path] = []
    crcs = {trailer_crc(path)}
    # A link's bases lie beside the file it points to (codec.real_file, as restore reads them).
    current, problem = real_file(path), None
    while current not in known:
        walked.append(current)
        header = read_header(current)
        base = None if header is None else header.get("base")
        if base is None:
            break
        base_path = current.parent / base["file"]
        found, wrong = _base_on_disk(base_path, base["crc32"])
        unread = damaged.get((found or base_path).resolve())
        if unread is not None:  # a torn file has no trailer: it was not "replaced"
            found, wrong = None, f"which is {unread}"
        if found is None:
            problem = f"its chain needs {_shown(base_path, folder)}, {wrong}"
            break
        if base["crc32"] in crcs:  # only files made by hand can loop: a base is older
            problem = f"its chain of bases loops back at {_shown(base_path, folder)}"
            break
        crcs.add(base["crc32"])
        current = found
    else:
        problem = known[current]
    known.update(dict.fromkeys(walked, problem))
    return problem


def _shown(path: Path, folder: Path) -> str:
    """``path`` as the listing of ``folder`` shows it: relative to it (``../`` when outside)."""
    return os.path.relpath(os.path.normpath(path), os.path.normpath(folder))


def inspect(args: argparse.Namespace) -> None:
    """List a chain; a file that cannot be restored is marked ``!`` and makes the command fail
    (exit status 2, as ``restore`` of that file would) once the listing is printed."""
    target = Path(args.path)
    links: list[tuple[Path, Path]] = []
    if target.is_dir():
        folder = target
        files, links = _chain_files(target)
    elif target.exists():
        folder, files = target.parent, [target]
    else:
        raise ConfigurationError(f"{target} does not exist; pass a shrunken file or its directory")
    shrunk = [p for p in files if is_shrunk_file(p)]
    others = len(files) - len(shrunk)
    files = shrunk
    if not files:
        raise ConfigurationError(f"no shrunken checkpoints in {target}")
    rows = _rows(files, folder)
    links = [(link, file) for link, file in links if file in files]
    _print_rows(rows)
    for link, file in links:
        print(f"{_shown(link, folder)} -> {_shown(file, folder)} (a link, counted once)")
    if others:
        # Said, not silently dropped: a plain checkpoint beside the chain is not in this listing.
        print(
            f"{others} other file(s) in {folder} are no shrunken checkpoints (plain checkpoints, "
            "logs): not listed"
        )
    _print_totals(rows, folder)
    broken = [row for row in rows if row["problem"] is not None]
    if broken:
        raise CorruptCheckpointError(
            f"{len(broken)} of {len(rows)} checkpoint(s) in {folder} cannot be restored (marked "
            f"! above): {', '.join(row['file'] for row in broken)}. Restore the nearest keyframe "
            "or a file whose chain is whole instead."
        )


def _rows(files: list[Path], folder: Path) -> list[dict]:
    """The listing's rows. A file that does not read (torn by a full disk or an interrupted
    copy, corrupted) is a row of its own, marked, and a problem for the deltas on it: the
    others are still listed, since they are what the user can restore from."""
    described: dict[Path, dict] = {}
    damaged: dict[Path, str] = {}
    for path in files:
        try:
            described[path] = describe(path)
        except CorruptCheckpointError as exc:
            damaged[path.resolve()] = _damage(path, exc)
    known: dict[Path, str | None] = {}
    return [
        _row(path, described[path], folder, known, damaged)
        if path in described
        else _unreadable_row(path, folder, damaged[path.resolve()])
        for path in files
    ]


def _damage(path: Path, error: CorruptCheckpointError) -> str:
    """What is wrong with a file that does not read, in the listing's words (the error's own
    advice sends the reader to this very listing)."""
    if trailer_crc(path) is None:
        return "torn (cut short before its trailer, e.g. by a full disk or an interrupted copy)"
    return f"unreadable ({error})"


def _unreadable_row(path: Path, folder: Path, damage: str) -> dict:
    kind = "torn" if damage.startswith("torn") else "corrupt"
    return {"file": _shown(path, folder), "kind": kind, "base": None, "problem": f"it is {damage}"}


def _row(
    path: Path,
    row: dict,
    folder: Path,
    known: dict[Path, str | None],
    damaged: dict[Path, str],
) -> dict:
    """``describe(path)`` (``row``) as the listing of ``folder`` shows it: names relative to
    the folder, the base named as the file restore reads it from, and what stops a restore (if
    anything)."""
    row["file"] = _shown(path, folder)
    row["problem"] = _chain_problem(path, folder, known, damaged)
    row["base_superseded"] = False
    if row["base_path"] is not None:
        # The recorded path may hold a later checkpoint (last.ckpt written again): the base is
        # then the copy set aside, and that hidden file is what the listing must name.
        found, _ = _base_on_disk(row["base_path"], row["base_crc32"])
        row["base_superseded"] = found is not None and found != row["base_path"]
        row["base"] = _shown(found or row["base_path"], folder)
    return row


def _print_rows(rows: list[dict]) -> None:
    # As wide as the longest name (a base set aside, a file in a subfolder), at least 28.
    file_width = max(28, *(len(row["file"]) for row in rows))
    base_width = max(28, *(len(row["base"] or "") for row in rows))
    print(
        f"{'file':{file_width}} {'kind':8} {'base':{base_width}} {'weights':>8} {'optim.':>7} "
        f"{'total':>7} {'degr.':>7} {'bound':>6} {'cont.':>7}  weights config | optimizer moments"
    )
    for row in rows:
        if "bytes" not in row:  # a file that does not read: nothing more is known of it
            print(f"{row['file']:{file_width}} {row['kind'] + '!':8} -")
            continue
        degradation = "-" if row["degradation"] is None else f"{row['degradation']:+.3f}"
        if row["degradation_on"] == "screen":
            degradation += "*"
        optimizer = "-" if row["optimizer_ratio"] is None else f"{row['optimizer_ratio']:.1f}x"
        bound = "-" if row["bound"] is None else f"{row['bound']:.3f}"
        check = row["optimizer_degradation"]
        check = "reused" if row["optimizer_reused"] else "-" if check is None else f"{check:+.3f}"
        kind = row["kind"] + ("!" if row["problem"] is not None else "")
        print(
            f"{row['file']:{file_width}} {kind:8} {row['base'] or '-':{base_width}} "
            f"{row['weight_ratio']:7.1f}x {optimizer:>7} {row['total_ratio']:6.1f}x "
            f"{degradation:>7} {bound:>6} {check:>7}  "
            f"{row['config']}{' (full search)' if row['search'] == 'full' else ''} | "
            f"{row['optimizer_setting'] or 'lossless'}"
        )


def _print_totals(rows: list[dict], folder: Path) -> None:
    """The totals over the files that restore (one that cannot holds nothing usable), and the
    notes the listing needs."""
    whole = [row for row in rows if row["problem"] is None]
    raw = sum(row["weight_bytes"] for row in whole)
    stored = sum(row["weight_stored"] for row in whole)
    ratio = sum(row["raw_bytes"] for row in whole) / max(sum(row["bytes"] for row in whole), 1)
    left_out = len(rows) - len(whole)
    if not whole:
        print(f"{len(rows)} checkpoint(s), none of which can be restored")
    else:
        print(
            f"{len(rows)} checkpoint(s)"
            f"{f' ({left_out} cannot be restored, left out of the totals)' if left_out else ''}; "
            f"weights {raw / max(stored, 1):.1f}x smaller overall, whole files {ratio:.1f}x "
            "(tensor bytes / file bytes)"
        )
    print(
        "degr.: held-out loss of the restored weights vs exact; bound: what it was held to (tau "
        "times the learning rate's share of its initial value, or tau where nothing met "
        "that); cont.: loss after a short "
        "continuation from the stored optimizer state vs the exact state (reused: the last "
        "check's setting, within tau / 4 there)"
    )
    if any(row.get("degradation_on") == "screen" for row in rows):
        print("* degradation measured on the screen (accepted within its margin), not confirmed")
    if any(row.get("base_superseded") for row in rows):
        print(
            ".<name>.superseded-<crc>: a base kept aside when its path was written again; the "
            "files on it still need it: copy the folder with its hidden files (cp -a DIR/. "
            "DEST), not DIR/*.ckpt"
        )
    if any((row["base"] or "").startswith(os.pardir) for row in rows):
        print(
            f"../: a base outside {folder}: deleting or moving it breaks the files on it "
            "(ShrinkCheckpoint and Shrink start each folder's chain with a keyframe; files "
            "written by older versions or by stalwart.shrink.save may have one)"
        )
    for row in rows:
        if row["problem"] is not None:
            print(f"! {row['file']} cannot be restored: {row['problem']}")


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
    if source.is_dir():
        raise ConfigurationError(
            f"{source} is a folder; pass one shrunken checkpoint in it as PATH "
            f"(`stalwart shrink inspect {source}` lists them)"
        )
    if not source.exists():
        raise ConfigurationError(f"{source} does not exist; pass a shrunken checkpoint as PATH")
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
