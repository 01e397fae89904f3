"""README's "What we test" table is the one pytest's collection gives (`tests/what_we_test.py`)."""

from __future__ import annotations

from tests.what_we_test import README, collected, readme_table, table


def test_readme_what_we_test_matches_the_collected_suite() -> None:
    held = readme_table(README.read_text(encoding="utf-8"))
    assert held is not None, "README.md lost its What we test markers"
    assert held == table(collected()), "README's table is stale: run `python -m tests.what_we_test --write`"
