"""The crash matrix on Gym's unified checkpoint plane (v2): `python -m quiesce.tools.crashmatrix --plane v2`.

The same method as v1's (`crashmatrix.py`): every *append point* (`QUIESCE_CRASH_AT=n`) and every
*send point* (`QUIESCE_CRASH_BEFORE_SEND=n`) of one full command — counted by an uncrashed dry run —
SIGKILLs a forked `quiesce` command against a forked v2 reference cluster (environment, policy
model, agent, resources; the default lease grace of 600 s, so a recovery that waited for a lease
would show), with episodes running (paced by a trainer in a forked child, parked at a boundary so
every dry run makes the same requests). Then `quiesce recover`, a second `quiesce recover` (no call;
only `coordinator.started`, `recovery.started`, `recovery.completed` appended), and the checks.

Cycles (`--cycle`; `all` runs every one):
- `save`: `quiesce checkpoint` on one long-lived cluster (new rollouts per point). After recovery
  every server is idle with no checkpoint id; the episodes then finish with exactly the results of
  an uninterrupted run.
- `stop`: `quiesce checkpoint --stop` on a fresh cluster per point. Rolled back: every server idle,
  the episodes finish there. Published: every server `committed` under the attempt's id (paused
  for shutdown, by design); the snapshot is restored (`restore --resume`) into freshly started
  servers, where the next attempts finish exactly.
- `restore` / `restore-resume`: `quiesce restore [--resume]` of one mid-rollout snapshot into a
  fresh cluster per point. Recovery either finished it (restored and paused — then `quiesce
  resume` — or resumed, as the caller asked) or cleaned it up: every server idle, the next attempt
  of each episode retired on every server (a `/run` of it is refused `stale_attempt`), nothing
  restored pending; then the operator restores again into fresh servers. A restore that never
  started is run again. Either way the next attempts then finish exactly as an uninterrupted run.

Checked at every point: no lease expired on any server (recovery never waited for one); no
snapshot folder without `attempt.published` in the ledger (nothing published half-way), each one
verifies, `LATEST` names the last published; no staging left; the source snapshot still verifies;
the ledger's hash chain and projections verify (replay) and the audit's protocol check passes.

`--sample K` runs every K-th point of each cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from quiesce.coordinator import crashpoints
from quiesce.coordinator.crashpoints import CRASH_AT, CRASH_BEFORE_SEND, CrashPoints, is_send_point
from quiesce.coordinator.publish import LATEST, load_snapshot, read_latest, verify_snapshot
from quiesce.ledger import Event
from quiesce.tools.crashmatrix import (
    ForkedCluster,
    Matrix,
    Point,
    Run,
    ledger_problems,
    ledger_tail,
    quiesce,
)
from quiesce.tools.gymsim.cluster import write_yaml_atomic
from quiesce.tools.gymsim.spec import default_v2_spec
from quiesce.tools.gymsim.v2.trainer import EpisodeFailed, Trainer, expected_results, make_tasks

__all__ = ["CYCLES_V2", "MatrixV2", "TrainerChild"]

CYCLES_V2 = ("v2-save", "v2-stop", "v2-restore", "v2-restore-resume")
#: name → component of the default v2 cluster (what a snapshot of it must list)
PARTICIPANTS_V2 = {
    "environment": "environment",
    "policy_model": "model",
    "agent": "agent",
    "resources": "resources",
}
EPISODES = 3
TURNS = 5
#: turns each episode runs before the checkpoint (then it waits at that boundary)
BEFORE = 2
PROBE = "/gymsim/admin/state"
RECOVERED = ["coordinator.started", "recovery.started", "recovery.completed"]


# ---------------------------------------------------------------------------------------------
# The trainer, in a forked child (this process stays without threads and event loops)
# ---------------------------------------------------------------------------------------------


async def _drive(env_url: str, tasks: dict[str, Any], attempt: int, paced: bool, timeout_s: float) -> Any:
    async with Trainer(env_url) as trainer:
        await trainer.start(tasks, paced=paced, attempt=attempt)
        with contextlib.suppress(EpisodeFailed):
            await trainer.wait_results(timeout_s)
        return {
            "results": trainer.results,
            "failures": {rid: [status, str(body)[:300]] for rid, (status, body) in trainer.failures.items()},
        }


class TrainerChild:
    """Gym's trainer client (`tools/gymsim/v2/trainer.py`) in a forked child: starts one episode per
    task (attempt `attempt`) on the environment at `env_url` and waits for every `/run`; `wait`
    returns `{results, failures}`."""

    def __init__(
        self, env_url: str, tasks: dict[str, Any], out: Path, *, attempt: int = 0, paced: bool = True
    ) -> None:
        self.out = out
        out.unlink(missing_ok=True)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                document = asyncio.run(_drive(env_url, tasks, attempt, paced, 600.0))
            except BaseException as error:
                document, code = {"error": f"{type(error).__name__}: {error}"}, 1
            part = out.with_suffix(".part")
            part.write_text(json.dumps(document), encoding="utf-8")
            part.replace(out)
            os._exit(code)
        self.pid = pid

    def wait(self, timeout_s: float = 120.0) -> dict[str, Any]:
        give_up = time.monotonic() + timeout_s
        while True:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > give_up:
                self.kill()
                raise TimeoutError("the trainer's episodes did not finish")
            time.sleep(0.02)
        if not self.out.exists():
            raise RuntimeError("the trainer child died without a result")
        document: dict[str, Any] = json.loads(self.out.read_text(encoding="utf-8"))
        if "error" in document:
            raise RuntimeError(f"the trainer failed: {document['error']}")
        return document

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


@contextlib.contextmanager
def trainer_child(
    env_url: str, tasks: dict[str, Any], out: Path, *, attempt: int = 0, paced: bool = True
) -> Iterator[TrainerChild]:
    child = TrainerChild(env_url, tasks, out, attempt=attempt, paced=paced)
    try:
        yield child
    finally:
        child.kill()


# ---------------------------------------------------------------------------------------------
# The dry run: which append is which
# ---------------------------------------------------------------------------------------------


class _Tally(CrashPoints):
    """The crash points' counters without a crash: one line per committed append, as
    `QUIESCE_CRASH_AT` counts them — its number, the POST `call.sent` events so far, the kinds it
    carried."""

    def __init__(self, path: Path) -> None:
        super().__init__(None, None)
        self.path = path

    def after_append(self, events: Sequence[Event]) -> None:
        self.appends += 1
        self.sends += sum(is_send_point(e.kind, e.data) for e in events)
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps([self.appends, self.sends, [e.kind for e in events]]) + "\n")


Tallied = list[tuple[int, int, list[str]]]


def tallied(argv: list[str], folder: Path) -> tuple[Run, Tallied]:
    """Run `quiesce argv` uncrashed, counting its appends and sends exactly (the crash points'
    own counters, installed in the forked command)."""
    path = folder / "tally.jsonl"
    path.unlink(missing_ok=True)

    def setup() -> None:  # in the forked command only
        tally = _Tally(path)
        crashpoints.from_env = lambda environ=None: tally

    run = quiesce(argv, folder, setup=setup)
    rows = (
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []
    )
    return run, [(int(n), int(sends), list(kinds)) for n, sends, kinds in rows]


# ---------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------


class MatrixV2(Matrix):
    """The v2 cycles; shares v1's forked commands, recovery runs, ledger checks and output rows."""

    def __init__(self, folder: Path, ledger: str, sample: int, out: Callable[[str], None]) -> None:
        super().__init__(folder, ledger, sample, out)
        self.spec = default_v2_spec()
        self._seen = 0
        self._published: list[tuple[Path, str]] = []
        self._clusters = 0
        self._live: list[ForkedCluster] = []
        made = quiesce(["db", "upgrade", "--ledger", ledger], self._workdir)  # the cycles read it first
        if made.code != 0:
            raise RuntimeError(f"the ledger could not be created: {made.stderr}")

    # -- the servers ----------------------------------------------------------------------------

    def cluster(self) -> ForkedCluster:
        self._clusters += 1
        return ForkedCluster(
            self.spec, self.token, probe=PROBE, log=self.folder / f"servers-{self._clusters % 4}.log"
        )

    @contextlib.contextmanager
    def forked(self) -> Iterator[ForkedCluster]:
        cluster = self.cluster()
        self._live.append(cluster)
        try:
            yield cluster
        finally:
            self._live.remove(cluster)
            cluster.kill()

    def state(self, urls: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Each participant's own view (`/gymsim/admin/state`: its plane status, lease expiries,
        retire marks)."""
        out = {}
        for name in PARTICIPANTS_V2:
            reply = self.http.get(urls[name] + PROBE)
            reply.raise_for_status()
            out[name] = reply.json()
        return out

    def _phases(self, urls: dict[str, str]) -> dict[str, tuple[str, str | None]]:
        return {n: (s["phase"], s["checkpoint_id"]) for n, s in self.state(urls).items()}

    def _all_idle(self, point: Point, urls: dict[str, str], when: str) -> None:
        bad = {n: s for n, s in self._phases(urls).items() if s != ("idle", None)}
        if bad:
            point.problems.append(f"not idle {when}: {bad}")

    def _no_lease_expired(self, point: Point, urls: dict[str, str]) -> None:
        expired = {n: s["lease_expirations"] for n, s in self.state(urls).items() if s["lease_expirations"]}
        if expired:
            point.problems.append(f"a lease expired (recovery must not wait for one): {expired}")

    def _episodes(self, env: str) -> dict[str, Any]:
        reply = self.http.get(env + "/gymsim/admin/episodes")
        reply.raise_for_status()
        document: dict[str, Any] = reply.json()
        return document

    def _admin(self, env: str, path: str, body: dict[str, Any]) -> None:
        self.http.post(f"{env}/gymsim/admin/episodes/{path}", json=body).raise_for_status()

    def _parked(self, env: str, tasks: dict[str, Any], turns: int = BEFORE, timeout_s: float = 60) -> None:
        """Wait until every episode of `tasks` is live at boundary `turns`, not mid-turn."""
        give_up = time.monotonic() + timeout_s
        first = True
        while True:
            live = {e["rollout_id"]: e for e in self._episodes(env).values()}
            mine = [live.get(rid) for rid in tasks]
            if all(e is not None for e in mine):
                if first:
                    self._admin(env, "advance", {"turns": turns, "rollout_ids": list(tasks)})
                    first = False
                elif all(e is not None and e["turn"] == turns and not e["mid_turn"] for e in mine):
                    return
            if time.monotonic() > give_up:
                raise TimeoutError(f"episodes never parked at boundary {turns}: {mine}")
            time.sleep(0.01)

    def _finish(self, point: Point, trainer: TrainerChild, env: str | None, tasks: dict[str, Any]) -> None:
        """Let the episodes run to their end (unpaced, when `env` is given); check their results."""
        if env is not None:
            self._admin(env, "unpace", {"rollout_ids": list(tasks)})
        document = trainer.wait()
        if document["failures"]:
            point.problems.append(f"episodes failed: {document['failures']}")
            logs = [cluster.errors() for cluster in self._live]
            point.problems += [f"the servers logged:\n{text}" for text in logs if text]
        if document["results"] != expected_results(tasks):
            point.problems.append("episode results differ from the uninterrupted run")

    def _tasks(self, tag: str) -> dict[str, Any]:
        return make_tasks(EPISODES, turns=TURNS, prefix=f"{tag}r")

    def _snapshots(self, point: Point, snapshots: Path, keep: Path | None = None) -> None:
        """Nothing published half-way: every snapshot folder has its `attempt.published` and
        verifies; `LATEST` names the last published; no staging is left; `keep` still verifies."""
        self._scan()
        published = {str(final.resolve()) for final, _ in self._published}
        last = next((final for final, _ in reversed(self._published) if final.parent == snapshots), None)
        if snapshots.is_dir():
            for child in sorted(snapshots.iterdir()):
                if not child.is_dir() or child.name.startswith("."):
                    continue
                if str(child.resolve()) not in published:
                    point.problems.append(f"{child.name}: a snapshot folder without attempt.published")
                try:
                    verify_snapshot(child, participants=PARTICIPANTS_V2)
                except Exception as error:
                    point.problems.append(f"{child.name}: {error}")
        staging = snapshots / ".staging"
        if staging.is_dir() and any(staging.iterdir()):
            point.problems.append(f"staging left: {sorted(p.name for p in staging.iterdir())}")
        latest = read_latest(snapshots)
        if (snapshots / LATEST).exists() and latest is None:
            point.problems.append("LATEST names no folder")
        if last is not None and (latest is None or latest.resolve() != last.resolve()):
            point.problems.append(f"LATEST is {latest}, the last published is {last}")
        if keep is not None:
            try:
                verify_snapshot(keep, participants=PARTICIPANTS_V2)
            except Exception as error:
                point.problems.append(f"the source snapshot {keep.name}: {error}")

    def _second(self, point: Point, config: Path, urls: dict[str, str]) -> None:
        point.problems += self._second_recover(config, urls, self._workdir)

    def plan_v2(self, cycle: str, rows: Tallied) -> list[tuple[str, int]]:
        """The points that matter of a command whose dry run appended `rows`: append 1, every
        append from the one right before `attempt.started` on (before it the command has only read
        the servers: each of those points is append 1's), every send point; then every K-th
        (`--sample`). Staged events are committed with a later append, so some consecutive points
        are one instant; which ones depends on timing, so each is run."""
        if not rows:
            raise RuntimeError(f"the {cycle} dry run appended nothing")
        appends, sends = rows[-1][0], rows[-1][1]
        first = next((n for n, _, kinds in rows if "attempt.started" in kinds), appends)
        points = [1, *range(max(2, first - 1), appends + 1)]
        self.out(
            f"{cycle} cycle: {appends} append points, {len(points)} of them run (1 and"
            f" {max(2, first - 1)}-{appends}; attempt.started is append {first}), {sends} send points"
        )
        plan = [(CRASH_AT, n) for n in points] + [(CRASH_BEFORE_SEND, n) for n in range(1, sends + 1)]
        return [step for index, step in enumerate(plan) if index % self.sample == 0]

    def _head(self) -> int:
        self._scan()
        return self._seen

    def _scan(self) -> list[dict[str, Any]]:
        """The events appended since the last scan; notes every publication."""
        tail = ledger_tail(self.ledger, self._seen)
        for event in tail:
            if event["kind"] == "attempt.published":
                self._published.append((Path(event["data"]["final_dir"]), str(event["checkpoint_id"])))
        if tail:
            self._seen = tail[-1]["seq"]
        return tail

    def _run_points(self, cycle: str, plan: list[tuple[str, int]], one: Callable[[Point], None]) -> None:
        for variable, n in plan:
            point = Point(cycle, variable, n)
            self.points.append(point)
            try:
                one(point)
            except Exception as error:
                point.problems.append(f"harness: {type(error).__name__}: {error}")
            self._row(point)

    @staticmethod
    def _tag(point: Point) -> str:
        return f"{point.cycle[3:5]}{'a' if point.variable == CRASH_AT else 's'}{point.n}"

    # -- save and stop --------------------------------------------------------------------------

    def save_cycle(self) -> None:
        snapshots = self.folder / "v2-save-snapshots"
        with self.forked() as cluster:
            config = write_yaml_atomic(self.folder / "v2-save.yaml", cluster.config(self.ledger, snapshots))
            env = cluster.urls["environment"]
            tasks = self._tasks("dry")
            with trainer_child(env, tasks, self.folder / "dry.json") as trainer:
                self._parked(env, tasks)
                dry, rows = tallied(["checkpoint", "--config", str(config), "--json"], self._workdir)
                if dry.code != 0:
                    raise RuntimeError(f"the dry-run checkpoint failed: {dry.stderr}")
                probe = Point("v2-save", CRASH_AT, 0)
                self._finish(probe, trainer, env, tasks)
                if probe.problems:
                    raise RuntimeError(f"the dry run's episodes: {probe.problems}")
            self._run_points(
                "v2-save",
                self.plan_v2("v2-save", rows),
                lambda point: self._save_point(point, cluster, config, snapshots),
            )

    def _save_point(self, point: Point, cluster: ForkedCluster, config: Path, snapshots: Path) -> None:
        env = cluster.urls["environment"]
        tasks = self._tasks(self._tag(point))
        with trainer_child(env, tasks, self.folder / "episodes.json") as trainer:
            self._parked(env, tasks)
            head = self._head()
            crashed = quiesce(
                ["checkpoint", "--config", str(config), "--json"],
                self._workdir,
                {point.variable: str(point.n)},
            )
            self._crashed(point, crashed, head)
            self._recover(point, config, cluster.urls)
            self._all_idle(point, cluster.urls, "after recovery")
            self._no_lease_expired(point, cluster.urls)
            self._snapshots(point, snapshots)
            self._second(point, config, cluster.urls)
            self._finish(point, trainer, env, tasks)
        point.problems += ledger_problems(self.ledger)

    def stop_cycle(self) -> None:
        snapshots = self.folder / "v2-stop-snapshots"
        with self.forked() as cluster:
            config = write_yaml_atomic(self.folder / "v2-stop.yaml", cluster.config(self.ledger, snapshots))
            env = cluster.urls["environment"]
            tasks = self._tasks("dst")
            with trainer_child(env, tasks, self.folder / "dry.json"):
                self._parked(env, tasks)
                argv = ["checkpoint", "--stop", "--config", str(config), "--json"]
                dry, rows = tallied(argv, self._workdir)
                if dry.code != 0:
                    raise RuntimeError(f"the dry-run stop-checkpoint failed: {dry.stderr}")
        plan = self.plan_v2("v2-stop", rows)
        self._run_points("v2-stop", plan, lambda point: self._stop_point(point, snapshots))

    def _stop_point(self, point: Point, snapshots: Path) -> None:
        tasks = self._tasks(self._tag(point))
        with self.forked() as cluster:
            urls = cluster.urls
            config = write_yaml_atomic(self.folder / "v2-stop.yaml", cluster.config(self.ledger, snapshots))
            with trainer_child(urls["environment"], tasks, self.folder / "episodes.json") as trainer:
                self._parked(urls["environment"], tasks)
                head = self._head()
                crashed = quiesce(
                    ["checkpoint", "--stop", "--config", str(config), "--json"],
                    self._workdir,
                    {point.variable: str(point.n)},
                )
                tail = self._crashed(point, crashed, head)
                self._recover(point, config, urls)
                started = next((e for e in tail if e["kind"] == "attempt.started"), None)
                cid = started["checkpoint_id"] if started is not None else None
                published = next(
                    (
                        e
                        for e in ledger_tail(self.ledger, head)
                        if e["kind"] == "attempt.published" and e["checkpoint_id"] == cid
                    ),
                    None,
                )
                if published is None:
                    self._all_idle(point, urls, "after recovery (rolled back)")
                else:
                    bad = {n: s for n, s in self._phases(urls).items() if s != ("committed", cid)}
                    if bad:
                        point.problems.append(f"not paused for shutdown by {cid} after recovery: {bad}")
                self._no_lease_expired(point, urls)
                self._snapshots(point, snapshots)
                self._second(point, config, urls)
                if published is None:
                    self._finish(point, trainer, urls["environment"], tasks)
        if published is not None:  # the way on: restore into freshly started servers
            self._continue_elsewhere(point, Path(published["data"]["final_dir"]), snapshots, tasks)
        point.problems += ledger_problems(self.ledger)

    def _continue_elsewhere(
        self, point: Point, snapshot: Path, snapshots: Path, tasks: dict[str, Any]
    ) -> None:
        with self.forked() as fresh:
            config = write_yaml_atomic(self.folder / "v2-fresh.yaml", fresh.config(self.ledger, snapshots))
            again = quiesce(
                ["restore", "--snapshot", str(snapshot), "--resume", "--config", str(config), "--json"],
                self._workdir,
            )
            if again.code != 0:
                point.problems.append(
                    f"restore --resume into fresh servers failed: {again.stderr.strip()[-300:]}"
                )
                return
            with trainer_child(
                fresh.urls["environment"], tasks, self.folder / "next.json", attempt=1, paced=False
            ) as trainer:
                self._finish(point, trainer, None, tasks)

    # -- restore --------------------------------------------------------------------------------

    def _source_v2(self) -> tuple[Path, Path, dict[str, Any]]:
        """The snapshot every restore cycle restores (made once, mid-episode)."""
        snapshots = self.folder / "v2-restore-snapshots"
        tasks = self._tasks("src")
        snapshot = read_latest(snapshots)
        if snapshot is not None:
            return snapshots, snapshot, tasks
        with self.forked() as source:
            config = write_yaml_atomic(self.folder / "v2-source.yaml", source.config(self.ledger, snapshots))
            with trainer_child(source.urls["environment"], tasks, self.folder / "src.json"):
                self._parked(source.urls["environment"], tasks)
                made = quiesce(["checkpoint", "--config", str(config), "--json"], self._workdir)
                if made.code != 0:
                    raise RuntimeError(f"the source checkpoint failed: {made.stderr}")
        snapshot = read_latest(snapshots)
        assert snapshot is not None
        if sorted(load_snapshot(snapshot).participants[0]["reply"]["episode_ids"]) == []:
            raise RuntimeError("the source snapshot holds no episode")
        return snapshots, snapshot, tasks

    def restore_v2_cycle(self, *, resume: bool) -> None:
        cycle = "v2-restore-resume" if resume else "v2-restore"
        snapshots, snapshot, tasks = self._source_v2()
        command = ["restore", "--snapshot", str(snapshot), "--json", *(["--resume"] if resume else [])]
        with self.forked() as fresh:
            config = write_yaml_atomic(self.folder / "v2-restore.yaml", fresh.config(self.ledger, snapshots))
            dry, rows = tallied([*command, "--config", str(config)], self._workdir)
            if dry.code != 0:
                raise RuntimeError(f"the dry-run restore failed: {dry.stderr}")
        self._run_points(
            cycle,
            self.plan_v2(cycle, rows),
            lambda point: self._restore_v2_point(point, snapshots, snapshot, tasks, command, resume),
        )

    def _restore_v2_point(
        self,
        point: Point,
        snapshots: Path,
        snapshot: Path,
        tasks: dict[str, Any],
        command: list[str],
        resume: bool,
    ) -> None:
        with self.forked() as fresh:
            urls = fresh.urls
            config = write_yaml_atomic(self.folder / "v2-restore.yaml", fresh.config(self.ledger, snapshots))
            head = self._head()
            crashed = quiesce(
                [*command, "--config", str(config)], self._workdir, {point.variable: str(point.n)}
            )
            tail = self._crashed(point, crashed, head)
            self._recover(point, config, urls)
            started = next((e for e in tail if e["kind"] == "attempt.started"), None)
            cid = started["checkpoint_id"] if started is not None else None
            ends = [
                e
                for e in ledger_tail(self.ledger, head)
                if e["checkpoint_id"] == cid and e["kind"] in ("attempt.completed", "attempt.aborted")
            ]
            outcome = None if not ends else ends[-1]["data"].get("outcome", "aborted")
            if ends and ends[-1]["kind"] == "attempt.aborted":
                outcome = "aborted"
            point.action += f" ({outcome or 'never started'})"
            self._no_lease_expired(point, urls)
            if cid is None:  # it died before the restore started: nothing to clean up
                self._all_idle(point, urls, "(the restore never started)")
                self._no_marks(point, urls)
            elif outcome == "aborted":
                self._cleaned_up(point, urls, tasks)
            elif outcome == "restored" and not resume:
                bad = {n: s for n, s in self._phases(urls).items() if s != ("restored", cid)}
                if bad:
                    point.problems.append(f"not restored and paused after recovery: {bad}")
            elif outcome == "resumed" or (outcome == "restored" and resume):
                if outcome != "resumed":
                    point.problems.append("the caller asked for a resume; recovery left it restored")
                self._all_idle(point, urls, "after recovery (restored and resumed)")
            else:
                point.problems.append(
                    f"the restore is unfinished after recovery: {[e['kind'] for e in ends]}"
                )
            self._second(point, config, urls)
            self._snapshots(point, snapshots, keep=snapshot)
            if outcome == "restored":
                run = quiesce(["resume", "--config", str(config), "--json"], self._workdir)
                if run.code != 0:
                    point.problems.append(f"resume failed: {run.stderr.strip()[-300:]}")
                self._all_idle(point, urls, "after `quiesce resume`")
            if outcome in ("restored", "resumed"):
                with trainer_child(
                    urls["environment"], tasks, self.folder / "next.json", attempt=1, paced=False
                ) as trainer:
                    self._finish(point, trainer, None, tasks)
            elif cid is None:  # the operator runs it again, in the same servers
                again = quiesce([*command, "--resume", "--config", str(config)], self._workdir)
                if again.code != 0:
                    point.problems.append(f"restore again failed: {again.stderr.strip()[-300:]}")
                with trainer_child(
                    urls["environment"], tasks, self.folder / "next.json", attempt=1, paced=False
                ) as trainer:
                    self._finish(point, trainer, None, tasks)
        if outcome == "aborted":  # restart the servers fresh and restore again, as the error says
            self._continue_elsewhere(point, snapshot, snapshots, tasks)
        point.problems += ledger_problems(self.ledger)

    def _no_marks(self, point: Point, urls: dict[str, str]) -> None:
        marked = {n: s["retire_marks"] for n, s in self.state(urls).items() if s["retire_marks"]}
        if marked:
            point.problems.append(f"retire marks where nothing was restored: {marked}")

    def _cleaned_up(self, point: Point, urls: dict[str, str], tasks: dict[str, Any]) -> None:
        """A cleaned-up restore: everyone idle, the next attempt of each episode retired on every
        server (its `/run` refused), nothing restored left pending."""
        self._all_idle(point, urls, "after the restore was cleaned up")
        wanted = {rid: 1 for rid in tasks}
        for name, state in self.state(urls).items():
            if state["retire_marks"] != wanted:
                point.problems.append(f"{name}: retire marks {state['retire_marks']}, expected {wanted}")
            if state.get("restored_pending"):
                point.problems.append(f"{name}: restored records still pending {state['restored_pending']}")
        rid = next(iter(tasks))
        body = {"episode_id": {"rollout_id": rid, "attempt": 1}, "task": tasks[rid], "paced": False}
        reply = self.http.post(urls["environment"] + "/run", json=body)
        code = (reply.json().get("error") or {}).get("code") if reply.status_code == 409 else None
        if code != "stale_attempt":
            point.problems.append(
                f"a /run of retired {rid} attempt 1 got {reply.status_code} {reply.text[:200]}"
            )

    # -- output ---------------------------------------------------------------------------------

    def run(self, chosen: tuple[str, ...]) -> None:
        if "save" in chosen:
            self.save_cycle()
        if "stop" in chosen:
            self.stop_cycle()
        if "restore" in chosen:
            self.restore_v2_cycle(resume=False)
        if "restore-resume" in chosen:
            self.restore_v2_cycle(resume=True)

    def summary(self) -> bool:
        return self.summarize(CYCLES_V2)
