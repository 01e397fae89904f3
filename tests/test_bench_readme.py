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


def test_a_spliced_measure_replaces_its_row_and_names_the_run_it_came_from() -> None:
    from quiesce.tools.bench.__main__ import splice
    from quiesce.tools.bench.report import render_markdown

    document = _latest()
    first = copy.deepcopy(document["measures"][0])
    newer = {**first, "value": "a later figure"}
    added = {**first, "id": 99, "title": "a new measure", "value": "new"}
    run = {
        "command": "python -m quiesce.tools.bench --only 1,99 --splice",
        "commit": "abc123",
        "started": "2030-01-01T00:00:00Z",
        "runs": 2,
        "machine": {**document["machine"], "load_avg_at_start": [1.0, 2.0, 3.0]},
        "measures": [newer, added],
    }
    spliced = splice(document, run)
    ids = [m["id"] for m in spliced["measures"]]
    assert ids == sorted(ids)
    assert ids.count(first["id"]) == 1
    assert 99 in ids
    assert spliced["measures"][0]["value"] == "a later figure"
    assert spliced["measures"][0]["source"]["commit"] == "abc123"
    before = {m["id"]: m for m in document["measures"]}
    assert all(m == before[m["id"]] for m in spliced["measures"] if m["id"] not in (first["id"], 99))
    text = render(spliced)
    assert f"#{first['id']} comes from `python -m quiesce.tools.bench --only 1,99 --splice`" in text
    assert "commit `abc123`" in text
    assert "\n| 99 | a new measure | new |" in text
    assert "comes from `python -m quiesce.tools.bench --only 1,99 --splice`" in render_markdown(spliced)
