"""Reading a SQLite ledger loads neither SQLAlchemy nor the pydantic payload models.

`quiesce history` must stay under a second as a fresh process on a large ledger; import time is
most of it. These tests keep the cheap path cheap: the plain SQLite URL form is read without
SQLAlchemy (and exactly as SQLAlchemy reads it), and a readonly open loads no payload model.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from quiesce import ledger
from quiesce.ledger import Ledger, LedgerError
from quiesce.ledger.urls import SQLITE_PREFIX, parse, plain_sqlite_path, safe
from tests.ledger.helpers import COORDINATOR, SENT, started

ROOT = Path(__file__).resolve().parents[2]
#: Modules a readonly SQLite read must not load.
HEAVY = ("sqlalchemy", "alembic", "pydantic", "quiesce.ledger.payloads", "quiesce.ledger.schema")


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite+aiosqlite:///rel/dir/q.db", "rel/dir/q.db"),
        ("sqlite:///q.db", "q.db"),
        ("sqlite+aiosqlite:////abs/dir/q-1_2.db", "/abs/dir/q-1_2.db"),
        ("sqlite+pysqlite:////tmp/a b+c~.db", "/tmp/a b+c~.db"),
        ("sqlite+aiosqlite:///", None),  # no path: SQLAlchemy's parse refuses it
        ("sqlite+aiosqlite:///:memory:", None),
        ("sqlite+aiosqlite:///file:q.db?mode=ro&uri=true", None),
        ("sqlite+aiosqlite:////tmp/q.db?timeout=5", None),  # a query string: SQLAlchemy's rules
        ("sqlite+aiosqlite:////tmp/a%20b.db", None),  # %-escapes: SQLAlchemy's rules
        ("sqlite+aiosqlite://host/q.db", None),
        ("sqlite+aiosqlite://", None),
        ("postgresql+asyncpg://u:p@h/db", None),
        ("sqlitex:///q.db", None),
    ],
)
def test_plain_sqlite_path(url: str, path: str | None) -> None:
    assert plain_sqlite_path(url) == path


_SCHEMES = st.sampled_from(
    ["sqlite", "sqlite+aiosqlite", "sqlite+pysqlite", "sqlite+", "sqlite+a+b", "SQLITE", "postgresql"]
)
_REST = st.text(alphabet="ab/._~-+ :?%@=&#\né\\", max_size=24)


@settings(max_examples=400, deadline=None)
@given(scheme=_SCHEMES, slashes=st.sampled_from(["://", ":///", "://///", ":/"]), rest=_REST)
@example(scheme="sqlite", slashes=":///", rest="/tmp/x.db")
@example(scheme="sqlite+aiosqlite", slashes=":///", rest="a/b")
def test_plain_sqlite_path_reads_urls_as_sqlalchemy_does(scheme: str, slashes: str, rest: str) -> None:
    url = scheme + slashes + rest
    path = plain_sqlite_path(url)
    if path is None:
        return  # parsed by SQLAlchemy, as before
    backend, parsed = parse(url)
    assert backend == "sqlite"
    assert parsed.database == path
    assert parsed == make_url(SQLITE_PREFIX + path)
    assert safe(parsed) == SQLITE_PREFIX + path


def test_payload_models_cover_the_vocabulary_and_stay_importable_from_events() -> None:
    importlib.import_module("quiesce.ledger.payloads")  # run alone, nothing has loaded it yet
    assert frozenset(ledger.payloads.PAYLOADS) == ledger.events.KINDS
    assert ledger.events.PAYLOADS is ledger.payloads.PAYLOADS is ledger.PAYLOADS
    assert ledger.Payload is ledger.payloads.Payload
    from quiesce.ledger.events import CallSent, CoordinatorStarted

    assert CallSent is ledger.PAYLOADS["call.sent"]
    assert CoordinatorStarted is ledger.PAYLOADS["coordinator.started"]
    models = set(ledger.payloads.__all__) - {"validate_payload"}  # every model and PAYLOADS
    for name in models:
        assert getattr(ledger.events, name) is getattr(ledger.payloads, name)
    with pytest.raises(AttributeError):
        ledger.events.NoSuchModel  # noqa: B018


async def _make_ledger(url: str) -> None:
    async with Ledger.open(url) as writer:
        await writer.start_epoch(COORDINATOR)
        await writer.append("attempt.started", checkpoint_id="c1", data=started())
        await writer.append("call.sent", checkpoint_id="c1", call_id="k1", data=SENT)


_READ = """
import json, sys, anyio
from quiesce.ledger import Ledger

async def main(url):
    async with Ledger.open(url, readonly=True) as reader:
        rows = await reader.attempts()
        events = [e async for e in reader.read()]
    return [r.checkpoint_id for r in rows], len(events)

ids, events = anyio.run(main, sys.argv[1])
print(json.dumps({"ids": ids, "events": events, "modules": sorted(sys.modules)}))
"""


def test_a_readonly_sqlite_read_loads_no_sqlalchemy_and_no_payload_models(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    anyio.run(_make_ledger, url)
    result = subprocess.run(
        [sys.executable, "-c", _READ, url], cwd=ROOT, capture_output=True, text=True, check=True
    )
    out = json.loads(result.stdout)
    assert (out["ids"], out["events"]) == (["c1"], 3)
    loaded = [m for m in out["modules"] if m.split(".")[0] in HEAVY or m in HEAVY]
    assert loaded == []


@pytest.mark.anyio
async def test_relative_and_unusual_sqlite_urls_open_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerError, match="does not exist"):  # a ledger's folder is never created
        await Ledger.connect("sqlite+aiosqlite:///rel/q.db")
    (tmp_path / "rel").mkdir()
    async with Ledger.open("sqlite+aiosqlite:///rel/q.db") as writer:  # relative to the cwd
        await writer.start_epoch(COORDINATOR)
        assert writer.url == "sqlite+aiosqlite:///rel/q.db"
    assert (tmp_path / "rel" / "q.db").is_file()
    # the same file through SQLAlchemy's parser (a %-escape), and through the plain form
    async with Ledger.open("sqlite:///rel/q%2Edb", readonly=True) as reader:
        assert (await reader.head()) is not None
    with pytest.raises(LedgerError, match="takes no options"):  # it would be ignored: refused
        await Ledger.connect("sqlite:///rel/q.db?timeout=5", readonly=True)
    async with Ledger.open(f"sqlite:///{tmp_path / 'rel' / 'q.db'}", readonly=True) as reader:
        assert (await reader.head()) is not None
    with pytest.raises(LedgerError, match="needs a file path"):
        await Ledger.connect("sqlite+aiosqlite:///:memory:", readonly=True)
