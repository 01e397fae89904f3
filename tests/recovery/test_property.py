"""A stateful property test: whatever a user and crashes do, no server is ever left paused.

Hypothesis drives random sequences of: checkpoint; checkpoint failing at a random server and
phase (an injected 500 on one control route, once); restore; restore --resume; resume; resume ID;
abort; abort ID; recover; SIGKILL of a coordinator (checkpoint, restore, restore --resume, resume
or abort in its own process) at a random crash point (`QUIESCE_CRASH_AT` / `..._BEFORE_SEND`);
switching to a fresh ledger (the servers keep every id they retired); and freeing by status (run
every command `quiesce status` prints). Against one real reference cluster (uvicorn servers on
loopback) for the whole test, so later examples meet every id earlier ledgers retired.

After every step (the invariant): each participant that really is held — its fence is not idle
or its data-plane admission is not accepting (read from the server itself) — is named held by
`quiesce status`, with a command that frees it; `status` exits 0 exactly when it says every server
is idle. The step rules assert what must happen: a checkpoint or restore on a cluster that a
finished attempt holds is refused before any request; one on an idle cluster with nothing
unfinished succeeds; the commands `status` prints each exit 0 and leave every server idle.
At the end of each example: `quiesce recover` and `quiesce resume` leave every server idle, and
on every ledger used `replay --verify` passes and `check` finds no violation.

Sized for CI: `QUIESCE_PROPERTY_EXAMPLES` examples (default 12) of up to
`QUIESCE_PROPERTY_STEPS` steps (default 12): 27–145 s in three runs on a shared 2-core machine (each
SIGKILLed coordinator is a new process; how many the draw holds sets the time). A failure is shrunk
to a short sequence, which takes minutes more. `QUIESCE_PROPERTY_VERBOSE=1` (with `-s`) prints
every step.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from quiesce.coordinator.crashpoints import CRASH_AT, CRASH_BEFORE_SEND
from quiesce.coordinator.protocol import CAPABILITIES_PATH
from quiesce.ledger import Ledger, replay_url
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.cli.main import main as cli
from quiesce.tools.gymsim.cluster import IMPORT_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PARTICIPANTS = ("policy_model", "simple_agent", "tools")
#: (server, control route) pairs a failing checkpoint may fail at, in every phase of a save.
FAILURES = [
    ("policy_model", "/model-admission/pause"),
    ("simple_agent", "/agent-checkpoint/prepare"),
    ("tools", "/resources-checkpoint/prepare"),
    ("simple_agent", "/agent-checkpoint/commit"),
    ("policy_model", "/model-checkpoint/commit"),
    ("tools", "/resources-checkpoint/commit"),
    ("tools", "/resources-checkpoint/resume"),
    ("policy_model", "/model-admission/resume"),
    ("simple_agent", "/agent-checkpoint/resume"),
]
CRASHED_COMMANDS = [
    ("checkpoint",),
    ("restore",),
    ("restore", "--resume"),
    ("resume",),
    ("abort",),
]
EXAMPLES = int(os.environ.get("QUIESCE_PROPERTY_EXAMPLES", "12"))
STEPS = int(os.environ.get("QUIESCE_PROPERTY_STEPS", "12"))
VERBOSE = bool(os.environ.get("QUIESCE_PROPERTY_VERBOSE"))


def _cli(*argv: str) -> tuple[int, Any]:
    """The CLI in this process; (exit code, the --json document or None)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(argv))
    text = out.getvalue()
    return code, (json.loads(text) if text.strip() else {"stderr": err.getvalue()})


