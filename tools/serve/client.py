"""`RemoteCoordinator`: `Coordinator`'s shapes over `quiesce serve`'s API v1.

    from quiesce import RemoteCoordinator

    async with RemoteCoordinator("http://10.0.0.5:8470", token=os.environ["QUIESCE_API_TOKEN"]) as coord:
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:   # prepare + commit on entry
            write_trainer_state(attempt.staging_dir)       # the caller's own half (a shared filesystem)
        await coord.restore(attempt.snapshot)
        await coord.resume()

The methods return what `Coordinator`'s return — `coordinator.Attempt`, `coordinator.Outcome`,
`coordinator.Discovery`, `quiesce.coordinator.status.ClusterStatus` (each server's `capabilities` None:
not sent), `ledger.AttemptRow`, `ledger.lineage.Rollout` (`rollouts()`), the acknowledged
`(rollout_id, attempt_index)` pairs — and raise
what they raise: a failed phase is a `PhaseError` with the same fields (what was resumed, what
could not be), a bad snapshot a `SnapshotError`, a held participant `ServersHeld`, a refused
acknowledgement `AcknowledgementError`, and so on; the service adds `Busy` (another attempt in
progress), `Unauthorized` and `Unavailable` (`quiesce.tools.serve.errors`). A request the service
refuses as invalid (HTTP 422 — executions embedded refuses with `ConfigError`: none, a duplicate,
an id Gym refuses) raises `InvalidRequest`, a `ConfigError` whose `fields` say why.

Rules kept here:
- `save()` mirrors `Coordinator.save`: leaving the block normally publishes and resumes (one
  request); an exception inside it rolls the attempt back (`/abort`, shielded from cancellation)
  and is re-raised with a note saying what the rollback did.
- **Failover.** `url` may list several services (an active one and its standbys). A request that
  could not reach a service (refused connection) or that a standby or a recovering service
  answered with 503 is sent again — to the address a standby names first, else to the next URL
  — until `failover_s` has passed. Such a request never ran, so sending it again is safe.
  A request whose connection broke after it was sent is *not* repeated (the save may have run):
  `OutcomeUnknown` says so; `history()` shows how it ended.
- The token defaults to `QUIESCE_API_TOKEN`; it is sent only as the bearer header, never logged.
- Every request but a GET carries a JSON body (`{}` when there is nothing to say) with
  `Content-Type: application/json`: the service refuses any other (`tools/serve/guard.py`).
- Requests go through the coordinator's own HTTP/1.1 client (`quiesce.coordinator.http.HttpClient`, the
  one under every control call): on the bench machine a request's round trip on loopback took
  ~0.5 ms with it and ~1.7 ms with httpx, whose per-request cost was most of what a save through
  the service added (two requests per save). httpx serves only the event stream (`events`).
"""

from __future__ import annotations

import json as jsonlib
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self
from urllib.parse import urlencode

import anyio
import httpx

from quiesce.coordinator.attempt import Attempt, Outcome
from quiesce.coordinator.discovery import Discovery
from quiesce.coordinator.errors import (
    AcknowledgementError,
    ConfigError,
    DeadlineExceeded,
    DiscoveryError,
    FencedError,
    LedgerError,
    PhaseError,
    QuiesceError,
    ServersHeld,
    SnapshotError,
)
from quiesce.coordinator.http import ConnectFailed, ConnectTimeout, HttpClient, HttpFailure
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.coordinator.retire import RetireOutcome
from quiesce.coordinator.snapshots import SnapshotInfo
from quiesce.coordinator.status import ClusterStatus
from quiesce.ledger import AttemptRow
from quiesce.ledger.lineage import Rollout
from quiesce.tools.serve.auth import API_TOKEN_ENV
from quiesce.tools.serve.errors import (
    Busy,
    InvalidRequest,
    NotFound,
    OutcomeUnknown,
    Unauthorized,
    Unavailable,
)
from quiesce.tools.serve.models import (
    AcknowledgeReply,
    AttemptModel,
    DiscoveryModel,
    HistoryRow,
    OutcomeModel,
    RestoreReply,
    RetireReply,
    RolloutsReply,
    SnapshotModel,
    StatusModel,
)

