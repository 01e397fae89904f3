"""The crash matrix: kill the coordinator at every instant of a save and of each restore, then recover.

    python -m quiesce.tools.crashmatrix [--ledger sqlite|postgres] [--plane v1|v2|both] [--cycle CYCLE]
                                        [--sample K] [--sample-v2 K]

`--plane v2` runs the same method on Gym's unified plane (`crashmatrix_v2.py`: cycles save, stop,
restore, restore-resume); `both` runs v1, then v2 (a ledger of its own). What follows is v1's.

CYCLE is `save`, `restore`, `restore-resume`, `restore-checkpoint`, `both` (save and restore) or
`all`. For every *append point* (`QUIESCE_CRASH_AT=n`: SIGKILL right after the coordinator's n-th
committed append) and every *send point* (`QUIESCE_CRASH_BEFORE_SEND=n`: SIGKILL right before its
n-th POST request leaves; a read's record is committed after it) of one full cycle — the counts
come from an uncrashed dry run — against the reference Gym cluster with rollouts running:

1. the cycle's command runs in a child process with the crash variable set, and dies there:
   - `save`: `quiesce checkpoint`;
   - `restore`: `quiesce restore` into a fresh cluster (the servers stay paused for the caller);
   - `restore-resume`: `quiesce restore --resume` into a fresh cluster — through its resume
     phase: the restore is not finished until its resume is;
   - `restore-checkpoint`: the sequence that once left servers paused for good — a plain
     `quiesce restore`, then `quiesce checkpoint` — crashed at every point of either command;
2. `quiesce recover --json` runs in another child (its wall time is the point's recovery time),
   then a second `quiesce recover`, which must make no call and append only
   `coordinator.started`, `recovery.started`, `recovery.completed`;
3. the invariants are checked: every server idle and accepting (`restore` points: restored and
   paused after recovery — the restore is re-run if it never started — then resumed with
   `quiesce resume`; `restore-resume` points: resumed by recovery itself, or the command re-run
   if it never started; `restore-checkpoint` points: a checkpoint is refused before any request
   while the restore holds the servers, every command `quiesce status` then prints frees them,
   and a checkpoint succeeds); no snapshot folder without a complete manifest and no staging
   left; `LATEST` names a snapshot that verifies; the previous snapshot still verifies; the
   ledger's hash chain and projections verify (replay) and the audit's protocol check passes; the
   rollouts finish with exactly the results of an uninterrupted run, no turn lost or run twice —
   and their results are acknowledged (`quiesce acknowledge`), as a trainer does, before the
   cluster serves the next point (Gym holds a finished result until then, and a checkpoint could
   not prepare).

Prints one row per point (point, last event before death, recovery action, recovery time,
invariants), then the recovery time median and p95 per cycle; exits 1 if any invariant failed.
`--sample K` runs every K-th point only.

Speed: this process imports everything once and *forks* each child (the coordinator commands,
each reference cluster, each ledger check), so a point costs its real work, not interpreter
start-up; the save cycle reuses one long-lived cluster (new rollout ids per point). This process
itself never starts a thread or an event loop, so forking it is safe. Linux/macOS only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from quiesce.coordinator.crashpoints import CRASH_AT, CRASH_BEFORE_SEND, is_send_point
from quiesce.coordinator.protocol import (
    AGENT,
    CAPABILITIES_PATH,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    TOKEN_ENV_FALLBACK,
)
from quiesce.coordinator.publish import LATEST, load_snapshot, read_latest, verify_snapshot
from quiesce.tools.cli.main import main as cli_main
from quiesce.tools.gymsim.cluster import cluster_config, write_yaml_atomic
from quiesce.tools.gymsim.host import Host
from quiesce.tools.gymsim.spec import ClusterSpec, default_spec

TURNS = 20
#: Per-call latency of the policy model and the resources server while a checkpoint is taken: the
#: rollouts' remaining turns (≥ 19 × 2 × this, about 4 s) outlast the start of a (forked)
#: checkpoint until its pause, also on a loaded machine — a finished rollout is held until
#: acknowledged, and a prepare refused only for such results fails at once.
LATENCY_S = 0.1
ROLLOUTS_PER_POINT = 3
PARTICIPANTS = {"policy_model": MODEL, "simple_agent": AGENT, "tools": RESOURCES}
PAUSED_BY_RESTORE = ("policy_model", "simple_agent", "tools")
CYCLES = ("save", "restore", "restore-resume", "restore-checkpoint")


# ---------------------------------------------------------------------------------------------
# Forked children
# ---------------------------------------------------------------------------------------------


def _in_child(fn: Callable[[], Any], *, env: dict[str, str] | None = None, log: Path | None = None) -> Any:
    """Run `fn` in a forked child; return its JSON-able result (or raise its error text)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        code = 0
        try:
            if env:
                os.environ.update(env)
            if log is not None:
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
            payload: dict[str, Any] = {"ok": True, "value": fn()}
        except BaseException:
            payload, code = {"ok": False, "error": traceback.format_exc()}, 1
        data = json.dumps(payload, default=str).encode()
        with contextlib.suppress(OSError):
            os.write(write_fd, data)
        os._exit(code)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 1 << 16):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b'{"ok": false, "error": "the child died"}')
    if not result["ok"]:
        raise RuntimeError(result["error"])
    return result["value"]