def test_no_server_is_ever_left_paused(cluster: Any, tmp_path: Path, token: str) -> None:
    http = httpx.Client(trust_env=False, timeout=30)
    counter = itertools.count(1)
    snapshots = tmp_path / "snaps"

    def truth() -> dict[str, tuple[str, str]]:
        out = {}
        for name in PARTICIPANTS:
            url = cluster.urls[name]
            phase = http.get(url + CAPABILITIES_PATH).json()["phase"]
            admission = http.get(f"{url}/gymsim/admin/state").json()["admission_state"]
            out[name] = (phase, admission)
        return out

    def posts() -> int:
        return sum(
            1
            for url in cluster.urls.values()
            for e in http.get(f"{url}/gymsim/admin/control-log").json()
            if e["method"] == "POST"
        )

    class NoServerLeftPaused(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ledgers: list[str] = []
            self.config = Path()
            self.fresh_ledger()

        # -- helpers ---------------------------------------------------------------------------

        def fresh_ledger(self) -> None:
            n = next(counter)
            url = f"sqlite+aiosqlite:///{tmp_path / f'ledger-{n}.db'}"
            self.config = cluster.write_config(tmp_path / f"cluster-{n}.yaml", url, snapshots)
            self.ledgers.append(url)

        def run(self, *argv: str) -> tuple[int, Any]:
            code, doc = _cli(*argv, "--config", str(self.config), "--json")
            if VERBOSE and argv[0] != "status":
                outcome = doc.get("outcome") if isinstance(doc, dict) else None
                print(f"  {' '.join(argv)} -> {code} {outcome or ''}")
            return code, doc

        def status(self) -> tuple[int, dict[str, Any]]:
            code, doc = self.run("status")
            assert code in (0, 1), doc
            return code, doc

        def held_participants(self, doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
            return {s["name"]: s for s in doc["servers"] if s["name"] in PARTICIPANTS and s["held"]}

        def expect_start(self, argv: tuple[str, ...], *, fault: bool = False) -> tuple[int, Any]:
            """Run a checkpoint or restore; check it is refused up front when a finished attempt
            holds a participant, and succeeds on an idle cluster with nothing unfinished."""
            _, before = self.status()
            held = self.held_participants(before)
            sent = posts()
            code, doc = self.run(*argv)
            if argv[0] == "restore" and not (snapshots / "LATEST").exists():
                assert code == 1, doc  # nothing to restore yet
            elif not before["unfinished"] and held:
                assert (code, doc.get("outcome")) == (1, "refused"), doc
                assert posts() == sent, "a refused attempt sent a request"
                assert set(doc["held"]) == set(held)
            elif not before["unfinished"] and not held and not fault:
                assert code == 0, doc
            return code, doc

        # -- rules -----------------------------------------------------------------------------

        @rule()
        def checkpoint(self) -> None:
            self.expect_start(("checkpoint",))

        @rule(failure=st.sampled_from(FAILURES))
        def checkpoint_failing(self, failure: tuple[str, str]) -> None:
            server, path = failure
            url = cluster.urls[server]
            fault = {"kind": "fail", "path": path, "status": 500, "code": "injected", "times": 1}
            http.post(f"{url}/gymsim/admin/faults", json={"faults": [fault]}).raise_for_status()
            try:
                code, doc = self.expect_start(("checkpoint",), fault=True)
            finally:
                http.delete(f"{url}/gymsim/admin/faults").raise_for_status()
            assert code in (0, 1), doc

        @rule()
        def restore(self) -> None:
            self.expect_start(("restore",))

        @rule()
        def restore_and_resume(self) -> None:
            self.expect_start(("restore", "--resume"))

        @rule()
        def resume(self) -> None:
            code, doc = self.run("resume")
            assert code == 0, doc

        @rule()
        def abort(self) -> None:
            code, doc = self.run("abort")
            assert code == 0, doc

        @rule(verb=st.sampled_from(["resume", "abort"]), pick=st.integers(0, 10))
        def by_id(self, verb: str, pick: int) -> None:
            _, doc = self.status()
            ids = [h["checkpoint_id"] for h in doc["holders"]] or self.recorded_ids()
            if not ids:
                return
            code, out = self.run(verb, ids[pick % len(ids)])
            assert code == 0, out

        def recorded_ids(self) -> list[str]:
            async def read() -> list[str]:
                async with Ledger.open(self.ledgers[-1], readonly=True) as ledger:
                    return [r.checkpoint_id for r in await ledger.attempts()]

            try:
                return anyio.run(read)
            except Exception:  # no ledger yet
                return []

        @rule()
        def recover(self) -> None:
            code, doc = self.run("recover")
            assert code == 0, doc
            code, doc = self.run("recover")  # a second recover finds nothing
            assert (code, doc["attempts"]) == (0, []), doc

        @rule(
            command=st.sampled_from(CRASHED_COMMANDS),
            variable=st.sampled_from([CRASH_AT, CRASH_BEFORE_SEND]),
            n=st.integers(1, 40),
        )
        def sigkill(self, command: tuple[str, ...], variable: str, n: int) -> None:
            point = n if variable == CRASH_AT else 1 + n % 8
            env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), variable: str(point)}
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "quiesce.tools.cli.main",
                    *command,
                    "--config",
                    str(self.config),
                    "--json",
                ],
                cwd=str(IMPORT_ROOT),
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode in (-9, 0, 1), done.stderr[-2000:]
            if VERBOSE:
                print(f"  {' '.join(command)} with {variable}={point} -> {done.returncode}")

        @rule()
        def switch_ledger(self) -> None:
            self.fresh_ledger()
            if VERBOSE:
                print("  (a fresh ledger)")

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
            assert all(state == ("idle", "accepting") for state in truth().values()), truth()

        # -- the invariant ---------------------------------------------------------------------

        @invariant()
        def status_names_whatever_holds_a_server(self) -> None:
            code, doc = self.status()
            servers = {s["name"]: s for s in doc["servers"]}
            for name, (phase, admission) in truth().items():
                if phase != "idle" or admission != "accepting":
                    assert servers[name]["held"], (name, phase, admission, doc)
                    assert servers[name]["frees"], (name, doc)
            assert (code == 0) == doc["idle"]

        def teardown(self) -> None:
            if VERBOSE:
                print(f"  (end of example; {len(self.ledgers)} ledgers)")
            code, doc = self.run("recover")
            assert code == 0, doc
            code, doc = self.run("resume")
            assert code == 0, doc
            assert all(state == ("idle", "accepting") for state in truth().values()), truth()
            for url in self.ledgers:
                if not Path(url.removeprefix("sqlite+aiosqlite:///")).exists():
                    continue
                replayed = anyio.run(replay_url, url)
                assert replayed.ok, (url, replayed.problem, replayed.differences[:3])
                report = anyio.run(check_ledger, url)
                assert report.violations == [], (url, report.violations)

    run: Callable[..., None] = run_state_machine_as_test  # untyped in hypothesis
    try:
        run(
            NoServerLeftPaused,
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
