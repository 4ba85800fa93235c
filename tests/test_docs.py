"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh namespace.

A block that cannot run here says so on its first line, with the reason:
``# doc-test: skip (needs torchrun)``; the test reports it as skipped with
that reason. A block that goes on from the block above it on the same page
says ``# doc-test: continues the block above`` and runs after it, in one
namespace. A block of ``>>>`` lines runs as a doctest: its outputs are
compared. Blocks in other languages (bash, text, none) are not run.
"""

from __future__ import annotations

import doctest
import gc
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"#\s*doc-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*$")
CONTINUES = "# doc-test: continues the block above"
LANGUAGES = {"python", "bash", "text", ""}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its language, its code."""

    page: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip("\n").split("\n", 1)[0].strip()


def fenced_blocks(page: Path) -> list[Block]:
    """The fenced blocks of one page, in order."""
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
        for m in FENCE.finditer(text)
    ]


ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]


def source_of(block: Block) -> str:
    """The block's code, after the blocks it continues."""
    if block.first_line != CONTINUES:
        return block.code
    same_page = [b for b in PYTHON_BLOCKS if b.page == block.page and b.line < block.line]
    assert same_page, f"{block.where} continues a block above, but none is above it"
    return source_of(same_page[-1]) + block.code


def skip_reason(block: Block) -> str | None:
    """Why the block cannot run here, or None: its marker, or the hf extra missing."""
    marker = SKIP.match(block.first_line)
    if marker:
        return marker.group("reason")
    needs_transformers = re.search(r"^\s*(import|from) transformers\b", source_of(block), re.M)
    if needs_transformers and importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install -e '.[hf]'"
    return None


def run_doctest(block: Block) -> None:
    """A block of ``>>>`` lines: every output compared with the one shown."""
    test = doctest.DocTestParser().get_doctest(block.code, {}, block.where, str(block.page), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0, f"{block.where}: {runner.failures} doctest output(s) differ"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.where)
def test_python_block_runs_as_written(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(f"{block.where}: {reason}")
    monkeypatch.chdir(tmp_path)  # files the block writes land here
    if block.first_line.startswith(">>>"):
        run_doctest(block)
        return
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source_of(block), block.where, "exec"), namespace)
    namespace.clear()
    gc.collect()  # the block's Pipes end their worker threads now


def test_every_block_has_a_known_language() -> None:
    # A block fenced as ```py or ```python3, or indented (in a list), would escape the test above.
    unknown = [f"{b.where} ({b.language})" for b in ALL_BLOCKS if b.language not in LANGUAGES]
    assert unknown == [], f"fences other than {sorted(LANGUAGES)}: {unknown}"
    indented = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        for number, line in enumerate(page.read_text().split("\n"), 1)
        if re.match(r"\s+```", line)
    ]
    assert indented == [], f"indented fences, which the test would not see: {indented}"


def test_the_readme_and_the_python_pages_have_blocks() -> None:
    # The extraction itself: a broken pattern would find nothing and pass.
    pages = {block.page.name for block in PYTHON_BLOCKS}
    assert {"README.md", "guide.md", "split.md", "schedules.md", "trace.md"} <= pages


def test_every_marker_is_a_skip_with_a_reason_or_a_continuation() -> None:
    # A misspelt or misplaced marker would otherwise be read as code and, being a comment, pass.
    def well_formed(block: Block) -> bool:
        lines = [line for line in block.code.split("\n") if "doc-test" in line]
        first = block.first_line
        return lines in ([], [first]) and (
            not lines or first == CONTINUES or bool(SKIP.match(first))
        )

    bad = [block.where for block in PYTHON_BLOCKS if not well_formed(block)]
    assert bad == [], f"doc-test markers that are not '{CONTINUES}' or a skip with a reason: {bad}"