@dataclass
class Run:
    """One forked `quiesce ...` command: exit status, whether SIGKILL ended it, stdout, wall time."""

    code: int | None
    killed: bool
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.stdout) if self.stdout.strip() else None


def quiesce(
    argv: list[str], folder: Path, env: dict[str, str] | None = None, setup: Callable[[], None] | None = None
) -> Run:
    """Run the `quiesce` CLI with `argv` in a forked child (stdout/stderr captured to files);
    `setup` runs in the child first."""
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code: int | None = 1
        try:
            for name in (CRASH_AT, CRASH_BEFORE_SEND):
                os.environ.pop(name, None)
            os.environ.update(env or {})
            fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
            if setup is not None:
                setup()
            code = cli_main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - started
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    return Run(code, killed, out.read_text(errors="replace"), err.read_text(errors="replace"), seconds)


class ForkedCluster:
    """A reference Gym cluster served by a forked child (sockets bound here, so URLs are known)."""

    def __init__(
        self, spec: ClusterSpec, token: str, *, probe: str = CAPABILITIES_PATH, log: Path | None = None
    ) -> None:
        host = Host(spec, token=token)
        self.spec = spec
        self.urls = dict(host.urls)
        self.log = log
        pid = os.fork()
        if pid == 0:
            import asyncio

            code = 0
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                if log is None:
                    os.dup2(devnull, 2)
                else:  # the servers' own errors (an unhandled exception's traceback), for a failed point
                    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
                asyncio.run(host.serve())
            except BaseException:
                code = 1
            os._exit(code)
        self.pid = pid
        for sock, _ in host._sockets:
            sock.close()
        give_up = time.monotonic() + 30
        with httpx.Client(trust_env=False, timeout=2) as http:
            for url in self.urls.values():
                while True:
                    try:
                        if http.get(url + probe).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > give_up:
                        raise RuntimeError("the forked reference cluster did not start")
                    time.sleep(0.01)

    def config(self, ledger: str, snapshots: Path, **overrides: Any) -> dict[str, Any]:
        return cluster_config(self.spec, self.urls, ledger_url=ledger, snapshots_dir=snapshots, **overrides)

    def errors(self) -> str:
        """The last lines the servers wrote to their log ('' without a log or when they wrote none)."""
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-12:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


@contextlib.contextmanager
def forked_cluster(spec: ClusterSpec, token: str) -> Iterator[ForkedCluster]:
    cluster = ForkedCluster(spec, token)
    try:
        yield cluster
    finally:
        cluster.kill()


# ---------------------------------------------------------------------------------------------
# Rollouts and server state (synchronous httpx: no threads in this process)
# ---------------------------------------------------------------------------------------------


def start_rollouts(http: httpx.Client, agent: str, ids: list[str]) -> None:
    for rollout_id in ids:
        while True:
            reply = http.post(f"{agent}/run", json={"rollout_id": rollout_id, "turns": TURNS})
            if reply.status_code == 409:
                time.sleep(0.05)
                continue
            reply.raise_for_status()
            break


def rollouts(http: httpx.Client, agent: str) -> dict[str, dict[str, Any]]:
    reply = http.get(f"{agent}/rollouts")
    reply.raise_for_status()
    return {r["rollout_id"]: r for r in reply.json()["rollouts"]}


def wait_rollouts(
    http: httpx.Client, agent: str, ids: list[str], *, min_turns: int | None = None, timeout_s: float = 60
) -> dict[str, dict[str, Any]]:
    """Wait until every rollout of `ids` finished (or ran `min_turns` turns). Waiting for them to
    finish, it does the trainer's part after a restore: a restored continuation runs only once its
    `/run` is sent again, as the attempt the restore lists (`send_again`)."""
    give_up = time.monotonic() + timeout_s
    while True:
        seen = {k: v for k, v in rollouts(http, agent).items() if k in ids}
        if min_turns is None:
            send_again(http, agent, [v for v in seen.values() if v["status"] == "restored"])
        if len(seen) == len(ids):
            if min_turns is None and all(r["status"] in ("completed", "failed") for r in seen.values()):
                return seen
            if min_turns is not None and all(r["turns_done"] >= min_turns for r in seen.values()):
                return seen
        if time.monotonic() > give_up:
            raise TimeoutError(f"rollouts did not get there: {[(k, v['status']) for k, v in seen.items()]}")
        time.sleep(0.02)


def send_again(http: httpx.Client, agent: str, waiting: list[dict[str, Any]]) -> None:
    """`/run` for each restored continuation waiting on `agent` (its view: status `restored`), as
    its own attempt and turns; one whose agent is still paused (409) is sent on the next poll."""
    for view in waiting:
        body = {
            "rollout_id": view["rollout_id"],
            "turns": view["turns"],
            "attempt_index": view["attempt_index"],
        }
        reply = http.post(f"{agent}/run", json=body)
        if reply.status_code != 409:
            reply.raise_for_status()


