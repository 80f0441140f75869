"""`stalwart ps-experiment`: bad options fail before any process starts; a one-mode run writes
the plot, the table and the JSON results."""

from __future__ import annotations

import json

from stalwart.cli import main


def test_bad_experiment_options_are_clear_errors(tmp_path, capsys):
    assert main(["ps-experiment", "--out", str(tmp_path / "a"), "--workers", "0"]) == 2
    assert "at least one worker" in capsys.readouterr().err
    assert main(["ps-experiment", "--out", str(tmp_path / "b"), "--kills", "one"]) == 2
    assert "--kills 'one'" in capsys.readouterr().err
    assert main(["ps-experiment", "--out", str(tmp_path / "c"), "--modes", "paxos"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_experiment_writes_plot_and_table(tmp_path, capsys):
    out = tmp_path / "exp"
    code = main([
        "ps-experiment", "--quick", "--out", str(out), "--modes", "stateless",
        "--kills", "1", "--seconds", "3", "--downtime", "1",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| stateless | 1 |"))
    produced, applied, lost = (int(v) for v in row.split("|")[4:7])
    assert produced == applied > 200 and lost == 0
    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    rows = json.loads((out / "results.json").read_text())["runs"]
    assert rows[0]["mode"] == "stateless" and rows[0]["lost"] == 0
    assert rows[0]["timeline"] and (out / "table.md").exists()
