"""Misbehaving Gym servers: every one fails the save, rolls back, within the deadline, publishing nothing.

Each case puts a hostile front (`front.py`) between the coordinator and one real reference server
of the seed cluster; the front misbehaves once, on one route, and forwards everything else. The
coordinator runs a real save with a 2 s budget. Each case asserts:

- **the error text** says what went wrong (the class of failure, the server, the phase);
- **rollback**: every server the attempt touched was resumed (`attempt.aborted` leaves none
  paused) and every server of the cluster is idle and accepting again;
- **a bounded time, measured against the deadline** the ledger recorded: the failure is recorded
  before `deadline_ts + deadline_s`, and the rollback ends within `control_timeout_s` of it — a
  hang, a trickle or a reply that never ends cannot hold the coordinator past its budget;
- **nothing published**: no snapshot folder, no `LATEST`, no staging folder left behind;
- the audit's protocol check passes on the ledger.

The files a server writes are checked too: a symlink or a FIFO in a server's folder, and a symlink,
hard link to an outside file, socket or device file in the caller's half, fail the save naming the
path. A restore answered with another checkpoint id fails too, resuming nobody (half-restored
state must not run).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError, parse_config, read_latest
from quiesce.coordinator.protocol import AGENT, RESOURCES, manifest_path
from quiesce.ledger import Event
from quiesce.tools.audit.attempts import parse_at
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import assert_all_accepting, assert_protocol_ok, read_events
from tests.hostile import front
from tests.hostile.front import Rule, hostile_front

pytestmark = pytest.mark.anyio

DEADLINE_S = 2.0
CONTROL_TIMEOUT_S = 5.0


def _odd_in_folder(
    component: str, name: str, make: Callable[[Path], None]
) -> Callable[[dict[str, Any]], None]:
    """After the server's commit wrote its folder: `make(<its folder>/<entry>)`."""

    def act(body: dict[str, Any]) -> None:
        folder = Path(body["checkpoint_dir"]) / Path(manifest_path(component, name)).parent
        make(folder / "extra")

    return act


def _foreign_status(document: dict[str, Any]) -> None:
    document["checkpoint_id"] = "e9-999999"


def _dotdot(document: dict[str, Any]) -> None:
    document["continuation_index"]["relative_path"] = "../../../outside/continuations.jsonl"


#: case -> (server behind the front, route suffix, act, fragments the error must contain)
CASES: dict[str, tuple[str, str, front.Act, tuple[str, ...]]] = {
    "hang": (
        "simple_agent",
        "/agent-checkpoint/prepare",
        front.hang,
        ("prepare", "simple_agent", "deadline"),
    ),
    "500": (
        "tools",
        "/resources-checkpoint/prepare",
        front.status_500,
        ("tools", "http 500", "internal_error"),
    ),
    "non-JSON": (
        "simple_agent",
        "/agent-checkpoint/commit",
        front.not_json,
        ("simple_agent", "not valid JSON"),
    ),
    "50 MB body": (
        "policy_model",
        "/model-checkpoint/commit",
        front.huge,
        ("policy_model", "larger than 1 MiB"),
    ),
    "100,000 levels of nesting": (
        "policy_model",
        "/model-checkpoint/commit",
        front.nested,
        ("policy_model", "not valid JSON", "recursion limit"),
    ),
    "lone surrogate": (
        "tools",
        "/resources-checkpoint/prepare",
        front.lone_surrogate,
        ("tools", "not valid JSON", "hex escape"),
    ),
    "lone surrogate in an error": (
        "simple_agent",
        "/agent-checkpoint/prepare",
        front.surrogate_error,
        ("simple_agent", "http 409"),
    ),
    "float overflow": (
        "policy_model",
        "/model-admission/pause",
        front.overflow,
        ("policy_model", "too large for a float"),
    ),
    "1 byte/s": ("policy_model", "/model-admission/status", front.trickle, ("policy_model", "deadline")),
    "close mid-reply": ("tools", "/resources-checkpoint/commit", front.cut, ("tools", "connection lost")),
    "endless chunked body": (
        "simple_agent",
        "/agent-checkpoint/prepare",
        front.endless_chunked,
        ("simple_agent", "deadline"),
    ),
    "endless headers": (
        "policy_model",
        "/model-admission/pause",
        front.endless_headers,
        ("policy_model", "headers"),
    ),
    "wrong checkpoint id": (
        "policy_model",
        "/model-admission/status",
        front.rewrite(_foreign_status),
        ("policy_model", "e9-999999"),
    ),
    "../ in an artifact path": (
        "simple_agent",
        "/agent-checkpoint/commit",
        front.rewrite(_dotdot),
        ("simple_agent", "relative_path"),
    ),
    "symlink in a server's folder": (
        "tools",
        "/resources-checkpoint/commit",
        front.after(_odd_in_folder(RESOURCES, "tools", lambda p: p.symlink_to("/etc/passwd"))),
        ("tools", "resources/tools/extra", "symlink"),
    ),
    "FIFO in a server's folder": (
        "simple_agent",
        "/agent-checkpoint/commit",
        front.after(_odd_in_folder(AGENT, "simple_agent", os.mkfifo)),
        ("simple_agent", "/extra", "FIFO"),
    ),
}