def turn_problems(seen: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for rid, rollout in sorted(seen.items()):
        turns = [entry["turn"] for entry in rollout["turn_log"]]
        if turns != list(range(1, rollout["turns_done"] + 1)):
            problems.append(f"{rid}: turns ran {turns}")
    return problems


def states(http: httpx.Client, urls: dict[str, str]) -> dict[str, tuple[str, str]]:
    out = {}
    for name, url in urls.items():
        caps = http.get(url + CAPABILITIES_PATH).json()
        admin = http.get(f"{url}/gymsim/admin/state").json()
        out[name] = (caps["phase"], admin["admission_state"])
    return out


def control_log_sizes(http: httpx.Client, urls: dict[str, str]) -> dict[str, int]:
    return {name: len(http.get(f"{url}/gymsim/admin/control-log").json()) for name, url in urls.items()}


def post_count(http: httpx.Client, urls: dict[str, str]) -> int:
    """Control POSTs the servers received so far (requests that may change them)."""
    return sum(
        1
        for url in urls.values()
        for e in http.get(f"{url}/gymsim/admin/control-log").json()
        if e["method"] == "POST"
    )


# ---------------------------------------------------------------------------------------------
# Ledger and snapshot checks (ledger reads run in forked children)
# ---------------------------------------------------------------------------------------------


def ledger_tail(url: str, after: int) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]]:
        import anyio

        from quiesce.ledger import Ledger

        async def run() -> list[dict[str, Any]]:
            async with Ledger.open(url, readonly=True) as ledger:
                return [
                    {
                        "seq": e.seq,
                        "kind": e.kind,
                        "epoch": e.epoch,
                        "server": e.server,
                        "checkpoint_id": e.checkpoint_id,
                        "data": e.data,
                    }
                    async for e in ledger.read(after=after)
                ]

        return anyio.run(run)

    value: list[dict[str, Any]] = _in_child(read)
    return value


def ledger_problems(url: str) -> list[str]:
    def check() -> list[str]:
        import anyio

        from quiesce.ledger import replay_url
        from quiesce.tools.audit.cli import check_ledger

        async def run() -> list[str]:
            problems = []
            report = await replay_url(url)
            if not report.ok:
                problems.append(f"replay verify: {report.problem or report.differences[:3]}")
            audit = await check_ledger(url)
            # the rollout lineage judges the trainer, and the matrix has none: each scenario
            # starts rollouts of its own and leaves them (a restore's continuations never run
            # on), which the lineage rightly calls lost. The lineage tests judge it instead.
            judged = [v for v in audit.violations if not v.rule.startswith("lineage-")]
            problems += [f"audit {v.rule} seq {v.seq}: {v.message}" for v in judged[:3]]
            return problems

        return anyio.run(run)

    value: list[str] = _in_child(check)
    return value


def snapshot_problems(snapshots: Path, previous: Path | None) -> list[str]:
    problems: list[str] = []
    if snapshots.is_dir():
        for child in sorted(snapshots.iterdir()):
            if child.is_dir() and not child.name.startswith("."):
                try:
                    load_snapshot(child)
                except Exception as error:
                    problems.append(f"{child.name}: {error}")
    staging = snapshots / ".staging"
    if staging.is_dir() and any(staging.iterdir()):
        problems.append(f"staging left: {sorted(p.name for p in staging.iterdir())}")
    latest = read_latest(snapshots)
    if (snapshots / LATEST).exists() and latest is None:
        problems.append("LATEST names no folder")
    for label, path in (("LATEST", latest), ("previous", previous)):
        if path is None:
            continue
        if label == "previous" and not path.exists():
            problems.append(f"previous snapshot {path.name} is gone")
            continue
        try:
            verify_snapshot(path, participants=PARTICIPANTS)
        except Exception as error:
            problems.append(f"{label} {path.name}: {error}")
    return problems


# ---------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------


@dataclass
class Point:
    cycle: str
    variable: str
    n: int
    last_event: str = ""
    action: str = ""
    recover_s: float | None = None
    problems: list[str] = field(default_factory=list)
    step: str = ""  # restore-checkpoint: the command crashed (restore, checkpoint)

    @property
    def name(self) -> str:
        where = f"{self.step[0]}:" if self.step else ""
        return f"{where}{'append' if self.variable == CRASH_AT else 'send'} {self.n}"


def _describe(event: dict[str, Any] | None) -> str:
    if event is None:
        return "(nothing)"
    bits = [event["kind"]]
    if event.get("server"):
        bits.append(str(event["server"]))
    phase = event["data"].get("phase")
    if phase:
        bits.append(str(phase))
    return " ".join(bits)


