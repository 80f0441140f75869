"""Every code block in the user guide's usage sections runs (so the guide cannot rot)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USAGE = re.compile(r"^## In (Lightning|Composer)\b", re.MULTILINE)


def usage_blocks(page: Path) -> list[str]:
    """Python code blocks inside the page's "## In Lightning" / "## In Composer" sections."""
    text = page.read_text()
    blocks = []
    for match in USAGE.finditer(text):
        end = text.find("\n## ", match.end())
        section = text[match.end() : end if end != -1 else len(text)]
        blocks += re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return blocks


PAGES = [page for page in sorted((ROOT / "docs").glob("*.md")) if usage_blocks(page)]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_usage_code_blocks_run(tmp_path, page):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    for index, block in enumerate(usage_blocks(page)):
        script = tmp_path / f"block{index}.py"
        script.write_text("import torch\ntorch.set_num_threads(1)\n" + block)
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, f"{page.name} block {index}:\n{block}\n{done.stderr[-3000:]}"


def test_every_page_is_linked_from_the_index():
    docs = ROOT / "docs"
    index = (docs / "README.md").read_text()
    for page in docs.rglob("*.md"):  # the measurement logs under docs/measurements/ too
        if page != docs / "README.md":
            assert f"({page.relative_to(docs).as_posix()})" in index, page.name


def test_every_measurement_log_is_linked_from_its_page():
    for log in (ROOT / "docs" / "measurements").glob("*.md"):
        page = (ROOT / "docs" / log.name).read_text()
        assert f"(measurements/{log.name})" in page, log.name
