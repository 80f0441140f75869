"""Every code block in the algorithms' method cards' "How to use" sections runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stalwart.algorithms

CARDS = Path(stalwart.algorithms.__file__).parent


def usage_blocks(card: Path) -> list[str]:
    section = card.read_text().split("## How to use", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


@pytest.mark.parametrize("card", ["hindsight.md", "shrink.md"])
def test_how_to_use_runs_as_written(card, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = usage_blocks(CARDS / card)
    assert blocks, f"{card} has no code in its How to use section"
    namespace: dict = {"__name__": "__card__"}
    for block in blocks:
        exec(compile(block, str(CARDS / card), "exec"), namespace)
