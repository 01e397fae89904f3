"""A save on Gym's unified plane (v2): prepare stage by stage, commit with the episode scope, verify.

Rules this driver keeps (the engine — the deadline, the ledger records around every call,
rollback, publication — is the one v1 uses: `attempt.py`, `resume.py`, `save.py`):

- **Prepare** runs Gym's stages in order — environment → model → agent → resources — the servers
  of one stage in parallel, and stops at the first stage that is not ready. A server answering
  `preparing` is asked again with the same id until the deadline; each prepare is sent with a
  deadline a little before the attempt's (`prepare_margin_s`), so the server's "not ready yet"
  reply, with its blockers, arrives before the attempt's own deadline ends the wait. Not ready at
  the deadline: `episodes.blocked` records every server's blockers, then the attempt rolls back
  (every touched server resumed, stages backwards) and fails naming each server's first blockers
  and their full count. A prepare answered with `idle` means a resume or a lease expiry
  intervened: a failure, never a success.
- **Restarts** (episodes a participant cannot capture) are left out of the commit scope, recorded
  in `episodes.scoped` and listed on the attempt (`Attempt.restarts`): the trainer starts them over.
- **The scope** is the caller's episodes (minus restarts) — or, when none are given, derived
  from the environment servers' own export: they are committed first with no scope (an
  environment exports every live episode it owns), and what they exported becomes the scope of
  everyone else. A cluster without an environment server needs the caller's scope (the model
  refuses a commit without one); `require_scope` says so before any request.
- **Commit** fans out with `checkpoint_dir` = the staging folder, the scope and `stop`. Every
  reply is verified before the phase ends (so before anything is published): phase `committed`,
  the manifest's kind and checkpoint id, `episode_ids` unique and within the scope, the records
  file on disk against the manifest's sha256 and count, the manifest on disk equal to the
  reply's, a model's staging keys consistent with its per-episode keys, no episode exported by
  two environment servers. Each reply is checked against its files as it comes in, in a worker
  thread, while the fan-out waits for the slower servers — once its files are `digests.RACY_S`
  old, so their facts are kept for publication —, the last ones once every reply is in.
  `episodes.exported` records what each exported.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread

from quiesce.coordinator.attempt import (
    Attempt,
    Context,
    PhaseFailure,
    Progress,
    expect_reply,
    require_state,
    run_phase,
    send_call,
)
from quiesce.coordinator.calls import Body, encode_body
from quiesce.coordinator.digests import RACY_S, DigestCache, regular_bytes, regular_facts
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import QuiesceError
from quiesce.coordinator.phases import V2_STAGES
from quiesce.coordinator.protocol_v2 import (
    LEGACY_RECORDS,
    MANIFEST,
    RECORDS_PATTERN,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    EpisodeId,
    PrepareReply,
    PrepareReport,
    episode_of_key,
    participant_dir,
    unique_episodes,
)
from quiesce.coordinator.resume import rolled_back_on_failure
from quiesce.coordinator.staging import beside_prepare, made_for_commit
from quiesce.coordinator.wording import count

#: Blockers named per server in an error (the rest are counted).
NAMED_BLOCKERS: Final = 5
#: Longest pause before a `preparing` server is asked again when its reply came early.
PREPARE_RETRY_S: Final = 0.2
#: How often, while a commit's fan-out runs, the replies that arrived are verified (in a thread).
VERIFY_EVERY_S: Final = 0.05


#: The longest a single prepare asks a server to wait before it answers how far it got: the
#: server's report (its blockers) is then never older than this when the deadline ends the wait.
PREPARE_SLICE_S: Final = 2.0


def prepare_margin_s(budget_s: float) -> float:
    """How long before the attempt's deadline a prepare asks the server to answer: a tenth of the
    budget, between 250 ms and 1 s — time for the not-ready reply to travel back."""
    return min(1.0, max(0.25, budget_s * 0.1))


def require_scope(participants: Sequence[Member], episodes: Sequence[EpisodeId] | None) -> None:
    """Refuse (before any request) a save without a scope in a cluster that cannot derive one."""
    if episodes is not None or any(m.component == "environment" for m in participants):
        return
    raise QuiesceError(
        "this cluster has no environment server, so the episodes to save cannot be read from the"
        " servers themselves, and Gym's model refuses a commit without them. Give the episodes the"
        " trainer continues: save(episodes=[EpisodeId(rollout_id=..., attempt=...)]), or `quiesce"
        ' checkpoint --episodes FILE` (JSON lines of {"rollout_id": ..., "attempt": ...}; - reads'
        " standard input)"
    )


# ---------------------------------------------------------------------------------------------
# Prepare
# ---------------------------------------------------------------------------------------------


async def prepare(ctx: Context, attempt: Attempt, *, budget_s: float) -> None:
    """Prepare every stage in order (module docstring). Rolls back and raises on failure."""
    require_state(attempt, ("started",), "prepare")

    async def body() -> None:
        await run_phase(
            ctx,
            attempt,
            "prepare",
            lambda: beside_prepare(attempt, lambda: _prepare_body(ctx, attempt, budget_s)),
        )

    await rolled_back_on_failure(ctx, attempt, "prepare", body)
    attempt.state = "prepared"


async def _prepare_body(ctx: Context, attempt: Attempt, budget_s: float) -> dict[str, Any]:
    phase = "prepare"
    asked_ts = attempt.deadline_ts - prepare_margin_s(budget_s)
    reports: dict[str, PrepareReport] = {}

    def ask() -> tuple[float, Body]:
        # the same id each time; each call waits at most a slice, so its report is fresh
        until = min(asked_ts, time.time() + PREPARE_SLICE_S)
        return until, encode_body(CheckpointRequest(checkpoint_id=attempt.checkpoint_id, deadline_ts=until))

    async def one(m: Member, first: tuple[float, Body]) -> None:
        until, body = first  # a stage's first asks: one body for all its servers, encoded once
        while True:
            ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
            # the server answers by `until`; the call itself may take until the attempt's deadline
            result = await send_call(ctx, attempt, m, "prepare", phase, body=body)
            reply = expect_reply(result, PrepareReply, phase, "prepare")
            reports[m.name] = reply.report
            if reply.phase == "prepared":
                attempt.waiting_on.pop(m.name, None)
                return
            # what a deadline that ends the wait meanwhile reports (`run_phase`)
            attempt.waiting_on[m.name] = PhaseFailure(
                phase, m.name, f"not ready by the deadline — {blockers_text(reply.report)}", deadline=True
            )
            if reply.phase != "preparing":
                raise PhaseFailure(
                    phase,
                    m.name,
                    f"prepare answered phase {reply.phase!r}: the server let go of this checkpoint"
                    " while it was preparing (another controller resumed it, or its lease expired)",
                )
            if time.time() >= asked_ts - 0.01:
                return  # not ready by the deadline: judged with the others below
            if time.time() < until - 0.01:  # it answered before its slice ended: pause a little
                await anyio.sleep(min(PREPARE_RETRY_S, max(0.0, asked_ts - time.time())))
            until, body = ask()

    for role in V2_STAGES:
        members = attempt.group(role)
        if not members:
            continue
        first = ask()
        async with anyio.create_task_group() as tg:
            for m in members:
                tg.start_soon(_failing_into, attempt, m, functools.partial(one, first=first))
        failed = [attempt.settled[m.name] for m in members if m.name in attempt.settled]
        if failed:
            raise failed[0].with_others(failed[1:])
        waiting = [m.name for m in members if not reports[m.name].ready]
        if waiting:
            await _blocked(ctx, attempt, {n: reports[n] for n in waiting})
    for name, report in reports.items():
        if report.restarts:
            attempt.restarts[name] = tuple(sorted(report.restarts))
    return {
        "ready": sorted(reports),
        "restarts": {n: list(r) for n, r in attempt.restarts.items()},
    }


async def _failing_into(attempt: Attempt, m: Member, fn: Callable[[Member], Awaitable[None]]) -> None:
    """Run `fn(m)`; a `PhaseFailure` is kept in `attempt.settled` (siblings run to their end)."""
    try:
        await fn(m)
    except PhaseFailure as failure:
        attempt.settled[m.name] = failure


async def _blocked(ctx: Context, attempt: Attempt, waiting: dict[str, PrepareReport]) -> None:
    """Record the blockers of the servers not ready by the deadline (in the ledger and on the
    attempt), then fail naming them."""
    attempt.blocked = {n: tuple(r.blockers) for n, r in waiting.items()}
    await ctx.ledger.stage(
        "episodes.blocked",
        checkpoint_id=attempt.checkpoint_id,
        data={
            "blockers": {n: list(r.blockers) for n, r in waiting.items()},
            "counts": {n: max(r.blocker_count, len(r.blockers)) for n, r in waiting.items()},
        },
    )
    parts = [f"{name}: {blockers_text(report)}" for name, report in waiting.items()]
    first = next(iter(waiting))
    raise PhaseFailure(
        "prepare",
        first,
        "not ready by the deadline — " + "; ".join(parts) + ". Those episodes were between turns;"
        " give the save a longer deadline, or retire the episodes that cannot reach a boundary",
        deadline=True,
    )


def blockers_text(report: PrepareReport) -> str:
    """`blocked by 3 episodes (r1, r2, r3)`: the first `NAMED_BLOCKERS` named, the full count given."""
    total = max(report.blocker_count, len(report.blockers))
    if total == 0:
        return "not ready (it named no blocker)"
    named = ", ".join(report.blockers[:NAMED_BLOCKERS])
    more = total - min(len(report.blockers), NAMED_BLOCKERS)
    return f"blocked by {count(total, 'episode')} ({named}{f', and {more} more' if more else ''})"


# ---------------------------------------------------------------------------------------------
# Commit
# ---------------------------------------------------------------------------------------------


async def commit(
    ctx: Context,
    attempt: Attempt,
    *,
    episodes: Sequence[EpisodeId] | None,
    stop: bool,
    into: Path | None = None,
    budget_s: float | None = None,
) -> None:
    """Commit with the episode scope (module docstring); verify every reply. Rolls back on failure.

    `into`: the folder a save started in place with no folder yet commits into (checked by the
    caller); its `phase.started` records it durably before anything is created there, so a
    rollback or recovery finds what the servers wrote. `budget_s`: the commit's own budget from
    now (recorded in its `phase.started`) instead of the attempt's deadline."""
    require_state(attempt, ("prepared",), "commit")
    if budget_s is not None:
        attempt.deadline_ts = time.time() + budget_s
    if into is not None:
        attempt.staging_dir = into
    assert attempt.staging_dir is not None
    attempt.stop = stop

    async def made_then_committed() -> dict[str, Any]:
        await made_for_commit(attempt)
        return await _commit_body(ctx, attempt, episodes, stop)

    async def body() -> None:
        own = budget_s is not None
        if into is not None:  # recorded first, then created
            await run_phase(ctx, attempt, "commit", made_then_committed, staging_dir=into, own_budget=own)
            return
        await made_for_commit(attempt)
        await run_phase(
            ctx, attempt, "commit", lambda: _commit_body(ctx, attempt, episodes, stop), own_budget=own
        )

    await rolled_back_on_failure(ctx, attempt, "commit", body)
    attempt.state = "committed"