def _config_through(cluster: RunningCluster, tmp_path: Path, ledger_url: str, server: str, url: str) -> Any:
    document = cluster.config(ledger_url, tmp_path / "snapshots", control_timeout_s=CONTROL_TIMEOUT_S)
    for entry in document["servers"]:
        if entry["name"] == server:
            entry["url"] = url
    return parse_config(document, base_dir=tmp_path)


def _first(events: list[Event], kind: str) -> Event:
    return next(e for e in events if e.kind == kind)


async def assert_rolled_back_in_time(
    http: httpx.AsyncClient, cluster: RunningCluster, config: Any, error: PhaseError
) -> list[Event]:
    """Rollback, the deadline bound, nothing published (see the module docstring); the events."""
    assert error.checkpoint_id is not None
    assert error.not_resumed == [], error.not_resumed
    await assert_all_accepting(http, cluster)
    events = await read_events(config.ledger, error.checkpoint_id)
    started, failed, aborted = (
        _first(events, k) for k in ("attempt.started", "phase.failed", "attempt.aborted")
    )
    assert aborted.data["left_paused"] == []
    deadline_ts = started.data["deadline_ts"]
    assert parse_at(failed.at) <= deadline_ts + DEADLINE_S, "the failure was recorded long after the deadline"
    assert parse_at(aborted.at) - parse_at(failed.at) <= CONTROL_TIMEOUT_S, (
        "the rollback outlasted its budget"
    )
    assert read_latest(config.snapshots) is None
    assert not (config.snapshots / error.checkpoint_id).exists()
    assert not (config.staging_root / error.checkpoint_id).exists()
    assert [p.name for p in config.snapshots.iterdir() if not p.name.startswith(".")] == []
    await assert_protocol_ok(config.ledger)
    return events


@pytest.mark.parametrize("case", list(CASES))
async def test_a_misbehaving_server_fails_the_save_and_everyone_is_resumed(
    case: str, cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    server, path, act, fragments = CASES[case]
    rule = Rule(path, act)
    async with httpx.AsyncClient(timeout=30) as http, hostile_front(cluster.urls[server], rule) as url:
        config = _config_through(cluster, tmp_path, sqlite_url, server, url)
        async with Coordinator.open(config) as coord:
            with pytest.raises(PhaseError) as caught:
                await coord.checkpoint(deadline_s=DEADLINE_S)
        assert rule.fired, f"the front never misbehaved on {path}"
        message = str(caught.value)
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        await assert_rolled_back_in_time(http, cluster, config, caught.value)


def _socket(path: Path) -> None:
    # an AF_UNIX address holds at most 107 bytes, less than a staging folder's path under pytest's
    # tmp_path (a checkpoint id is 25 characters): bind the socket at a short path in the temp
    # folder (the filesystem tmp_path is on), then move it in
    short = Path(tempfile.mkdtemp(prefix="s")) / "s"
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(short))
        os.replace(short, path)
    finally:
        os.rmdir(short.parent)


def _device(path: Path) -> None:
    try:
        os.mknod(path, 0o600 | 0o020000, os.makedev(1, 3))  # a character device: /dev/null's numbers
    except PermissionError:
        pytest.skip("creating a device file needs CAP_MKNOD (the CI runs the tests as root)")


def _outside_hard_link(path: Path) -> None:
    outside = path.parents[4] / "outside.bin"  # beside the snapshots folder
    outside.write_bytes(b"the trainer keeps writing this file after the save\n")
    os.link(outside, path)


#: what the caller's half (the trainer's own files) holds -> (maker, fragment of the error)
CALLER_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "symlink": (lambda p: p.symlink_to("/etc/hostname"), "a symlink"),
    "hard link to an outside file": (_outside_hard_link, "a hard link to a file outside"),
    "socket": (_socket, "a socket"),
    "device file": (_device, "a character device"),
    "FIFO": (os.mkfifo, "a FIFO"),
}


