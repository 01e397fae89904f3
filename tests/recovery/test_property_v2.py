"""The stateful property test on Gym's unified plane (v2): whatever a user and crashes do, no server
is ever left held unnamed, recovery never waits for a lease, and a second recover is a no-op.

Hypothesis drives random sequences of: checkpoint (its scope derived from the environment's own
episodes); checkpoint failing at a random server and operation (an injected 500 on one control
route, once); restore and restore --resume of the latest snapshot into the same servers (Gym's
servers refuse a restore while they hold episodes or served calls, so most fail — all or nothing:
next attempts retired everywhere, everyone resumed — and some succeed); resume; abort; recover
(then a second recover, which finds nothing, makes no call and appends only its start and finish);
SIGKILL of a coordinator (checkpoint, restore, restore --resume, resume or abort in its own
process) at a random crash point; new episodes started (paced, parked at a boundary, so they are in
the next scope); freeing by status. Against one real v2 reference cluster (uvicorn on loopback,
the default 600 s lease grace) and one SQLite ledger for the whole test.

After every step: each participant whose own phase is not idle is named held by `quiesce status`
with a command that frees it; `status` exits 0 exactly when it says every server is idle; no lease
ever expired (recovery and release never wait for one). A checkpoint or restore on servers that a
finished attempt holds is refused before any request; a checkpoint on idle servers with nothing
unfinished succeeds. At the end of each example: `quiesce recover` and `quiesce resume` leave
every server idle with no checkpoint id; no snapshot folder lacks its `attempt.published` and no
staging is left; the ledger's replay and protocol check pass.

Sized for CI: `QUIESCE_PROPERTY_V2_EXAMPLES` examples (default 8) of up to
`QUIESCE_PROPERTY_V2_STEPS` steps (default 10). `QUIESCE_PROPERTY_VERBOSE=1` (with `-s`) prints
every step.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from quiesce.coordinator.crashpoints import CRASH_AT, CRASH_BEFORE_SEND
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.ledger import Ledger, replay_url
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster, start_cluster, write_yaml_atomic
from quiesce.tools.gymsim.spec import default_v2_spec
from tests.oracle.wire import Violations
from tests.recovery.test_property import _cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PARTICIPANTS = ("environment", "policy_model", "agent", "resources")
OPERATIONS = ("prepare", "commit", "resume", "restore", "retire")
CRASHED_COMMANDS = [("checkpoint",), ("restore",), ("restore", "--resume"), ("resume",), ("abort",)]
EXAMPLES = int(os.environ.get("QUIESCE_PROPERTY_V2_EXAMPLES", "8"))
STEPS = int(os.environ.get("QUIESCE_PROPERTY_V2_STEPS", "10"))
VERBOSE = bool(os.environ.get("QUIESCE_PROPERTY_VERBOSE"))


def _cut_short(problem: str) -> bool:
    """An oracle problem of a request whose body never arrived whole (its sender was killed)."""
    return " request v2 " in problem and "(root): Input should be a valid dictionary" in problem


@pytest.fixture
def v2_running(monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningCluster]:
    token = "qzp2-" + os.urandom(12).hex()
    monkeypatch.setenv(TOKEN_ENV, token)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    with start_cluster(default_v2_spec(), token=token) as running:
        yield running


def test_no_v2_server_is_ever_left_held(
    v2_running: RunningCluster, tmp_path: Path, wire_oracle: Violations
) -> None:
    urls = v2_running.urls
    http = httpx.Client(trust_env=False, timeout=30)
    snapshots = tmp_path / "snaps"
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    config = write_yaml_atomic(tmp_path / "cluster.yaml", v2_running.config(url, snapshots))
    rollouts = itertools.count()

    def truth() -> dict[str, dict[str, Any]]:
        return {n: http.get(urls[n] + "/gymsim/admin/state").json() for n in PARTICIPANTS}

    def posts() -> int:
        return sum(
            1
            for n in PARTICIPANTS
            for e in http.get(urls[n] + "/gymsim/admin/control-log").json()
            if e["method"] == "POST"
        )

    def run_episode(rollout_id: str) -> None:
        body = {"episode_id": {"rollout_id": rollout_id, "attempt": 0}, "task": {"turns": 4}, "paced": True}
        try:  # parked at boundary 0 until retired, or refused while a checkpoint holds the servers
            with httpx.Client(trust_env=False, timeout=None) as client:
                client.post(urls["environment"] + "/run", json=body)
        except httpx.HTTPError:
            pass

    class NoV2ServerLeftHeld(RuleBasedStateMachine):
        def run(self, *argv: str) -> tuple[int, Any]:
            code, doc = _cli(*argv, "--config", str(config), "--json")
            if VERBOSE and argv[0] != "status":
                outcome = doc.get("outcome") if isinstance(doc, dict) else None
                print(f"  {' '.join(argv)} -> {code} {outcome or ''}")
            return code, doc

        def status(self) -> tuple[int, dict[str, Any]]:
            code, doc = self.run("status")
            assert code in (0, 1), doc
            return code, doc

        def expect_start(self, argv: tuple[str, ...], *, fault: bool = False) -> tuple[int, Any]:
            _, before = self.status()
            held = {s["name"] for s in before["servers"] if s["name"] in PARTICIPANTS and s["held"]}
            sent = posts()
            code, doc = self.run(*argv)
            if argv[0] == "restore" and not (snapshots / "LATEST").exists():
                assert code == 1, doc  # nothing to restore yet
            elif not before["unfinished"] and held:
                assert (code, doc.get("outcome")) == (1, "refused"), doc
                assert posts() == sent, "a refused attempt sent a request"
            elif argv[0] == "checkpoint" and not before["unfinished"] and not fault:
                assert code == 0, doc
            else:
                assert code in (0, 1), doc
            return code, doc

        # -- rules -----------------------------------------------------------------------------

        @rule(count=st.integers(1, 2))
        def episodes(self, count: int) -> None:
            for _ in range(count):
                rollout_id = f"p{next(rollouts)}"
                threading.Thread(target=run_episode, args=(rollout_id,), daemon=True).start()

        @rule()
        def checkpoint(self) -> None:
            self.expect_start(("checkpoint",))

        @rule(server=st.sampled_from(PARTICIPANTS), operation=st.sampled_from(OPERATIONS))
        def checkpoint_failing(self, server: str, operation: str) -> None:
            fault = {"kind": "fail", "path": f"/checkpoint/{operation}", "status": 500, "code": "injected"}
            http.post(urls[server] + "/gymsim/admin/faults", json={"faults": [{**fault, "times": 1}]})
            try:
                self.expect_start(("checkpoint",), fault=True)
            finally:
                http.delete(urls[server] + "/gymsim/admin/faults").raise_for_status()

        @rule(resume=st.booleans())
        def restore(self, resume: bool) -> None:
            self.expect_start(("restore", "--resume") if resume else ("restore",))

        @rule()
        def resume(self) -> None:
            code, doc = self.run("resume")
            assert code == 0, doc

        @rule()
        def abort(self) -> None:
            code, doc = self.run("abort")
            assert code == 0, doc

        @rule()
        def recover(self) -> None:
            code, doc = self.run("recover")
            assert code == 0, doc
            head, calls = self.head(), posts()
            code, doc = self.run("recover")  # a second recover finds nothing, calls nobody
            assert (code, doc["attempts"]) == (0, []), doc
            assert self.kinds_after(head) == ["coordinator.started", "recovery.started", "recovery.completed"]
            assert posts() == calls

        def head(self) -> int:
            async def read() -> int:
                async with Ledger.open(url, readonly=True) as ledger:
                    return await ledger.last_seq()

            return anyio.run(read)

        def kinds_after(self, seq: int) -> list[str]:
            async def read() -> list[str]:
                async with Ledger.open(url, readonly=True) as ledger:
                    return [e.kind async for e in ledger.read(after=seq)]

            return anyio.run(read)

        @rule(
            command=st.sampled_from(CRASHED_COMMANDS),
            variable=st.sampled_from([CRASH_AT, CRASH_BEFORE_SEND]),
            n=st.integers(1, 60),
        )
        def sigkill(self, command: tuple[str, ...], variable: str, n: int) -> None:
            point = n if variable == CRASH_AT else 1 + n % 12
            env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), variable: str(point)}
            done = subprocess.run(
                [sys.executable, "-m", "quiesce", *command, "--config", str(config), "--json"],
                cwd=str(IMPORT_ROOT),
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode in (-9, 0, 1), done.stderr[-2000:]
            time.sleep(0.2)  # a request the kill cut short has reached its server
            # the wire oracle sees a request body the SIGKILL cut short as drift; that alone is excused
            drift = [p for p in wire_oracle.take() if not _cut_short(p)]
            assert drift == [], drift
            if VERBOSE:
                print(f"  {' '.join(command)} with {variable}={point} -> {done.returncode}")

        @rule()
        def free_by_status(self) -> None:
            _, doc = self.status()
            for holder in doc["holders"]:
                argv = shlex.split(holder["frees"])
                assert argv[:1] == ["quiesce"]
                code, out = _cli(*argv[1:], "--json")
                if VERBOSE:
                    print(f"  {holder['frees']} (from status) -> {code} {out.get('outcome')}")
                assert code == 0, (holder, out)
            code, doc = self.status()
            assert code == 0, doc
            assert {n: s["phase"] for n, s in truth().items()} == dict.fromkeys(PARTICIPANTS, "idle")

        # -- the invariant ---------------------------------------------------------------------

        @invariant()
        def status_names_whatever_holds_a_server(self) -> None:
            code, doc = self.status()
            servers = {s["name"]: s for s in doc["servers"]}
            for name, state in truth().items():
                assert state["lease_expirations"] == 0, (name, "a lease expired")
                if state["phase"] != "idle":
                    assert servers[name]["held"], (name, state["phase"], doc)
                    assert servers[name]["frees"], (name, doc)
            assert (code == 0) == doc["idle"]

        def teardown(self) -> None:
            code, doc = self.run("recover")
            assert code == 0, doc
            code, doc = self.run("resume")
            assert code == 0, doc
            assert {n: (s["phase"], s["checkpoint_id"]) for n, s in truth().items()} == dict.fromkeys(
                PARTICIPANTS, ("idle", None)
            )
            if (snapshots / ".staging").is_dir():
                assert list((snapshots / ".staging").iterdir()) == []
            published = set(self.published())
            for child in snapshots.iterdir() if snapshots.is_dir() else []:
                if child.is_dir() and not child.name.startswith("."):
                    assert str(child) in published, f"{child.name}: a snapshot without attempt.published"
            replayed = anyio.run(replay_url, url)
            assert replayed.ok, (replayed.problem, replayed.differences[:3])
            report = anyio.run(check_ledger, url)
            assert report.violations == [], report.violations

        def published(self) -> list[str]:
            async def read() -> list[str]:
                async with Ledger.open(url, readonly=True) as ledger:
                    return [e.data["final_dir"] async for e in ledger.read() if e.kind == "attempt.published"]

            return anyio.run(read)

    run: Callable[..., None] = run_state_machine_as_test  # untyped in hypothesis
    try:
        run(
            NoV2ServerLeftHeld,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        http.close()
