"""Every fenced ``bash`` and ``python`` block of the README, then of docs/usage.md (the README's longer companion),
runs offline, in order, as a newcomer would paste it.

The blocks run in one scratch folder laid out like a clone beside the shared data (``work/`` holding links to
``configs/``, ``scripts/``, ``examples/``, ``benchmarks/``; ``shared/`` beside it, so ``--data-dir ../shared/data``
resolves), with ``HF_HUB_OFFLINE=1``: a block that reaches for the hub fails here. Later blocks may use what earlier
ones wrote (the converted SmolLM2 folder, a fine-tuned model). Where the README says that its test runs a command
smaller, an HTML comment right above the block states exactly how::

    <!-- readme-test: sub OLD => NEW -->      replace the text OLD by NEW in the block before running it
    <!-- readme-test: skip REASON -->         do not run the block (REASON says why and what checks it instead)

Each directive is a one-line comment; several may stand above one block.

Each bash block runs under ``bash -euo pipefail``; each python block as its own script.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "usage.md")  # run in this order: usage.md's blocks read what the README's wrote
DATA = ROOT.parent / "shared" / "data"
LINKED = ("configs", "scripts", "examples", "benchmarks", "docs", "constraints.txt")
DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(sub|skip)\s+(.*?)\s*-->", re.S)
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    """One fenced block: its language, first line number, text and the directives right above it."""

    language: str
    line: int
    text: str
    subs: list[tuple[str, str]] = field(default_factory=list)
    skip: str | None = None
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    def runnable_text(self) -> str:
        text = self.text
        for old, new in self.subs:
            assert old in text, f"{self.where}: readme-test sub {old!r} does not occur in its block"
            text = text.replace(old, new)
        return text


def readme_blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown`` with the ``readme-test`` directives of the comment lines just above each
    (blank lines between them allowed)."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"README line {i + 1}: unclosed fence"
        block = Block(match.group(1), i + 1, "\n".join(lines[i + 1:j]) + "\n")
        k = i - 1
        above: list[str] = []  # the one-line HTML comments right above the fence (blank lines between allowed)
        while k >= 0 and (not lines[k].strip() or (lines[k].strip().startswith("<!--")
                                                    and lines[k].strip().endswith("-->"))):
            above.insert(0, lines[k])
            k -= 1
        for kind, body in DIRECTIVE.findall("\n".join(above)):
            if kind == "skip":
                block.skip = body
            else:
                old, sep, new = body.partition("=>")
                assert sep, f"README line {i + 1}: readme-test sub needs OLD => NEW, got {body!r}"
                block.subs.append((old.strip(), new.strip()))
        blocks.append(block)
        i = j + 1
    return blocks


def test_directives_are_read():
    """The parser itself, on a made-up README: directives attach to the block right below them only."""
    text = ("intro\n\n<!-- readme-test: sub --limit 100 => --limit 1 -->\n```bash\nhf-kernel-attn eval --limit 100\n"
            "```\n\nmore text\n\n```python\nprint(1)\n```\n<!-- readme-test: skip needs a GPU -->\n```bash\nx\n```\n"
            "```text\nnot run\n```\n")
    blocks = readme_blocks(text)
    assert [(b.language, b.line) for b in blocks] == [("bash", 4), ("python", 10), ("bash", 14), ("text", 17)]
    assert blocks[0].subs == [("--limit 100", "--limit 1")] and blocks[0].skip is None
    assert blocks[0].runnable_text() == "hf-kernel-attn eval --limit 1\n"
    assert blocks[1].subs == [] and blocks[1].skip is None
    assert blocks[2].skip == "needs a GPU" and blocks[3].skip is None


def page_blocks(page: Path) -> list[Block]:
    blocks = readme_blocks(page.read_text())
    for block in blocks:
        block.page = str(page.relative_to(ROOT))
    return blocks


RUNNABLE = [b for page in PAGES for b in page_blocks(page) if b.language in ("bash", "python")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    if not DATA.is_dir():
        pytest.skip(f"the shared data is not at {DATA}")
    top = tmp_path_factory.mktemp("readme")
    (top / "shared").symlink_to(DATA.parent)
    work = top / "work"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    return work


def test_every_block_is_runnable_or_says_why_not():
    assert [b for b in RUNNABLE if b.page == "README.md"], "no bash/python blocks found in the README"
    for block in RUNNABLE:
        assert block.skip is None or len(block.skip) > 20, f"{block.where}: a skip must say why"
    skipped = [b.where for b in RUNNABLE if b.skip]
    assert len(skipped) <= 2, f"blocks not run by this test ({skipped}): at most the set-up/test ones"


def _run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    text = block.runnable_text()
    if block.language == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    else:
        script = workdir / f"{Path(block.page).stem}_line{block.line}.py"
        script.write_text(text)
        cmd = [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow(260)
@pytest.mark.real_model
def test_every_readme_block_runs_offline_in_order(workdir: Path):
    """One test, the blocks in the README's order (later blocks read what earlier ones wrote), so that pytest-xdist
    cannot split them across workers."""
    ran = []
    for block in RUNNABLE:
        if block.skip:
            continue
        start = time.perf_counter()
        proc = _run_block(block, workdir)
        seconds = time.perf_counter() - start
        print(f"{block.where} ({block.language}): exit {proc.returncode} in {seconds:.0f} s")
        assert proc.returncode == 0, (
            f"{block.where} ({block.language}) failed with exit {proc.returncode} (after {ran} "
            f"ran):\n{block.runnable_text()}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}")
        ran.append(block.where)
    assert ran