class Matrix:
    def __init__(self, folder: Path, ledger: str, sample: int, out: Callable[[str], None]) -> None:
        self.folder = folder
        self.ledger = ledger
        self.sample = sample
        self.out = out
        self.token = "crashmatrix-" + secrets.token_hex(8)
        os.environ[TOKEN_ENV] = self.token
        os.environ.pop(TOKEN_ENV_FALLBACK, None)
        self.spec = default_spec()
        self.http = httpx.Client(trust_env=False, timeout=30)
        self.points: list[Point] = []
        self.expected: dict[str, Any] = {}
        self._workdir = folder / "runs"
        self._workdir.mkdir(parents=True, exist_ok=True)

    def _head(self) -> int:
        tail = ledger_tail(self.ledger, 0)
        return tail[-1]["seq"] if tail else 0

    def reference(self, ids: list[str]) -> None:
        """The results of `ids` run uninterrupted (results depend only on rollout id and turns)."""
        with forked_cluster(self.spec, self.token) as cluster:
            agent = cluster.urls["simple_agent"]
            start_rollouts(self.http, agent, ids)
            seen = wait_rollouts(self.http, agent, ids, timeout_s=300)
        self.expected.update({rid: seen[rid]["result"] for rid in ids})

    def _set_latency(self, cluster: ForkedCluster, latency: float) -> None:
        for name in ("policy_model", "tools"):
            self.http.post(f"{cluster.urls[name]}/gymsim/admin/options", json={"latency_s": latency})

    def _count(self, after: int) -> tuple[int, int]:
        events = ledger_tail(self.ledger, after)
        started = next(i for i, e in enumerate(events) if e["kind"] == "coordinator.started")
        epoch = events[started]["epoch"]
        mine = [e for e in events[started:] if e["epoch"] == epoch]
        return len(mine), sum(is_send_point(e["kind"], e["data"]) for e in mine)

    def _second_recover(self, config: Path, urls: dict[str, str], folder: Path) -> list[str]:
        head = self._head()
        calls = control_log_sizes(self.http, urls)
        run = quiesce(["recover", "--config", str(config), "--json"], folder)
        problems = []
        if run.code != 0 or (run.json() or {}).get("attempts") != []:
            problems.append(f"second recover did something: exit {run.code} {run.stdout[:200]}")
        added = [e["kind"] for e in ledger_tail(self.ledger, head)]
        if added != ["coordinator.started", "recovery.started", "recovery.completed"]:
            problems.append(f"second recover appended {added}")
        if control_log_sizes(self.http, urls) != calls:
            problems.append("second recover made calls")
        return problems

    # -- save -----------------------------------------------------------------------------------

    def save_cycle(self) -> None:
        snapshots = self.folder / "save-snapshots"
        with forked_cluster(self.spec, self.token) as cluster:
            config = write_yaml_atomic(self.folder / "save.yaml", cluster.config(self.ledger, snapshots))
            agent = cluster.urls["simple_agent"]
            self._set_latency(cluster, LATENCY_S)
            first = quiesce(["checkpoint", "--config", str(config), "--json"], self._workdir)
            if first.code != 0:
                raise RuntimeError(f"the first checkpoint failed: {first.stderr}")
            head = self._head()
            ids = self._ids("dry")
            start_rollouts(self.http, agent, ids)
            wait_rollouts(self.http, agent, ids, min_turns=1)
            dry = quiesce(["checkpoint", "--config", str(config), "--json"], self._workdir)
            if dry.code != 0:
                raise RuntimeError(f"the dry-run checkpoint failed: {dry.stderr}")
            appends, sends = self._count(head)
            wait_rollouts(self.http, agent, ids)
            problems = self._acknowledge(config, agent, ids)
            if problems:
                raise RuntimeError(f"acknowledging the dry run's results failed: {problems}")
            self.out(f"save cycle: {appends} append points, {sends} send points")
            plan = [(CRASH_AT, n) for n in range(1, appends + 1)] + [
                (CRASH_BEFORE_SEND, n) for n in range(1, sends + 1)
            ]
            plan = [step for index, step in enumerate(plan) if index % self.sample == 0]
            self.reference([rid for variable, n in plan for rid in self._point_ids(variable, n)])
            for variable, n in plan:
                point = Point("save", variable, n)
                self.points.append(point)
                try:
                    self._save_point(point, cluster, config, snapshots)
                except Exception as error:
                    point.problems.append(f"harness: {type(error).__name__}: {error}")
                self._row(point)

    def _ids(self, tag: str) -> list[str]:
        ids = [f"{tag}-r{i}" for i in range(ROLLOUTS_PER_POINT)]
        missing = [rid for rid in ids if rid not in self.expected]
        if missing:
            self.reference(missing)
        return ids

    @staticmethod
    def _point_ids(variable: str, n: int) -> list[str]:
        tag = "a" if variable == CRASH_AT else "s"
        return [f"p{tag}{n}-r{i}" for i in range(ROLLOUTS_PER_POINT)]

    def _save_point(self, point: Point, cluster: ForkedCluster, config: Path, snapshots: Path) -> None:
        agent = cluster.urls["simple_agent"]
        ids = self._point_ids(point.variable, point.n)
        previous = read_latest(snapshots)
        head = self._head()
        start_rollouts(self.http, agent, ids)
        wait_rollouts(self.http, agent, ids, min_turns=1)
        crashed = quiesce(
            ["checkpoint", "--config", str(config), "--json"], self._workdir, {point.variable: str(point.n)}
        )
        tail = ledger_tail(self.ledger, head)
        point.last_event = _describe(tail[-1] if tail else None)
        if not crashed.killed:
            point.last_event = f"(not reached: exit {crashed.code}) " + point.last_event
        self._recover(point, config, cluster.urls)
        bad = {n: s for n, s in states(self.http, cluster.urls).items() if s != ("idle", "accepting")}
        if bad:
            point.problems.append(f"not accepting: {bad}")
        point.problems += snapshot_problems(snapshots, previous)
        point.problems += self._second_recover(config, cluster.urls, self._workdir)
        self._check_rollouts(point, agent, ids)
        # the cluster serves the next point: its finished results are consumed, as a trainer does
        point.problems += self._acknowledge(config, agent, ids)
        point.problems += ledger_problems(self.ledger)

    def _acknowledge(self, config: Path, agent: str, ids: list[str]) -> list[str]:
        """`quiesce acknowledge` every finished result of `ids`: the agent holds each until then."""
        seen = rollouts(self.http, agent)
        done = [f"{rid}:{seen[rid]['attempt_index']}" for rid in ids if seen[rid]["status"] == "completed"]
        if not done:
            return []
        run = quiesce(
            ["acknowledge", "--config", str(config), "simple_agent", *done, "--json"], self._workdir
        )
        return [] if run.code == 0 else [f"acknowledge exit {run.code}: {run.stderr.strip()[-300:]}"]

    def _recover(self, point: Point, config: Path, urls: dict[str, str]) -> None:
        run = quiesce(["recover", "--config", str(config), "--json"], self._workdir)
        point.recover_s = run.seconds
        document = run.json() or {}
        actions = [a["action"] for a in document.get("attempts", [])]
        point.action = ",".join(actions) or "none"
        if run.code != 0:
            point.problems.append(f"recover exit {run.code}: {run.stderr.strip()[-300:]}")

    def _check_rollouts(self, point: Point, agent: str, ids: list[str]) -> None:
        seen = wait_rollouts(self.http, agent, ids)
        got = {rid: seen[rid]["result"] for rid in ids}
        if got != {rid: self.expected[rid] for rid in ids}:
            point.problems.append("rollout results differ from the uninterrupted run")
        point.problems += turn_problems(seen)

    # -- restore --------------------------------------------------------------------------------

    def _source(self) -> tuple[Path, Path, list[str]]:
        """The snapshot every restore cycle restores (made once, mid-rollout): its snapshots
        folder, the snapshot, and the ids of the rollouts it holds."""
        snapshots = self.folder / "restore-snapshots"
        source_ids = self._ids("src")
        snapshot = read_latest(snapshots)
        if snapshot is not None:
            return snapshots, snapshot, source_ids
        with forked_cluster(self.spec, self.token) as source:
            config = write_yaml_atomic(self.folder / "source.yaml", source.config(self.ledger, snapshots))
            self._set_latency(source, LATENCY_S)
            start_rollouts(self.http, source.urls["simple_agent"], source_ids)
            wait_rollouts(self.http, source.urls["simple_agent"], source_ids, min_turns=2)
            made = quiesce(["checkpoint", "--config", str(config), "--json"], self._workdir)
            if made.code != 0:
                raise RuntimeError(f"the source checkpoint failed: {made.stderr}")
        snapshot = read_latest(snapshots)
        assert snapshot is not None
        return snapshots, snapshot, source_ids

    def _plan(self, appends: int, sends: int) -> list[tuple[str, int]]:
        plan = [(CRASH_AT, n) for n in range(1, appends + 1)] + [
            (CRASH_BEFORE_SEND, n) for n in range(1, sends + 1)
        ]
        return [step for index, step in enumerate(plan) if index % self.sample == 0]

    def restore_cycle(self) -> None:
        snapshots, snapshot, source_ids = self._source()
        head = self._head()
        with forked_cluster(self.spec, self.token) as fresh:
            config = write_yaml_atomic(self.folder / "restore.yaml", fresh.config(self.ledger, snapshots))
            dry = quiesce(["restore", "--config", str(config), "--json"], self._workdir)
            if dry.code != 0:
                raise RuntimeError(f"the dry-run restore failed: {dry.stderr}")
            appends, sends = self._count(head)
            quiesce(["resume", "--config", str(config), "--json"], self._workdir)
            wait_rollouts(self.http, fresh.urls["simple_agent"], source_ids)
        self.out(f"restore cycle: {appends} append points, {sends} send points")
        plan = [(CRASH_AT, n) for n in range(1, appends + 1)] + [
            (CRASH_BEFORE_SEND, n) for n in range(1, sends + 1)
        ]
        plan = [step for index, step in enumerate(plan) if index % self.sample == 0]
        for variable, n in plan:
            point = Point("restore", variable, n)
            self.points.append(point)
            try:
                with forked_cluster(self.spec, self.token) as fresh:
                    self._restore_point(point, fresh, snapshots, snapshot, source_ids)
            except Exception as error:
                point.problems.append(f"harness: {type(error).__name__}: {error}")
            self._row(point)

    def _restore_point(
        self, point: Point, fresh: ForkedCluster, snapshots: Path, snapshot: Path, ids: list[str]
    ) -> None:
        config = write_yaml_atomic(self.folder / "restore.yaml", fresh.config(self.ledger, snapshots))
        head = self._head()
        crashed = quiesce(
            ["restore", "--config", str(config), "--json"], self._workdir, {point.variable: str(point.n)}
        )
        tail = ledger_tail(self.ledger, head)
        point.last_event = _describe(tail[-1] if tail else None)
        if not crashed.killed:
            point.last_event = f"(not reached: exit {crashed.code}) " + point.last_event
        self._recover(point, config, fresh.urls)
        now = states(self.http, fresh.urls)
        if all(now[name][0] == "idle" for name in PAUSED_BY_RESTORE):
            # the restore never started (death before attempt.started): the operator runs it again
            again = quiesce(["restore", "--config", str(config), "--json"], self._workdir)
            if again.code != 0:
                point.problems.append(f"restore again failed: {again.stderr.strip()[-300:]}")
            now = states(self.http, fresh.urls)
        wrong = {n: now[n] for n in PAUSED_BY_RESTORE if now[n][0] != "restored_paused"}
        if wrong:
            point.problems.append(f"not restored and paused after recovery: {wrong}")
        point.problems += self._second_recover(config, fresh.urls, self._workdir)
        resumed = quiesce(["resume", "--config", str(config), "--json"], self._workdir)
        if resumed.code != 0:
            point.problems.append(f"resume failed: {resumed.stderr.strip()[-300:]}")
        bad = {n: s for n, s in states(self.http, fresh.urls).items() if s != ("idle", "accepting")}
        if bad:
            point.problems.append(f"not accepting after resume: {bad}")
        point.problems += snapshot_problems(snapshots, snapshot)
        self._check_rollouts(point, fresh.urls["simple_agent"], ids)
        point.problems += ledger_problems(self.ledger)

    # -- restore --resume -------------------------------------------------------------------------

    def restore_resume_cycle(self) -> None:
        snapshots, snapshot, source_ids = self._source()
        head = self._head()
        command = ["restore", "--snapshot", str(snapshot), "--resume", "--json"]
        with forked_cluster(self.spec, self.token) as fresh:
            config = write_yaml_atomic(self.folder / "restore.yaml", fresh.config(self.ledger, snapshots))
            dry = quiesce([*command, "--config", str(config)], self._workdir)
            if dry.code != 0:
                raise RuntimeError(f"the dry-run restore --resume failed: {dry.stderr}")
            appends, sends = self._count(head)
            wait_rollouts(self.http, fresh.urls["simple_agent"], source_ids)
        self.out(f"restore-resume cycle: {appends} append points, {sends} send points")
        for variable, n in self._plan(appends, sends):
            point = Point("restore-resume", variable, n)
            self.points.append(point)
            try:
                with forked_cluster(self.spec, self.token) as fresh:
                    config = write_yaml_atomic(
                        self.folder / "restore.yaml", fresh.config(self.ledger, snapshots)
                    )
                    head = self._head()
                    crashed = quiesce([*command, "--config", str(config)], self._workdir, {variable: str(n)})
                    tail = self._crashed(point, crashed, head)
                    self._recover(point, config, fresh.urls)
                    if not any(e["kind"] == "attempt.started" for e in tail):
                        # it died before the restore started: the operator runs it again
                        again = quiesce([*command, "--config", str(config)], self._workdir)
                        if again.code != 0:
                            point.problems.append(
                                f"restore --resume again failed: {again.stderr.strip()[-300:]}"
                            )
                    self._all_accepting(point, fresh, "after recovery (the restore asked for its resume)")
                    point.problems += self._second_recover(config, fresh.urls, self._workdir)
                    point.problems += snapshot_problems(snapshots, snapshot)
                    self._check_rollouts(point, fresh.urls["simple_agent"], source_ids)
                    point.problems += ledger_problems(self.ledger)
            except Exception as error:
                point.problems.append(f"harness: {type(error).__name__}: {error}")
            self._row(point)

    # -- restore, then checkpoint ---------------------------------------------------------------

    def restore_checkpoint_cycle(self) -> None:
        _, snapshot, source_ids = self._source()
        restore = ["restore", "--snapshot", str(snapshot), "--json"]
        checkpoint = ["checkpoint", "--json"]
        with forked_cluster(self.spec, self.token) as fresh:
            config = write_yaml_atomic(
                self.folder / "rc.yaml", fresh.config(self.ledger, self.folder / "rc-dry")
            )
            head = self._head()
            if quiesce([*restore, "--config", str(config)], self._workdir).code != 0:
                raise RuntimeError("the dry-run restore failed")
            restore_points = self._count(head)
            head = self._head()
            refused = quiesce([*checkpoint, "--config", str(config)], self._workdir)
            if (refused.code, (refused.json() or {}).get("outcome")) != (1, "refused"):
                raise RuntimeError(
                    f"the dry-run checkpoint after a restore was not refused: {refused.stdout}"
                )
            checkpoint_points = self._count(head)
        self.out(
            f"restore-checkpoint cycle: restore {restore_points[0]} append, {restore_points[1]} send points;"
            f" checkpoint {checkpoint_points[0]} append, {checkpoint_points[1]} send points"
        )
        plan = [("restore", v, n) for v, n in self._plan(*restore_points)]
        plan += [("checkpoint", v, n) for v, n in self._plan(*checkpoint_points)]
        for step, variable, n in plan:
            point = Point("restore-checkpoint", variable, n, step=step)
            self.points.append(point)
            try:
                with forked_cluster(self.spec, self.token) as fresh:
                    self._restore_checkpoint_point(point, fresh, snapshot, source_ids, restore, checkpoint)
            except Exception as error:
                point.problems.append(f"harness: {type(error).__name__}: {error}")
            self._row(point)

    def _restore_checkpoint_point(
        self,
        point: Point,
        fresh: ForkedCluster,
        snapshot: Path,
        ids: list[str],
        restore: list[str],
        checkpoint: list[str],
    ) -> None:
        snapshots = self.folder / f"rc-{point.step}-{point.name.replace(' ', '-').replace(':', '')}"
        config = write_yaml_atomic(self.folder / "rc.yaml", fresh.config(self.ledger, snapshots))
        urls = fresh.urls
        if (
            point.step == "checkpoint"
            and quiesce([*restore, "--config", str(config)], self._workdir).code != 0
        ):
            raise RuntimeError("the restore before the checkpoint failed")
        head = self._head()
        command = restore if point.step == "restore" else checkpoint
        crashed = quiesce([*command, "--config", str(config)], self._workdir, {point.variable: str(point.n)})
        tail = self._crashed(point, crashed, head)
        self._recover(point, config, urls)
        point.problems += self._second_recover(config, urls, self._workdir)
        restored = point.step == "checkpoint" or any(e["kind"] == "attempt.started" for e in tail)
        # the sequence goes on: the checkpoint, refused before any request while the restore holds
        # the servers; `quiesce status` names what frees them; then the checkpoint succeeds
        held = {n: s for n, s in states(self.http, urls).items() if s != ("idle", "accepting")}
        posts = post_count(self.http, urls)
        again = quiesce([*checkpoint, "--config", str(config)], self._workdir)
        if held and again.code == 0:  # it cannot have succeeded while the restore held them
            point.problems.append(f"checkpoint on held servers {held} was not refused")
        elif held:
            if (again.code, (again.json() or {}).get("outcome")) != (1, "refused"):
                point.problems.append(f"checkpoint on held servers {held} not refused: {again.stdout[:200]}")
            if post_count(self.http, urls) != posts:
                point.problems.append("the refused checkpoint sent a request")
            status = quiesce(["status", "--config", str(config), "--json"], self._workdir)
            document = status.json() or {}
            named = {s["name"] for s in document.get("servers", []) if s.get("held") and s.get("frees")}
            if not set(held) <= named:
                point.problems.append(f"status does not name what frees {sorted(set(held) - named)}")
            for holder in document.get("holders", []):
                argv = shlex.split(holder["frees"])[1:]
                freed = quiesce([*argv, "--json"], self._workdir)
                if freed.code != 0:
                    point.problems.append(f"`{holder['frees']}` failed: {freed.stderr.strip()[-300:]}")
            self._all_accepting(point, fresh, "after the commands status named")
            # the restored rollouts run on; their results are consumed (acknowledged), as a trainer
            # does, so the agent can prepare, then the checkpoint the sequence was after is taken
            wait_rollouts(self.http, urls["simple_agent"], ids)
            point.problems += self._acknowledge(config, urls["simple_agent"], ids)
            again = quiesce([*checkpoint, "--config", str(config)], self._workdir)
        if again.code != 0:
            point.problems.append(f"checkpoint failed: {again.stderr.strip()[-300:]}")
        if not restored:  # it died before the restore started: run the rest of the sequence
            redo = quiesce([*restore, "--resume", "--config", str(config)], self._workdir)
            if redo.code != 0:
                point.problems.append(f"restore --resume again failed: {redo.stderr.strip()[-300:]}")
        self._all_accepting(point, fresh, "at the end")
        point.problems += snapshot_problems(snapshots, None)
        point.problems += snapshot_problems(snapshot.parent, snapshot)
        self._check_rollouts(point, urls["simple_agent"], ids)
        point.problems += ledger_problems(self.ledger)

    def _crashed(self, point: Point, crashed: Run, head: int) -> list[dict[str, Any]]:
        """The events the crashed command left; notes the last one (and whether it died at all)."""
        tail = ledger_tail(self.ledger, head)
        point.last_event = _describe(tail[-1] if tail else None)
        if not crashed.killed:
            point.last_event = f"(not reached: exit {crashed.code}) " + point.last_event
        return tail

    def _all_accepting(self, point: Point, cluster: ForkedCluster, when: str) -> None:
        bad = {n: s for n, s in states(self.http, cluster.urls).items() if s != ("idle", "accepting")}
        if bad:
            point.problems.append(f"not accepting {when}: {bad}")

    # -- output ---------------------------------------------------------------------------------

    def _row(self, point: Point) -> None:
        took = f"{point.recover_s:6.2f}s" if point.recover_s is not None else "      -"
        verdict = "ok" if not point.problems else "FAIL: " + "; ".join(point.problems)
        self.out(
            f"{point.cycle:<18} {point.name:<12} {point.last_event[:52]:<52} {point.action:<10}"
            f" {took}  {verdict}"
        )

    def summary(self) -> bool:
        return self.summarize(CYCLES)

    def summarize(self, cycles: tuple[str, ...]) -> bool:
        """One line per cycle (points, failures, recovery time median and p95); whether all held."""
        ok = True
        for cycle in cycles:
            mine = [p for p in self.points if p.cycle == cycle]
            if not mine:
                continue
            times = sorted(p.recover_s for p in mine if p.recover_s is not None)
            failed = [p for p in mine if p.problems]
            ok = ok and not failed
            median = statistics.median(times) if times else 0.0
            p95 = times[min(len(times) - 1, max(0, round(0.95 * len(times)) - 1))] if times else 0.0
            appends = sum(p.variable == CRASH_AT for p in mine)
            self.out(
                f"{cycle}: {len(mine)} points ({appends} append, {len(mine) - appends} send),"
                f" {len(failed)} failed; recovery time median {median:.2f}s, p95 {p95:.2f}s"
            )
        return ok