async def _commit_body(
    ctx: Context, attempt: Attempt, episodes: Sequence[EpisodeId] | None, stop: bool
) -> dict[str, Any]:
    phase = "commit"
    staging = attempt.staging_dir
    assert staging is not None
    restart_keys = {key for keys in attempt.restarts.values() for key in keys}
    replies: dict[str, CommitReply] = {}
    arrived: list[tuple[float, Member]] = []  # replies not verified yet, with when they arrived

    async def one(m: Member, body: Body) -> None:
        ctx.progress(Progress(attempt.checkpoint_id, phase, m.name))
        result = await send_call(ctx, attempt, m, "commit", phase, body=body)
        replies[m.name] = expect_reply(result, CommitReply, phase, "commit")
        arrived.append((time.monotonic(), m))

    async def fan_out(members: Sequence[Member], scope: list[EpisodeId] | None) -> None:
        # the servers of one folder get the same request: built and encoded once per folder
        bodies: dict[str, Body] = {}
        for folder in {m.folder for m in members}:
            bodies[folder] = encode_body(
                CommitRequest(
                    checkpoint_id=attempt.checkpoint_id,
                    deadline_ts=attempt.deadline_ts,
                    checkpoint_dir=os.path.join(staging, folder) if folder else str(staging),
                    episode_ids=scope,
                    stop=stop,
                )
            )
        async with anyio.create_task_group() as tg:
            for m in members:
                tg.start_soon(_failing_into, attempt, m, lambda m: one(m, bodies[m.folder]))
        failed = [attempt.settled[m.name] for m in members if m.name in attempt.settled]
        if failed:
            raise failed[0].with_others(failed[1:])

    environments = attempt.group("environment")
    if episodes is not None:
        scope = [e for e in unique_episodes(episodes) if e.capture_key not in restart_keys]
        source = "given"
        first: tuple[Member, ...] = ()
    elif environments:
        # derive the scope from what the environment servers own (module docstring)
        await fan_out(environments, None)
        exported = {k for m in environments for k in replies[m.name].episode_ids}
        scope = unique_episodes(episode_of_key(k) for k in exported if k not in restart_keys)
        source = "derived"
        first = environments
    else:
        raise PhaseFailure(phase, None, "no episode scope was given and no environment server can name one")
    attempt.scope = tuple(e.capture_key for e in scope)
    await ctx.ledger.stage(
        "episodes.scoped",
        checkpoint_id=attempt.checkpoint_id,
        data={
            "scope": list(attempt.scope),
            "source": source,
            "restarts": {n: list(k) for n, k in attempt.restarts.items()},
        },
    )
    rest = [m for m in attempt.participants if m not in first]
    scope_keys = set(attempt.scope)
    checked: dict[str, tuple[dict[str, Any], list[str]]] = {}

    def verify(members: list[Member]) -> list[tuple[Member, tuple[dict[str, Any], list[str]]]]:
        # in a worker thread: each reply against the files on disk (`_verify_commit`)
        folder = str(staging)
        return [
            (m, _verify_commit(folder, m, attempt.checkpoint_id, replies[m.name], scope_keys,
                               restart_keys, attempt.digests))
            for m in members
        ]  # fmt: skip

    async def verify_due(everything: bool) -> None:
        # the replies whose files are old enough for their facts to be kept (`digests.RACY_S`);
        # at the end, every one left
        now = time.monotonic()
        due = [m for at, m in arrived if everything or now - at >= RACY_S]
        if not due:
            return
        arrived[:] = [(at, m) for at, m in arrived if not (everything or now - at >= RACY_S)]
        for m, outcome in await anyio.to_thread.run_sync(verify, due):
            checked[m.name] = outcome

    # replies are verified as they come in, while the fan-out waits for the slower servers
    fanned_out = anyio.Event()
    failure: PhaseFailure | None = None

    async def verifier() -> None:
        while not fanned_out.is_set():
            with anyio.move_on_after(VERIFY_EVERY_S):
                await fanned_out.wait()
            await verify_due(False)

    async with anyio.create_task_group() as tg:
        tg.start_soon(verifier)
        try:
            await fan_out(rest, scope)
        except PhaseFailure as error:
            failure = error
        finally:
            fanned_out.set()
    if failure is not None:
        raise failure
    await verify_due(True)
    owners: dict[str, str] = {}
    for m in attempt.participants:
        entry, problems = checked[m.name]
        if problems:
            raise PhaseFailure(phase, m.name, "; ".join(problems))
        if m.component == "environment":
            for key in replies[m.name].episode_ids:
                if key in owners:
                    raise PhaseFailure(
                        phase,
                        m.name,
                        f"episode {key} was exported by two environment servers ({owners[key]})",
                    )
                owners[key] = m.name
        attempt.commits[m.name] = entry
        attempt.exported[m.name] = tuple(replies[m.name].episode_ids)
    await ctx.ledger.stage(
        "episodes.exported",
        checkpoint_id=attempt.checkpoint_id,
        data={"exported": {n: list(k) for n, k in attempt.exported.items()}},
    )
    return {
        "scope": len(attempt.scope),
        "exported": {n: len(k) for n, k in attempt.exported.items()},
        "stop": stop,
    }


