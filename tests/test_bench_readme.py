"""README.md's benchmark table is the one ``quiesce.tools.bench.readme`` makes from
``bench-results/latest.json``.

The table is never edited by hand: a full bench run (``--readme``) or ``python -m quiesce.tools.bench.readme``
rewrites it, and this test fails when README.md and ``latest.json`` disagree.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from quiesce.tools.bench.readme import BEGIN, END, current_block, regenerate, render

REPO = Path(__file__).resolve().parents[1]


def _latest() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        (REPO / "bench-results" / "latest.json").read_text(encoding="utf-8")
    )
    return document


def test_readme_table_matches_latest_json() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = current_block(readme)
    assert block is not None, "README.md lost the generated benchmark block's markers"
    assert block == render(_latest()), (
        "README's table differs from latest.json: run python -m quiesce.tools.bench.readme"
    )


def test_every_measure_of_latest_json_is_a_row_and_missed_goals_are_named() -> None:
    document = _latest()
    text = render(document)
    for measure in document["measures"]:
        assert f"\n| {measure['id']} | " in text
    missed = copy.deepcopy(document)
    missed["measures"][0].update(status="ok", met=False)
    text = render(missed)
    assert "**Goals missed in this run:** #" + str(missed["measures"][0]["id"]) in text
    assert "| **missed** |" in text


def test_regenerate_replaces_only_the_block_and_needs_the_markers() -> None:
    document = _latest()
    readme = f"# title\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n"
    out = regenerate(readme, document)
    assert out.startswith("# title\n\nbefore\n\n")
    assert out.endswith(f"{END}\n\nafter\n")
    assert current_block(out) == render(document)
    assert regenerate(out, document) == out
    with pytest.raises(ValueError, match="no generated benchmark block"):
        regenerate("# no markers\n", document)