def _ledger_url(kind: str, folder: Path, stack: contextlib.ExitStack) -> str:
    if kind == "sqlite":
        return f"sqlite+aiosqlite:///{folder / 'ledger.db'}"
    from quiesce.tools.pgtemp import TempPostgres

    cluster = stack.enter_context(TempPostgres(fsync=False))
    return cluster.create_database("crashmatrix")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m quiesce.tools.crashmatrix", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ledger", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument(
        "--plane",
        choices=("v1", "v2", "both"),
        default="v1",
        help="v1 (the seed-era routes), v2 (Gym's unified plane: tools/crashmatrix_v2.py), or both",
    )
    parser.add_argument(
        "--cycle",
        choices=(*CYCLES, "stop", "both", "all"),
        default="both",
        help="v1: save, restore, restore-resume, restore-checkpoint; v2: save, stop, restore,"
        " restore-resume; both: save and restore; all: every cycle of the plane",
    )
    parser.add_argument("--sample", type=int, default=1, metavar="K", help="run every K-th point only")
    parser.add_argument(
        "--sample-v2", type=int, default=None, metavar="K", help="v2's every K-th point (default: --sample)"
    )
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temp folder)")
    parser.add_argument(
        "--ledger-url", metavar="URL", help="use this empty PostgreSQL database instead of starting one"
    )
    args = parser.parse_args(argv)
    if args.sample < 1 or (args.sample_v2 is not None and args.sample_v2 < 1):
        parser.error("--sample must be >= 1")
    v1_cycles = {"both": ("save", "restore"), "all": CYCLES, "stop": ()}.get(args.cycle, (args.cycle,))
    v2_cycles = {"both": ("save", "restore"), "all": ("save", "stop", "restore", "restore-resume")}.get(
        args.cycle, (args.cycle,)
    )
    if args.plane in ("v1", "both") and args.cycle == "stop":
        parser.error("--cycle stop is a cycle of the unified plane (--plane v2)")
    if args.plane in ("v2", "both") and args.cycle == "restore-checkpoint":
        parser.error("--cycle restore-checkpoint is a cycle of v1 (--plane v1)")

    def out(line: str) -> None:
        print(line, flush=True)

    with contextlib.ExitStack() as stack:
        folder = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        ledger = args.ledger_url if args.ledger_url else _ledger_url(args.ledger, folder, stack)
        ok = True
        started = time.monotonic()
        if args.plane in ("v1", "both"):
            matrix = Matrix(folder, ledger, args.sample, out)
            every = f"every {args.sample} point(s)"
            out(f"crash matrix: ledger {args.ledger}, plane v1, cycle {args.cycle}, {every}")
            _header(out)
            if "save" in v1_cycles:
                matrix.save_cycle()
            if "restore" in v1_cycles:
                matrix.restore_cycle()
            if "restore-resume" in v1_cycles:
                matrix.restore_resume_cycle()
            if "restore-checkpoint" in v1_cycles:
                matrix.restore_checkpoint_cycle()
            ok = matrix.summary()
        if args.plane in ("v2", "both"):
            from quiesce.tools.crashmatrix_v2 import MatrixV2

            sample = args.sample_v2 or args.sample
            v2_folder = folder / "v2" if args.plane == "both" else folder
            v2_folder.mkdir(parents=True, exist_ok=True)
            if args.plane == "both":  # a ledger of its own (v1's attempts stay v1's)
                ledger = (
                    _ledger_url(args.ledger, v2_folder, stack)
                    if not args.ledger_url
                    else ledger  # one given database: the v2 attempts follow v1's there
                )
            matrix_v2 = MatrixV2(v2_folder, ledger, sample, out)
            out(f"crash matrix: ledger {args.ledger}, plane v2, cycle {args.cycle}, every {sample} point(s)")
            _header(out)
            matrix_v2.run(v2_cycles)
            ok = matrix_v2.summary() and ok
        out(f"{'all invariants hold' if ok else 'INVARIANTS FAILED'} ({time.monotonic() - started:.0f}s)")
        if not args.keep:
            shutil.rmtree(folder / "runs", ignore_errors=True)
    return 0 if ok else 1


def _header(out: Callable[[str], None]) -> None:
    columns = ("cycle", 18), ("point", 12), ("last event before death", 52), ("recovery", 10)
    out(" ".join(f"{name:<{width}}" for name, width in columns) + f" {'time':>7}  invariants")


if __name__ == "__main__":
    raise SystemExit(main())
