"""`quiesce demo --plane v2`, through the real CLI: a checkpoint mid-rollout on Gym's unified plane,
restored into a fresh cluster, finishing exactly as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from quiesce.ledger import Ledger
from tests.cli.helpers import json_of, quiesce

pytestmark = pytest.mark.timeout(300)


def test_the_v2_demo_finishes_exactly_and_its_ledger_holds_the_story(tmp_path: Path) -> None:
    done = quiesce("demo", "--plane", "v2", "--dir", "work", "--json", cwd=tmp_path, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json_of(done)
    assert document["ok"] is True
    assert document["plane"] == "v2"
    assert document["differences"] == []
    # the restore listed each episode's replacement attempt, on the environment that owns it
    assert document["resubmitted"]
    assert {(r["server"], r["attempt_index"]) for r in document["resubmitted"]} == {("environment", 1)}
    assert "finished exactly as the uninterrupted run" in done.stderr

    async def kinds() -> list[str]:
        async with Ledger.open(document["ledger"], readonly=True) as ledger:
            return [ev.kind async for ev in ledger.read()]

    seen = anyio.run(kinds)
    for kind in ("episodes.scoped", "episodes.exported", "episodes.restored", "attempt.published"):
        assert kind in seen, kind
