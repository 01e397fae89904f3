"""`RemoteCoordinator` against a real service: the embedded API's shapes, errors and failover.

- `discover`, `save` (the caller's half lands in the snapshot), `abort()` of the attempt in
  progress, `restore`, `resume`, `history`
  return the very types `Coordinator` returns, and `history()` equals the ledger's projection;
- an exception inside `save()` rolls the attempt back and is re-raised with a note; the servers
  accept again and the ledger says `aborted`;
- a second save while one waits raises `Busy` naming it; a wrong token raises `Unauthorized`;
- given a dead address first, the client fails over to the live service;
- README's service example runs as written against a real service, and differs from the embedded
  example by the `Coordinator.open` line and its import only.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Attempt, Discovery, Outcome, read_history
from quiesce.ledger import AttemptRow
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.errors import Busy, NotFound, Unauthorized
from tests.coordinator.helpers import assert_all_accepting
from tests.serve.conftest import ServiceProcess, wait_ready
from tests.test_readme import README, embedded_api_example

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


class Boom(Exception):
    pass


async def test_same_shapes_as_the_embedded_api(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config, api_token="secret-api")
    await wait_ready(service.url)
    async with RemoteCoordinator(["http://127.0.0.1:9", service.url], token="secret-api") as coord:
        found = await coord.discover()
        assert isinstance(found, Discovery)
        assert found.names == ["policy_model", "simple_agent", "tools"]
        async with coord.save(deadline_s=60) as attempt:
            assert isinstance(attempt, Attempt)
            assert attempt.staging_dir is not None
            (attempt.staging_dir / "trainer").mkdir()
            (attempt.staging_dir / "trainer" / "step.txt").write_text("7\n")
            with pytest.raises(Busy) as busy:
                async with coord.save():
                    pass
            assert busy.value.checkpoint_id == attempt.checkpoint_id
        assert attempt.state == "completed"
        assert attempt.snapshot is not None
        assert (attempt.snapshot / "trainer" / "step.txt").read_text() == "7\n"
        assert coord.url == service.url  # failed over from the dead address
        with pytest.raises(Boom) as boom:
            async with coord.save(deadline_s=60) as doomed:
                raise Boom("the trainer's half failed")
        assert any("rolled back" in note for note in boom.value.__notes__)
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer secret-api"}) as raw:
            waiting = (await raw.post(f"{service.url}/v1/attempts", json={})).json()["checkpoint_id"]
        aborted = await coord.abort()  # no attempt named: the one in progress
        assert (aborted.checkpoint_id, aborted.outcome) == (waiting, "aborted")
        restored = await coord.restore(attempt.snapshot)
        assert isinstance(restored, Attempt)
        assert restored.kind == "restore"
        assert restored.source_checkpoint_id == attempt.checkpoint_id
        resumed = await coord.resume()
        assert isinstance(resumed, Outcome)
        assert resumed.checkpoint_id == restored.checkpoint_id
        history = await coord.history()
        page = await coord.history(limit=2)
        older = await coord.history(limit=2, before=page[0].checkpoint_id)
        aborts = await coord.history(outcome="aborted", before=page[-1].checkpoint_id)
        with pytest.raises(NotFound, match="no attempt 'q-none' in the ledger"):
            await coord.history(before="q-none")
    assert len(history) >= 4
    assert (page, older) == (history[-2:], history[-4:-2])
    assert [r.checkpoint_id for r in aborts] == [doomed.checkpoint_id, waiting]
    async with httpx.AsyncClient(trust_env=False) as http:
        await assert_all_accepting(http, cluster)
    assert all(isinstance(r, AttemptRow) for r in history)
    assert history == await read_history(ledger_url)
    outcomes = {r.checkpoint_id: r.outcome for r in history}
    assert outcomes[attempt.checkpoint_id] == "published"
    assert outcomes[doomed.checkpoint_id] == "aborted"
    assert outcomes[waiting] == "aborted"
    assert outcomes[restored.checkpoint_id] == "restored"
    async with RemoteCoordinator(service.url, token="wrong") as intruder:
        with pytest.raises(Unauthorized):
            await intruder.history()


def _service_example(text: str) -> str:
    match = re.search(r"^## Service\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert match, 'README.md has no "## Service" section'
    block = re.search(r"^```python\n(.*?)^```", match.group(1), flags=re.M | re.S)
    assert block, 'the "Service" section of README.md has no ```python block'
    return block.group(1)


async def test_readme_service_example(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any, monkeypatch: Any
) -> None:
    import anyio.to_thread

    text = README.read_text(encoding="utf-8")
    remote, embedded = _service_example(text), embedded_api_example(text)
    changed = [
        line
        for line in difflib.unified_diff(embedded.splitlines(), remote.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert len(changed) == 4, changed  # the import and the open line, each side
    assert any("RemoteCoordinator(" in line for line in changed)
    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config, api_token="readme-token")
    await wait_ready(service.url)
    monkeypatch.setenv("QUIESCE_API_TOKEN", "readme-token")
    code = remote.replace("http://127.0.0.1:8470", service.url)
    namespace = {"__name__": "__readme__"}
    await anyio.to_thread.run_sync(lambda: exec(compile(code, f"{README}:Service", "exec"), namespace))
    rows = await read_history(sqlite_url)
    assert [(r.kind, r.outcome) for r in rows] == [("save", "published"), ("restore", "restored")]