def _verify_commit(
    staging: str,
    m: Member,
    checkpoint_id: str,
    reply: CommitReply,
    scope: set[str],
    restarts: set[str],
    cache: DigestCache,
) -> tuple[dict[str, Any], list[str]]:
    """A commit reply against the rules of the module docstring and the files on disk; returns the
    publication entry of the participant and the problems found (none: it may be published). The
    facts of its manifest and records file go into `cache`: publication does not hash them again.
    Neither is read through a symlink."""
    problems: list[str] = []
    manifest = reply.manifest
    if manifest.kind != m.component:
        problems.append(f"its manifest names kind {manifest.kind!r}; the server is a {m.component}")
    if manifest.checkpoint_id != checkpoint_id:
        problems.append(f"its manifest names checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}")
    keys = reply.episode_ids
    if len(set(keys)) != len(keys):
        problems.append("its episode_ids repeat an episode")
    if keys != sorted(keys):
        problems.append("its episode_ids are not sorted")
    outside = sorted(set(keys) - scope)
    restarted = [k for k in outside if k in restarts]
    if restarted:
        problems.append(
            f"it exported {count(len(restarted), 'episode')} another participant reports as a restart"
            f" ({', '.join(restarted[:NAMED_BLOCKERS])}): a restart cannot be continued, so no"
            " participant may save it — Gym marks such an episode as a restart on every participant"
            " (the seed reply's x-ng-checkpoint-restart header)"
        )
    elif outside:
        problems.append(f"it exported episodes outside the scope: {', '.join(outside[:NAMED_BLOCKERS])}")
    if m.component == "model":
        problems.extend(_staging_key_problems(reply, set(keys)))
    # relative to the snapshot: the member's own folder, then Gym's participant folder
    folder = participant_dir(manifest.kind, manifest.instance)
    if m.folder:
        folder = f"{m.folder}/{folder}"
    entry: dict[str, Any] = {
        "name": m.name,
        "component": m.component,
        "role": m.role,
        "plane": "v2",
        **({"folder": m.folder} if m.folder else {}),
        "manifest": f"{folder}/{MANIFEST}",
        "records": f"{folder}/{manifest.records_file}",
        "manifest_digest": "",
        "reply": reply.model_dump(mode="json"),
    }
    if problems:
        return entry, problems
    name = manifest.records_file
    if not (RECORDS_PATTERN.match(name) or name == LEGACY_RECORDS):
        return entry, [f"its records file name {name!r} is not records-<sha256>.jsonl"]
    base = os.path.join(staging, folder)  # text, not `Path`: this runs for every participant
    # read once, never through a symlink; its facts go into `cache`: publication does not read it again
    read = regular_bytes(os.path.join(base, MANIFEST), cache=cache)
    if isinstance(read, str):
        return entry, [f"its manifest {folder}/{MANIFEST} {'is ' if read[0] in 'mn' else ''}{read}"]
    raw, manifest_facts = read
    entry["manifest_digest"] = manifest_facts.sha256
    try:
        on_disk = json.loads(raw)
    except (ValueError, RecursionError):
        return entry, [f"its manifest {folder}/{MANIFEST} is not JSON"]
    if on_disk != manifest.model_dump(mode="json"):
        problems.append(f"its manifest {folder}/{MANIFEST} differs from the one its commit reply names")
    facts = regular_facts(os.path.join(base, name), records=True, cache=cache)  # never through a symlink
    if isinstance(facts, str):
        return entry, [*problems, f"its records file {folder}/{name} is {facts}"]
    digest, lines = facts.sha256, facts.records or 0
    if digest != manifest.records_sha256:
        problems.append(f"its records file {folder}/{name} does not match the manifest's sha256")
    if lines != manifest.record_count:
        problems.append(
            f"its records file {folder}/{name} holds {count(lines, 'record')}; the manifest says"
            f" {manifest.record_count}"
        )
    return entry, problems


def _staging_key_problems(reply: CommitReply, exported: set[str]) -> list[str]:
    """A model's `staging_keys` must be sorted, unique, and exactly the keys `staging_keys_by_episode`
    attributes to the exported episodes."""
    keys = reply.staging_keys or []
    by_episode = reply.staging_keys_by_episode or {}
    problems: list[str] = []
    if keys != sorted(set(keys)):
        problems.append("its staging_keys are not sorted and unique")
    attributed = {k for ks in by_episode.values() for k in ks}
    if attributed != set(keys):
        problems.append("its staging_keys differ from the keys staging_keys_by_episode attributes")
    strays = sorted(set(by_episode) - exported)
    if strays:
        problems.append(f"staging_keys_by_episode names episodes it did not export: {', '.join(strays[:5])}")
    return problems