@pytest.mark.parametrize("case", list(CALLER_CASES))
async def test_the_callers_half_holds_something_that_cannot_be_published(
    case: str, cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    make, fragment = CALLER_CASES[case]
    config = parse_config(
        cluster.config(sqlite_url, tmp_path / "snapshots", control_timeout_s=CONTROL_TIMEOUT_S),
        base_dir=tmp_path,
    )

    async def save(coord: Coordinator) -> None:
        async with coord.save(deadline_s=DEADLINE_S) as attempt:
            assert attempt.staging_dir is not None
            trainer = attempt.staging_dir / "trainer"
            trainer.mkdir()
            (trainer / "step.txt").write_text("1200\n")
            make(trainer / "odd")

    async with httpx.AsyncClient(timeout=30) as http:
        async with Coordinator.open(config) as coord:
            with pytest.raises(PhaseError) as caught:
                await save(coord)
        message = str(caught.value)
        assert "trainer/odd" in message, message
        assert fragment in message, message
        assert caught.value.phase == "publish"
        await assert_rolled_back_in_time(http, cluster, config, caught.value)


async def test_a_restore_answered_with_another_checkpoint_id_resumes_nobody(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    """The restore's contract differs from a save's: a failed restore is never rolled back (the
    half-restored servers must not run), so every server it touched stays paused, and the error
    says so; it ends within the deadline all the same."""

    def foreign(document: dict[str, Any]) -> None:
        document["source_checkpoint_id"] = "e9-999999"

    rule = Rule("/agent-checkpoint/restore", front.rewrite(foreign))
    async with (
        httpx.AsyncClient(timeout=30) as http,
        hostile_front(cluster.urls["simple_agent"], rule) as url,
    ):
        config = _config_through(cluster, tmp_path, sqlite_url, "simple_agent", url)
        async with Coordinator.open(config) as coord:
            published = (await coord.checkpoint(deadline_s=20)).snapshot
            assert published is not None
            with pytest.raises(PhaseError) as caught:
                await coord.restore("latest", deadline_s=DEADLINE_S)
        assert rule.fired
        error = caught.value
        for fragment in ("e9-999999", "simple_agent", "stay paused"):
            assert fragment in str(error), str(error)
        assert error.resumed == []
        assert set(error.not_resumed) == {"policy_model", "simple_agent"}
        events = await read_events(config.ledger, error.checkpoint_id)
        started, aborted = _first(events, "attempt.started"), _first(events, "attempt.aborted")
        assert parse_at(aborted.at) <= started.data["deadline_ts"] + DEADLINE_S
        assert aborted.data["resumed"] == []
        assert not any(e.kind == "call.sent" and e.data["path"].endswith("/resume") for e in events)
        assert read_latest(config.snapshots) == published  # nothing new published, nothing lost
        async with Coordinator.open(config) as coord:  # the way out the error names
            await coord.resume()
        await assert_all_accepting(http, cluster)


@pytest.mark.parametrize("act", [front.nested, front.lone_surrogate])
async def test_a_reply_no_parser_should_follow_is_one_line_and_json_through_the_cli(
    act: front.Act, cluster: RunningCluster, sqlite_url: str, tmp_path: Path, token: str
) -> None:
    """The real CLI against a hostile reply: exit 1, one line naming the server and the cause, no
    traceback; with `--json`, the outcome document all the same."""
    import json

    import anyio

    from quiesce.tools.gymsim.cluster import write_yaml_atomic
    from tests.hostile.helpers import no_traceback, run_cli

    rule = Rule("/model-checkpoint/commit", act)
    async with (
        httpx.AsyncClient(timeout=30) as http,
        hostile_front(cluster.urls["policy_model"], rule) as url,
    ):
        document = cluster.config(sqlite_url, tmp_path / "snapshots", control_timeout_s=CONTROL_TIMEOUT_S)
        for entry in document["servers"]:
            if entry["name"] == "policy_model":
                entry["url"] = url
        written = write_yaml_atomic(tmp_path / "cluster.yaml", document)
        done = await anyio.to_thread.run_sync(
            lambda: run_cli("checkpoint", "--config", str(written), "--json", token=token)
        )
        assert rule.fired
        assert done.returncode == 1, (done.stdout, done.stderr)
        no_traceback(done)
        assert "RecursionError" not in done.stderr
        assert "UnicodeEncodeError" not in done.stderr
        outcome = json.loads(done.stdout)
        assert outcome["outcome"] == "aborted", outcome
        assert "policy_model" in json.dumps(outcome)
        assert "not valid JSON" in json.dumps(outcome)
        await assert_all_accepting(http, cluster)
    await assert_protocol_ok(sqlite_url)
