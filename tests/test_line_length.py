"""No line of the package or its tests is longer than 100 characters (STYLE.md: code a
reader takes in without scrolling; a long line hides its second half in every diff)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CHARS = 100


def test_no_line_is_over_100_characters():
    long = [f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
            for folder in ("pagedllm", "tests", "scripts")
            for path in sorted((ROOT / folder).rglob("*.py"))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_CHARS]
    assert not long, "\n".join(long)
