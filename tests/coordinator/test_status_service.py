"""What frees a held server while a real `quiesce serve` holds the ledger, on SQLite and PostgreSQL.

A CLI command that opens the ledger then fails ("already has a writer"), so every command the
status names goes through the service: read through a read-only ledger as `quiesce status` reads
it (the service found from the lease, or from the process holding the SQLite writer lock), and by
the service's own `Coordinator.status()` (`GET /v1/status`) and its refusal of a save — each names
`quiesce resume --service URL ID`, which, run as printed, frees the servers. Before the service
starts, the same read names the command with `--config`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.coordinator.calls import peek_capabilities
from quiesce.coordinator.config import load_config
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.coordinator.status import ClusterStatus, read_status
from quiesce.ledger import Ledger
from quiesce.tools.cli.main import main as cli
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from quiesce.tools.serve.spawn import start_service
from tests.coordinator.helpers import assert_all_accepting

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="a SQLite ledger's writer is found through /proc (Linux)"
    ),
]

API = "api-token-for-status-tests"
AUTH = {"Authorization": f"Bearer {API}"}
PARTICIPANTS = {"policy_model", "simple_agent", "tools"}


@pytest.fixture
def serve(token: str, tmp_path: Path) -> Iterator[Callable[[Path], str]]:
    """`serve(config)` starts `quiesce serve` on it (loopback, API token `API`), waits until it is
    ready (on PostgreSQL it first takes the lease) and returns its address; stopped (SIGTERM, then
    SIGKILL) at the end of the test."""
    started: list[subprocess.Popen[str]] = []

    def start(config: Path) -> str:
        env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(IMPORT_ROOT), "QUIESCE_API_TOKEN": API}
        process, announced = start_service(config, env, tmp_path / f"serve-{len(started)}.log")
        started.append(process)
        url = str(announced["listening"])
        give_up = time.monotonic() + 60  # a hang guard, not a timing assertion
        while httpx.get(f"{url}/readyz", trust_env=False).status_code != 200:  # PostgreSQL: lease first
            assert time.monotonic() < give_up, f"{url} never became ready"
            time.sleep(0.05)
        return url

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _read_as_the_cli(config_file: Path) -> ClusterStatus:
    """What `quiesce status --config C` reads: every fence, holders looked up in a read-only ledger."""
    config = load_config(config_file)
    client = HttpClient()
    try:
        async with Ledger.open(config.ledger, readonly=True) as reader:
            return await read_status(
                config,
                reader,
                lambda name, url, deadline: peek_capabilities(
                    client, name, url, token=None, deadline_ts=deadline
                ),
                config_path=str(config_file),
            )
    finally:
        await client.aclose()


def _frees(status: ClusterStatus) -> set[str | None]:
    """Every command the status names: per held server and per holder."""
    held = [s for s in status.servers if s.held]
    assert {s.name for s in held} == PARTICIPANTS
    return {s.frees for s in held} | {h.frees for h in status.holders}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """The CLI in this process (call it from a worker thread: it runs its own event loop); its
    `--json` document."""
    capsys.readouterr()
    code = cli(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


async def test_while_a_service_holds_the_ledger_status_names_the_command_through_it(
    cluster: RunningCluster,
    ledger_url: str,
    tmp_path: Path,
    serve: Callable[[Path], str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QUIESCE_API_TOKEN", API)  # what the CLI sends the service
    config_file = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    async with Coordinator.open(config_file) as coord:
        await coord.checkpoint(deadline_s=30)
        cid = (await coord.restore()).checkpoint_id  # left paused for its resume
    # nobody holds the ledger: the command opens it itself
    assert _frees(await _read_as_the_cli(config_file)) == {f"quiesce resume --config {config_file} {cid}"}

    url = serve(config_file)
    through = f"quiesce resume --service {url} {cid}"
    status = await _read_as_the_cli(config_file)
    assert _frees(status) == {through}
    assert {s["frees"] for s in status.as_json()["servers"] if s["held"]} == {through}
    assert [h["frees"] for h in status.as_json()["holders"]] == [through]
    async with httpx.AsyncClient(base_url=url, headers=AUTH, trust_env=False, timeout=60) as http:
        served = (await http.get("/v1/status")).json()  # the service's own Coordinator.status()
        assert [h["frees"] for h in served["holders"]] == [through]
        assert {s["frees"] for s in served["servers"] if s["held"]} == {through}
        refused = await http.post("/v1/checkpoints", json={})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["type"] == "ServersHeld"
        assert f"free them with `{through}`" in refused.json()["error"]["message"]
        # the command it names works while the service runs: run exactly as printed, it frees them
        argv = shlex.split(through)
        assert argv[0] == "quiesce"
        code, out = await anyio.to_thread.run_sync(lambda: _cli(capsys, *argv[1:], "--json"))
        assert code == 0, out
        assert (out["checkpoint_id"], out["outcome"]) == (cid, "resumed")
        await assert_all_accepting(http, cluster)
    after = await _read_as_the_cli(config_file)
    assert (after.idle, after.holders) == (True, [])