__all__ = ["RemoteCoordinator"]

#: How long one request may take: a save's deadline bounds the service's side; this only guards
#: against a service that stopped answering altogether.
DEFAULT_TIMEOUT_S: Final = 600.0
#: The largest reply read (a `show` of a long attempt is the largest); more is a failed request.
MAX_REPLY_BYTES: Final = 256 * 1024 * 1024
RETRY_PAUSE_S: Final = 0.2


class RemoteCoordinator:
    """A client of one `quiesce serve` (or of an active service and its standbys)."""

    def __init__(
        self,
        url: str | Sequence[str],
        token: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        failover_s: float = 30.0,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ConfigError("RemoteCoordinator needs at least one service URL, e.g. http://127.0.0.1:8470")
        self._urls = [u.rstrip("/") for u in urls]
        self._current = 0
        token = token if token is not None else (os.environ.get(API_TOKEN_ENV) or None)
        if token is not None and any(c in token for c in "\r\n"):
            raise ConfigError(f"the API token holds a line break: check {API_TOKEN_ENV}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._headers = {"Accept": "application/json", **headers}
        self._rpc = HttpClient()
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout_s, trust_env=False)  # events only
        self._timeout_s = timeout_s
        self._failover_s = failover_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._rpc.aclose()
        await self._http.aclose()

    @property
    def url(self) -> str:
        """The service the last request went to."""
        return self._urls[self._current]

    # -- the embedded API's shapes -----------------------------------------------------------

    async def discover(self) -> Discovery:
        """Capabilities of every server → participants; raises `DiscoveryError` listing refusals."""
        found = DiscoveryModel.model_validate(await self._request("GET", "/v1/discovery")).discovery()
        if found.refused:
            raise DiscoveryError(
                "discovery refused the setup: " + "; ".join(f"{n}: {r}" for n, r in found.refused),
                list(found.refused),
            )
        return found

    @asynccontextmanager
    async def save(
        self,
        *,
        deadline_s: float | None = None,
        episodes: Sequence[EpisodeId] | None = None,
        into: str | os.PathLike[str] | None = None,
    ) -> AsyncIterator[Attempt]:
        """Prepare and commit on entry; yield the attempt (write into `attempt.staging_dir`).

        Normal exit publishes, then resumes (`attempt.snapshot` is then the published folder). An
        exception inside the block rolls back and is re-raised with a note on what was done.
        `episodes`, `into` (Gym's unified plane): as `Coordinator.save` takes them (`into` is a
        folder on the service's host).
        """
        body = {**_deadline(deadline_s), **_episodes(episodes), **_into(into)}
        reply = await self._send("POST", "/v1/attempts", json=body)
        attempt = AttemptModel.model_validate_json(reply).attempt()
        try:
            yield attempt
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                try:
                    done = await self.abort(attempt, reason=f"the caller's block raised {type(exc).__name__}")
                    exc.add_note(
                        f"attempt {attempt.checkpoint_id} rolled back: resumed {', '.join(done.resumed)}"
                    )
                except QuiesceError as error:
                    exc.add_note(f"attempt {attempt.checkpoint_id}: the rollback failed: {error}")
            raise
        reply = await self._send(
            "POST", f"/v1/attempts/{attempt.checkpoint_id}/publish", json={"resume": True}
        )
        _update(attempt, AttemptModel.model_validate_json(reply))

    async def checkpoint(
        self,
        *,
        deadline_s: float | None = None,
        episodes: Sequence[EpisodeId] | None = None,
        stop: bool = False,
        into: str | os.PathLike[str] | None = None,
    ) -> Attempt:
        """prepare → commit → publish → resume, with nothing added by the caller (one request).
        Gym's unified plane: `episodes` is the commit scope, `stop` leaves the servers paused for
        shutdown once published, `into` commits into a folder and publishes there in place (a
        folder on the service's host) — as `Coordinator.checkpoint`."""
        body = {
            **_deadline(deadline_s),
            **_episodes(episodes),
            **({"stop": True} if stop else {}),
            **_into(into),
        }
        reply = await self._request("POST", "/v1/checkpoints", json=body)
        return AttemptModel.model_validate(reply).attempt()

    async def retire(
        self, episodes: Sequence[EpisodeId], *, deadline_s: float | None = None
    ) -> RetireOutcome:
        """Retire these attempts on every server of Gym's unified plane (as `Coordinator.retire`);
        `PhaseError` naming the servers that failed."""
        body = {"episodes": [e.model_dump() for e in episodes], **_deadline(deadline_s)}
        return RetireReply.model_validate(await self._request("POST", "/v1/retire", json=body)).outcome()

    async def forget(self, rollout_ids: Sequence[str], *, deadline_s: float | None = None) -> RetireOutcome:
        """Drop the retire marks of these rollouts on every server (as `Coordinator.forget`)."""
        body = {"rollout_ids": list(rollout_ids), **_deadline(deadline_s)}
        return RetireReply.model_validate(await self._request("POST", "/v1/forget", json=body)).outcome()

    async def restore(
        self,
        snapshot: str | os.PathLike[str] | None = None,
        *,
        deadline_s: float | None = None,
        resume: bool = False,
    ) -> Attempt:
        """Restore a snapshot (a folder, a checkpoint id, or None/"latest"); servers stay paused
        unless `resume` (then the attempt ends only once they run again)."""
        body: dict[str, Any] = {"snapshot": os.fspath(snapshot) if snapshot is not None else None}
        body.update(_deadline(deadline_s))
        if resume:
            body["resume"] = True
        reply = RestoreReply.model_validate(await self._request("POST", "/v1/restore", json=body))
        attempt = reply.attempt.attempt()
        if reply.resumed is not None:
            attempt.resume_outcome = reply.resumed.outcome_()
        return attempt

    async def resume(self, target: Attempt | str | None = None) -> Outcome:
        """Resume `target` — an `Attempt`, a checkpoint id — or (None) whatever holds the servers:
        a published two-step save, a restore (finished first if interrupted), what a rollback
        left paused, another ledger's id. Outcome `none` when nothing holds them."""
        if target is None:
            reply = await self._request("POST", "/v1/resume")
        else:
            checkpoint_id = target if isinstance(target, str) else target.checkpoint_id
            reply = await self._request("POST", f"/v1/attempts/{checkpoint_id}/resume")
        outcome = OutcomeModel.model_validate(reply).outcome_()
        if (
            isinstance(target, Attempt)
            and outcome.outcome in ("resumed", "published")
            and not outcome.left_paused
        ):
            target.state = "completed"
        return outcome

    async def abort(
        self, target: Attempt | str | None = None, *, reason: str = "aborted by request"
    ) -> Outcome:
        """Roll back `target` — an `Attempt`, a checkpoint id — before publication (every touched
        server resumed); None: the service's waiting two-step save, else whatever holds the servers."""
        if target is None:
            reply = await self._request("POST", "/v1/abort", json={"reason": reason})
            return OutcomeModel.model_validate(reply).outcome_()
        checkpoint_id = target if isinstance(target, str) else target.checkpoint_id
        reply = await self._request("POST", f"/v1/attempts/{checkpoint_id}/abort", json={"reason": reason})
        outcome = OutcomeModel.model_validate(reply).outcome_()
        if isinstance(target, Attempt) and outcome.outcome == "aborted":
            target.state = "aborted"
        return outcome

    async def status(self) -> ClusterStatus:
        """Live, read-only: every server's fence, what holds it and the command that frees it."""
        return StatusModel.model_validate(await self._request("GET", "/v1/status")).status()

    async def acknowledge_completed(
        self, server: str, executions: Sequence[tuple[str, int]]
    ) -> list[tuple[str, int]]:
        """Tell agent `server` the caller now holds these finished results `(rollout_id,
        attempt_index)`; returns the acknowledged set. May run while a save is in progress."""
        body = {"server": server, "executions": [[rollout, index] for rollout, index in executions]}
        reply = AcknowledgeReply.model_validate(await self._request("POST", "/v1/acknowledge", json=body))
        return [(rollout, index) for rollout, index in reply.acknowledged]

    async def history(
        self, *, limit: int = 0, before: str | None = None, outcome: str | None = None
    ) -> list[AttemptRow]:
        """The `attempts` projection, oldest first, as `Coordinator.history` pages it; an unknown
        `before` raises `NotFound`."""
        query = {"limit": limit, "before": before, "outcome": outcome}
        params = urlencode({k: v for k, v in query.items() if v})
        rows = await self._request("GET", "/v1/attempts" + (f"?{params}" if params else ""))
        return [HistoryRow.model_validate(r).row() for r in rows]

    # -- reading --------------------------------------------------------------------------------

    async def snapshots(self) -> list[SnapshotInfo]:
        """The published snapshots, oldest first (`quiesce.coordinator.snapshots.list_published`);
        `latest` marks the one `LATEST` names."""
        return [SnapshotModel.model_validate(s).info() for s in await self._request("GET", "/v1/snapshots")]

    async def rollouts(
        self, rollout_id: str | Sequence[str] | None = None, *, state: str | None = None
    ) -> list[Rollout]:
        """Each rollout's lineage from the service's ledger, as `Coordinator.rollouts` selects it
        (every rollout by id, or those named in that order, ids never recorded left out; `state`
        only those in it); another state raises `InvalidRequest` (a `ConfigError`, as embedded)."""
        names = [rollout_id] if isinstance(rollout_id, str) else list(rollout_id or ())
        if rollout_id is not None and not names:
            return []  # none named: none shown (a query without `rollout` means every rollout)
        query = [("rollout", r) for r in names] + ([("state", state)] if state is not None else [])
        reply = await self._request("GET", "/v1/rollouts" + (f"?{urlencode(query)}" if query else ""))
        return [r.rollout() for r in RolloutsReply.model_validate(reply).rollouts]

    async def show(self, checkpoint_id: str) -> dict[str, Any]:
        """One attempt explained from the ledger (`quiesce show ID --json`)."""
        document: dict[str, Any] = await self._request("GET", f"/v1/attempts/{checkpoint_id}")
        return document

    async def events(self, checkpoint_id: str) -> AsyncIterator[dict[str, Any]]:
        """The attempt's events (stored, then live) until its end, as the stream sends them."""
        import json

        url = f"{self.url}/v1/attempts/{checkpoint_id}/events"
        async with self._http.stream("GET", url, timeout=httpx.Timeout(None, connect=10)) as reply:
            if reply.status_code != 200:
                raise _error(reply.status_code, await reply.aread())
            kind, data = None, None
            async for line in reply.aiter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                elif line == "" and data is not None:
                    if kind == "end":
                        return
                    yield json.loads(data)
                    kind, data = None, None

    # -- transport ------------------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, json: Mapping[str, Any] | None = None) -> Any:
        """The decoded JSON reply of a request that succeeded (see `_send`)."""
        return jsonlib.loads(await self._send(method, path, json=json))

    async def _send(self, method: str, path: str, *, json: Mapping[str, Any] | None = None) -> bytes:
        """The body of the reply to `method path`; an error reply raised as the error it stands for
        (`_error`); failover as the module docstring says."""
        give_up = time.monotonic() + self._failover_s
        tried = 0
        headers = self._headers
        body: bytes | None = None
        if json is not None or method != "GET":  # the service takes no state change but as JSON
            body = jsonlib.dumps(json if json is not None else {}).encode()
            headers = {**headers, "Content-Type": "application/json"}
        while True:
            url = self._urls[self._current]
            try:
                reply = await self._rpc.request(
                    method,
                    url + path,
                    headers=headers,
                    body=body,
                    timeout_s=self._timeout_s,
                    max_body=MAX_REPLY_BYTES,
                )
            except (ConnectFailed, ConnectTimeout) as error:  # nothing was sent
                failure: QuiesceError = Unavailable(f"cannot reach the quiesce service at {url}: {error}")
                self._next(None)
            except HttpFailure as error:
                raise OutcomeUnknown(
                    f"the connection to {url} broke during {method} {path} ({type(error).__name__}: {error}):"
                    " the service may or may not have run it; history() shows what the ledger recorded"
                ) from None
            else:
                if reply.too_big:
                    raise QuiesceError(
                        f"{method} {path}: the reply of {url} exceeds {MAX_REPLY_BYTES} bytes; not read"
                    )
                if reply.status < 400:
                    return reply.body
                failure = _error(reply.status, reply.body)
                if not isinstance(failure, Unavailable):
                    raise failure
                self._next(failure.active)
            tried += 1
            if time.monotonic() >= give_up:
                raise failure
            await anyio.sleep(RETRY_PAUSE_S if tried >= len(self._urls) else 0)

    def _next(self, active: str | None) -> None:
        """Where to send the request again: the address a standby named, else the next URL."""
        if active:
            active = active.rstrip("/")
            if active not in self._urls:
                self._urls.append(active)
            self._current = self._urls.index(active)
        else:
            self._current = (self._current + 1) % len(self._urls)


def _deadline(deadline_s: float | None) -> dict[str, Any]:
    return {"deadline_s": deadline_s} if deadline_s is not None else {}


def _episodes(episodes: Sequence[EpisodeId] | None) -> dict[str, Any]:
    return {"episodes": [e.model_dump() for e in episodes]} if episodes is not None else {}


def _into(into: str | os.PathLike[str] | None) -> dict[str, Any]:
    return {"into": os.fspath(into)} if into is not None else {}


def _update(attempt: Attempt, model: AttemptModel) -> None:
    attempt.state = model.state  # type: ignore[assignment]  # an AttemptState the service sent
    attempt.snapshot = Path(model.snapshot) if model.snapshot is not None else None
    attempt.touched[:] = model.touched


_CLASSES: Final[dict[str, type[QuiesceError]]] = {
    "ConfigError": ConfigError,
    "SnapshotError": SnapshotError,
    "FencedError": FencedError,
    "LedgerError": LedgerError,
    "QuiesceError": QuiesceError,
    "NotFound": NotFound,
    "OutcomeUnknown": OutcomeUnknown,
}


def _error(status: int, content: bytes) -> QuiesceError:
    """The error an error reply stands for (the same class and fields the embedded API raises)."""
    try:
        body = jsonlib.loads(content)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return QuiesceError(f"the service answered {status}: {content[:500].decode(errors='replace')}")
    kind, message = str(error.get("type", "QuiesceError")), str(error.get("message", ""))
    if kind in ("PhaseError", "DeadlineExceeded"):
        cls = DeadlineExceeded if kind == "DeadlineExceeded" else PhaseError
        return cls(
            message,
            phase=str(error.get("phase") or ""),
            server=error.get("server"),
            reason=str(error.get("reason") or message),
            code=error.get("code"),
            checkpoint_id=error.get("checkpoint_id"),
            resumed=error.get("resumed"),
            not_resumed=error.get("not_resumed"),
            latest_snapshot=error.get("latest_snapshot"),
            warnings=[str(w) for w in error.get("warnings") or []],
        )
    if kind == "DiscoveryError":
        return DiscoveryError(message, [tuple(r) for r in error.get("reasons") or []])
    if kind == "Busy":
        return Busy(message, checkpoint_id=error.get("checkpoint_id"), operation=error.get("operation"))
    if kind == "Unauthorized":
        return Unauthorized(message)
    if kind == "Unavailable":
        return Unavailable(message, state=error.get("state"), active=error.get("active"))
    if kind == "ServersHeld":
        return ServersHeld(message, dict(error.get("held") or {}))
    if kind == "InvalidRequest":
        fields = [f for f in error.get("fields") or [] if isinstance(f, dict)]
        return InvalidRequest(message, [(str(f.get("field")), str(f.get("problem"))) for f in fields])
    if kind == "AcknowledgementError":
        return AcknowledgementError(
            message, server=str(error.get("server") or ""), status=error.get("status"), code=error.get("code")
        )
    cls_ = _CLASSES.get(kind, QuiesceError)
    if cls_ is SnapshotError:
        return SnapshotError(message, list(error.get("differences") or []))
    return cls_(message)
