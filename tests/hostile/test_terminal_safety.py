"""A server's text reaches no terminal raw: controls escaped, markup literal, length capped, no forged line.

A hostile front answers one of the tools server's control calls with an error whose code and
detail carry ANSI escapes (a line erased, a green "published" line drawn in its place), a carriage
return, newlines, rich markup, a bidi override, BEL, a C1 control and 20 000 characters more. The
real command line, in a child process, prints none of those bytes raw — not `quiesce checkpoint`
(its progress lines and its error), not `quiesce show` (every call's reply detail, `-o wide` too),
not `quiesce status` (a server whose capabilities answer with that error), nor their `--json` /
`-o jsonl` output — and forges no line: none starts with the forged `published` or the markup,
the markup prints literally (`[red]`), the text is cut to a bounded length and says how much was
left out.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from quiesce.tools.gymsim.cluster import RunningCluster, write_yaml_atomic
from tests.coordinator.helpers import assert_all_accepting
from tests.hostile.front import Front, Request, Rule, hostile_front, whole
from tests.hostile.helpers import no_traceback, run_cli

pytestmark = pytest.mark.anyio

FORGED = "\x1b[2K\r\x1b[1;32mpublished q-forged-0000000001-e1 -> /snapshots/forged\x1b[0m"
DETAIL = (
    "disk full"
    + FORGED
    + "\npublished q-forged -> /x\r\n[red]ALERT[/red] [bold]bold[/bold] \u202egnp.exe\x07\x9b31m"
    + "A" * 20_000
)
CODE = "evil\x1b[31m\ncode"
#: Bytes that must never reach the terminal raw.
RAW = ("\x1b", "\r", "\u202e", "\x07", "\x9b")


async def hostile_error(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    body = json.dumps({"error": {"code": CODE, "detail": DETAIL}}, ensure_ascii=False)
    await stream.send(whole(500, body.encode()))
    return True


def _config(cluster: RunningCluster, tmp_path: Path, url: str, name: str) -> Path:
    document: dict[str, Any] = cluster.config("sqlite+aiosqlite:///q.db", "snaps")
    for entry in document["servers"]:
        if entry["name"] == "tools":
            entry["url"] = url
    return write_yaml_atomic(tmp_path / name, document)


async def _cli(*args: str, token: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: run_cli(*args, token=token))


def assert_safe(text: str) -> None:
    """No raw control byte, no forged line, the markup literal."""
    for raw in RAW:
        assert raw not in text, (raw, text[:3000])
    for line in text.splitlines():
        assert not line.lstrip().startswith(("published q-forged", "[red]")), line[:300]
    assert "ALERT[/red]" not in text or "[red]ALERT[/red]" in text


async def test_a_hostile_error_reply_reaches_no_terminal_raw(
    cluster: RunningCluster, tmp_path: Path, token: str
) -> None:
    rule = Rule("/resources-checkpoint/commit", hostile_error)
    async with httpx.AsyncClient(timeout=30) as http, hostile_front(cluster.urls["tools"], rule) as url:
        config = _config(cluster, tmp_path, url, "cluster.yaml")
        done = await _cli("checkpoint", "--config", str(config), "--deadline-s", "60", token=token)
        assert rule.fired
        assert done.returncode == 1, done.stderr[-3000:]
        no_traceback(done)
        assert_safe(done.stdout + done.stderr)
        failed = [line for line in done.stderr.splitlines() if " commit FAILED" in line]
        assert len(failed) == 1, done.stderr[-3000:]
        assert "\\x1b[2K\\r\\x1b[1;32mpublished" in failed[0]  # shown, escaped, on its own line
        assert "more characters]" in failed[0]
        assert len(failed[0]) < 1000
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, done.stderr[-3000:]
        assert "[red]ALERT[/red]" in errors[0]  # markup printed literally
        assert "more characters]" in errors[0]
        assert len(done.stderr) < 12_000  # 20 000 characters sent, twice
        await assert_all_accepting(http, cluster)
        as_json = await _cli("checkpoint", "--config", str(config), "--json", token=token)
        assert as_json.returncode == 0, as_json.stderr[-3000:]  # the front misbehaved once
        assert_safe(as_json.stdout + as_json.stderr)

    folder = tmp_path / "q.db"
    for output in ("table", "wide", "json", "jsonl"):
        shown = await _cli("show", "latest", "--ledger", str(folder), "-o", output, token=token)
        assert shown.returncode == 0, shown.stderr
        assert_safe(shown.stdout + shown.stderr)
    first = json.loads((await _cli("history", "--ledger", str(folder), "--json", token=token)).stdout)[0]
    shown = await _cli("show", first["checkpoint_id"], "--ledger", str(folder), "-o", "wide", token=token)
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)
    assert "disk full" in shown.stdout  # the failed call's detail is shown, made safe
    listed = await _cli("show", first["checkpoint_id"], "--ledger", str(folder), "-o", "jsonl", token=token)
    assert_safe(listed.stdout)
    # the machine-readable output keeps the text whole, as JSON escapes
    assert any(FORGED in (json.loads(line).get("detail") or "") for line in listed.stdout.splitlines())


async def test_status_shows_a_hostile_server_safely(
    cluster: RunningCluster, tmp_path: Path, token: str
) -> None:
    rule = Rule("/ng-control/v1/capabilities", hostile_error, times=1000)
    async with hostile_front(cluster.urls["tools"], rule) as url:
        config = _config(cluster, tmp_path, url, "status.yaml")
        for output in ("table", "wide"):
            done = await _cli("status", "--config", str(config), "-o", output, token=token)
            assert rule.fired
            no_traceback(done)
            assert_safe(done.stdout + done.stderr)
            assert "disk full" in done.stdout + done.stderr
            assert len(done.stdout) < 12_000
