"""The HTTP face of the service: API v1 (OpenAPI at `/openapi.json`, docs at `/docs`, offline:
`docs`), the event streams, `/metrics`, `/healthz`, `/readyz` and the live page at `/`.

Rules kept here:
- Every `/v1` route and `/metrics` needs the API bearer token when one is set (`auth`); `/`,
  `/docs`, `/openapi.json`, `/healthz` and `/readyz` never do (they show no ledger data; the page
  asks for the token itself).
- Every route that drives servers is one `Service.run` operation; the ledger reads
  (`/v1/attempts...`, `/v1/rollouts`) go through a separate read-only ledger, so they never
  disturb a save.
- Two routes claim no operation, as the embedded API allows them beside an attempt: `GET
  /v1/status` (read-only: live fences, holders looked up in the read-only ledger, nothing
  recorded) and `POST /v1/acknowledge` (a trainer releasing a finished result may be what lets the
  save in progress prepare). Both need a ready (or stopping) service: a standby answers 503.
  `GET /v1/snapshots` reads the snapshots folder only (no ledger, no operation), in any state.
- Gym's unified plane adds `POST /v1/retire` and `POST /v1/forget` (`unified`: the same auth and
  operation rules; refused with 409 on a v1 cluster or while a save is open); a checkpoint takes
  `episodes` and `stop`, a two-step save `episodes`; discovery, status and attempts carry each
  server's `plane`.
- `latest` in an attempt route (`/v1/attempts/latest`, `/events`, `/timeline`) is the attempt in
  progress, else the ledger's newest; 404 before the first.
- Resume and abort act on any checkpoint id (`POST /v1/resume|abort` with `checkpoint_id`, or
  `POST /v1/attempts/{id}/resume|abort`): the two-step save waiting here continues as that
  attempt; any other id — a restore a CLI left held, another ledger's id — is let go through the
  coordinator's id-targeted `resume(id)` / `abort(id)` as one operation.
- A save's two requests (`POST /v1/attempts`, `POST /v1/attempts/{id}/publish`) are `hot_route`s:
  the ordinary request skips FastAPI's per-request dependency solving and double validation
  (`fastpath`); every other request, and the OpenAPI document, are FastAPI's as declared here.
- Before any route, `guard` refuses a `Host` this service does not answer to (421
  `MisdirectedHost`), another site's `Origin` (403 `CrossOrigin`), a request that may change
  state without `Content-Type: application/json` (415 `UnsupportedMediaType`) and a body over
  1 MiB (413 `BodyTooLarge`), on every route.
- Errors are `{"error": {...}}` (`models.ErrorReply`) with these statuses: 401 `Unauthorized`;
  404 `NotFound`; 409 `Busy` (another attempt is in progress; names it), `ServersHeld` (names each
  holder and what frees it; `held`), `AcknowledgementError` (the agent refused; its `status` and
  `code`) and any other refusal of the current state; 400 `ConfigError`; 422 `SnapshotError` and
  `InvalidRequest` (a body, path or query that does not validate: `fields` says why, `validation`);
  400 `InvalidHeader` (a `Last-Event-ID` that is no event id: before the stream starts);
  502 `PhaseError`, `DeadlineExceeded`, `DiscoveryError` (a Gym server or the deadline failed the
  operation; what was rolled back is in the body); 503 `Unavailable` (standby, recovering,
  stopping; a standby names the active one in `active`), `FencedError`, `LedgerError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Final, Literal

import anyio.to_thread
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from quiesce.coordinator import Attempt, Coordinator, Discovery, Outcome
from quiesce.coordinator.errors import (
    AcknowledgementError,
    ConfigError,
    DiscoveryError,
    LedgerError,
    PhaseError,
    QuiesceError,
    ServersHeld,
    SnapshotError,
)
from quiesce.ledger import Ledger
from quiesce.ledger.redact import mask_url_passwords
from quiesce.tools.serve.auth import BearerCheck
from quiesce.tools.serve.docs import mount_docs
from quiesce.tools.serve.errors import (
    BodyTooLarge,
    Busy,
    CrossOrigin,
    InvalidHeader,
    InvalidRequest,
    MisdirectedHost,
    NotFound,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)
from quiesce.tools.serve.fastpath import hot_route
from quiesce.tools.serve.guard import RequestGuard
from quiesce.tools.serve.hosts import ServedHosts
from quiesce.tools.serve.metrics import CONTENT_TYPE
from quiesce.tools.serve.models import (
    AbortRequest,
    AcknowledgeReply,
    AcknowledgeRequest,
    AttemptModel,
    CheckpointRequest,
    DiscoveryModel,
    ErrorBody,
    ErrorReply,
    FieldProblem,
    HistoryRow,
    OutcomeModel,
    PublishRequest,
    Readiness,
    RestoreReply,
    RestoreRequest,
    ResumeRequest,
    RolloutsReply,
    RolloutState,
    SaveRequest,
    SnapshotModel,
    StatusModel,
)
from quiesce.tools.serve.page import render_page
from quiesce.tools.serve.service import Service
from quiesce.tools.serve.unified import router as unified_router
from quiesce.tools.serve.validation import invalid_request

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorReply} for code in (400, 401, 403, 404, 409, 413, 415, 421, 422, 502, 503)
}
#: The largest `Last-Event-ID` (an event's seq): the ledger's seq is a signed 64-bit integer.
MAX_EVENT_ID: Final = 2**63 - 1


def status_of(error: QuiesceError) -> int:
    """The HTTP status of an error (see the module docstring)."""
    if isinstance(error, Unauthorized):
        return 401
    if isinstance(error, CrossOrigin):
        return 403
    if isinstance(error, BodyTooLarge):
        return 413
    if isinstance(error, UnsupportedMediaType):
        return 415
    if isinstance(error, MisdirectedHost):
        return 421
    if isinstance(error, InvalidHeader):
        return 400
    if isinstance(error, NotFound):
        return 404
    if isinstance(error, Busy):
        return 409
    if isinstance(error, Unavailable | LedgerError):
        return 503
    if isinstance(error, PhaseError | DiscoveryError):
        return 502
    if isinstance(error, SnapshotError | InvalidRequest):
        return 422
    if isinstance(error, ConfigError):
        return 400
    return 409


def error_body(error: QuiesceError) -> ErrorBody:
    """The JSON error of `error`; a URL's password in its message is hidden (`mask_url_passwords`)."""
    body = ErrorBody(type=type(error).__name__, message=mask_url_passwords(str(error)))
    if isinstance(error, PhaseError):
        body.phase, body.server, body.reason, body.code = error.phase, error.server, error.reason, error.code
        body.checkpoint_id = error.checkpoint_id
        body.resumed, body.not_resumed = list(error.resumed), list(error.not_resumed)
        body.latest_snapshot = error.latest_snapshot
        body.warnings = [mask_url_passwords(w) for w in error.warnings] or None
    elif isinstance(error, Busy):
        body.checkpoint_id, body.operation = error.checkpoint_id, error.operation
    elif isinstance(error, Unavailable):
        body.state, body.active = error.state, error.active
    elif isinstance(error, SnapshotError):
        body.differences = list(error.differences)
    elif isinstance(error, DiscoveryError):
        body.reasons = [(name, mask_url_passwords(reason)) for name, reason in error.reasons]
    elif isinstance(error, ServersHeld):
        body.held = dict(error.held)
    elif isinstance(error, AcknowledgementError):
        body.server, body.status, body.code = error.server, error.status, error.code
    elif isinstance(error, InvalidRequest):
        body.fields = [FieldProblem(field=where, problem=what) for where, what in error.fields]
    return body


def error_reply(error: QuiesceError) -> JSONResponse:
    """The reply to `error`: `ErrorReply` with its status (`status_of`) and, for 401 and 503, the
    header saying what to do."""
    status = status_of(error)
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status == 503:
        headers["Retry-After"] = "1"
    body = ErrorReply(error=error_body(error)).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(service: Service, *, api_token: str | None, hosts: ServedHosts | None = None) -> FastAPI:
    """The ASGI app of one service. `api_token` None: no authentication (loopback only); `hosts`:
    the `Host` values it answers to (`guard` refuses the others, and foreign origins) — None: the
    loopback names at any port (`ServedHosts.loopback`, for a harness that binds its own socket)."""
    check = BearerCheck(api_token)
    app = FastAPI(
        title="quiesce",
        version="1",
        summary="The checkpoint coordinator of NeMo Gym servers, as a service (API v1)",
        docs_url=None,  # `docs`: the same page, its assets served here (no CDN)
        redoc_url=None,
    )
    mount_docs(app)
    app.add_middleware(RequestGuard, hosts=hosts or ServedHosts.loopback(), refuse=error_reply)

    async def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        if not check.allows(authorization):
            raise Unauthorized(
                "missing or invalid API bearer token (Authorization: Bearer $QUIESCE_API_TOKEN)"
            )

    @app.exception_handler(QuiesceError)
    async def quiesce_error(request: Request, error: QuiesceError) -> JSONResponse:
        return error_reply(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return await quiesce_error(request, invalid_request(error.errors(), secrets=[api_token or ""]))

    guarded = [Depends(authorized)]
    app.state.service = service  # read by the routers' dependencies (`unified.service_of`)
    app.include_router(unified_router, dependencies=guarded, responses=_ERRORS)

    # -- process -------------------------------------------------------------------------------

    def readiness() -> Readiness:
        coord = service.coord
        return Readiness(
            state=service.state,
            ready=service.ready,
            epoch=coord.epoch if coord is not None else None,
            active=service.active if service.state == "standby" else service.advertise,
            busy=service.busy,
            recovery=service.recovery.as_json() if service.recovery is not None else None,
        )

    @app.get("/healthz", response_model=Readiness, tags=["process"])
    async def healthz() -> Readiness:
        """The process is up (whatever its state)."""
        return readiness()

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, tags=["process"])
    async def readyz() -> Response:
        """200 when this service holds the lease, has recovered and can write the ledger; else 503."""
        state = readiness()
        return JSONResponse(state.model_dump(mode="json"), status_code=200 if state.ready else 503)

    @app.get("/metrics", dependencies=guarded, responses=_ERRORS, tags=["process"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics (text format)."""
        await service.settle_metrics()
        metrics = service.metrics
        if metrics.stale:  # rendering takes milliseconds: off the event loop, so no save waits for it
            return Response(await anyio.to_thread.run_sync(metrics.scrape), media_type=CONTENT_TYPE)
        return Response(metrics.scrape(), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        page = render_page()
        return HTMLResponse(page.html, headers={"Content-Security-Policy": page.csp})

    # -- driving the cluster ------------------------------------------------------------------

    async def op(
        name: str, fn: Callable[[Coordinator], Awaitable[Any]], attempt_id: str | None = None
    ) -> Any:
        return await service.run(name, fn, attempt_id=attempt_id)

    @app.get("/v1/discovery", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def discovery() -> DiscoveryModel:
        """Capabilities of every configured server → participants, skipped and refused (with reasons)."""
        found = await op("discovery", lambda coord: coord.discover(strict=False))
        return DiscoveryModel.of(found)

    @app.post("/v1/checkpoints", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def checkpoint(request: CheckpointRequest | None = None) -> AttemptModel:
        """A whole save: prepare → commit → publish → resume. Returns the published attempt. Gym's
        unified plane: `episodes` is the commit scope, `stop` leaves the servers paused for
        shutdown once published (409 on a v1 cluster)."""
        body = request or CheckpointRequest()
        attempt: Attempt = await op(
            "checkpoint",
            lambda coord: coord.checkpoint(
                deadline_s=body.deadline_s, episodes=body.episodes, stop=body.stop, into=body.into
            ),
        )
        return AttemptModel.of(attempt, outcome="published")

    async def start_attempt(request: SaveRequest | None = None) -> AttemptModel:
        """Step one of a save whose caller adds its own half: prepare + commit. Write into
        `staging_dir`, then `POST /v1/attempts/{id}/publish` (or `/abort`) before the deadline."""
        deadline_s = request.deadline_s if request is not None else None
        episodes = request.episodes if request is not None else None
        into = request.into if request is not None else None

        async def prepare_commit(coord: Coordinator) -> Attempt:
            if episodes is not None and (await coord_discovery(coord)).plane != "v2":
                raise QuiesceError(  # before the prepare: a v1 commit would refuse it, servers paused
                    "an episode scope is a notion of Gym's unified plane; this cluster speaks v1"
                )
            attempt = await coord.prepare(deadline_s=deadline_s, into=into)
            await coord.commit(attempt, episodes=episodes)
            service.pending = attempt
            return attempt

        return AttemptModel.of(await op("save", prepare_commit))

    app.router.add_api_route(
        "/v1/attempts",
        start_attempt,
        methods=["POST"],
        status_code=201,
        dependencies=guarded,
        responses=_ERRORS,
        tags=["cluster"],
        route_class_override=hot_route(start_attempt, body=SaveRequest, check=check, status_code=201),
    )

    def pending(checkpoint_id: str) -> Attempt:
        attempt = service.pending
        if attempt is None or attempt.checkpoint_id != checkpoint_id:
            raise NotFound(
                f"no attempt {checkpoint_id} awaits its next step in this service"
                + (f" (attempt {attempt.checkpoint_id} does)" if attempt is not None else "")
                + "; GET /v1/attempts/{id} shows how an attempt ended"
            )
        return attempt

    async def publish(checkpoint_id: str, request: PublishRequest | None = None) -> AttemptModel:
        """Publish a committed attempt (manifest, rename, `LATEST`); with `resume`, then resume
        every server (what leaving the embedded `save()` does)."""
        resume = request.resume if request is not None else False
        pending(checkpoint_id)

        async def publish_step(coord: Coordinator) -> Attempt:
            attempt = pending(checkpoint_id)
            if not resume:
                await coord.publish(attempt)
                return attempt
            try:
                await coord.publish_and_resume(attempt)  # what leaving the embedded `save()` does
            finally:
                if attempt.state in ("completed", "aborted"):
                    service.pending = None
            return attempt

        attempt = await op("publish", publish_step, checkpoint_id)
        return AttemptModel.of(attempt, outcome="published" if attempt.state == "completed" else None)

    app.router.add_api_route(
        "/v1/attempts/{checkpoint_id}/publish",
        publish,
        methods=["POST"],
        dependencies=guarded,
        responses=_ERRORS,
        tags=["cluster"],
        route_class_override=hot_route(publish, body=PublishRequest, check=check),
    )

    def waiting_for(checkpoint_id: str | None) -> Attempt | None:
        """The two-step save waiting here if `checkpoint_id` names it (None: whichever waits)."""
        waiting = service.pending
        if waiting is not None and checkpoint_id in (None, waiting.checkpoint_id):
            return waiting
        return None

    async def let_go(
        verb: Literal["resume", "abort"], checkpoint_id: str | None, reason: str
    ) -> OutcomeModel:
        """Resume or abort `checkpoint_id` (None: the save waiting here, else whatever holds the
        servers): the waiting save continues as that attempt; any other id goes to the
        coordinator's `resume(id)` / `abort(id)`, one operation (409 while another runs)."""
        waiting = waiting_for(checkpoint_id)
        if waiting is not None:
            claim = waiting.checkpoint_id

            async def step(coord: Coordinator) -> Outcome:
                attempt = service.pending
                if attempt is None or attempt.checkpoint_id != claim:
                    raise NotFound(f"attempt {claim} no longer awaits its next step in this service")
                try:
                    if verb == "resume":
                        return await coord.resume(attempt)
                    return await coord.abort(attempt, reason=reason)
                finally:
                    if attempt.state in ("completed", "aborted"):
                        service.pending = None

            return OutcomeModel.of(await op(verb, step, claim))

        async def by_id(coord: Coordinator) -> Outcome:
            if verb == "resume":
                return await coord.resume(checkpoint_id)
            return await coord.abort(checkpoint_id, reason=reason)

        return OutcomeModel.of(await op(verb, by_id, checkpoint_id))

    @app.post(
        "/v1/attempts/{checkpoint_id}/resume", dependencies=guarded, responses=_ERRORS, tags=["cluster"]
    )
    async def resume_attempt(checkpoint_id: str, request: ResumeRequest | None = None) -> OutcomeModel:
        """Resume checkpoint `checkpoint_id`: the last step of a two-step save waiting here, or any
        id that holds servers — a restore left paused (finished first if interrupted), a published
        save's unfinished resume, what a rollback left paused, another ledger's id. The body is
        optional (`{}`): it is there so every POST of the API takes JSON, /docs' forms included."""
        if request is not None and request.checkpoint_id not in (None, checkpoint_id):
            raise ConfigError(
                f"the path names checkpoint {checkpoint_id} and the body {request.checkpoint_id}: give one"
            )
        return await let_go("resume", checkpoint_id, "resumed by request before publication")

    @app.post("/v1/attempts/{checkpoint_id}/abort", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def abort_attempt(checkpoint_id: str, request: AbortRequest | None = None) -> OutcomeModel:
        """Roll back checkpoint `checkpoint_id` before publication (every touched server resumed,
        staging removed) — the two-step save waiting here or any attempt that holds servers; one
        already published is resumed instead, a restore finished and resumed."""
        body = request or AbortRequest()
        if body.checkpoint_id not in (None, checkpoint_id):
            raise ConfigError(
                f"the path names checkpoint {checkpoint_id} and the body {body.checkpoint_id}: give one"
            )
        return await let_go("abort", checkpoint_id, body.reason)

    @app.post("/v1/abort", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def abort(request: AbortRequest | None = None) -> OutcomeModel:
        """Roll back `checkpoint_id`, or (none given) the two-step save waiting here, else whatever
        holds the servers (what `Coordinator.abort()` without a target does: it asks them)."""
        body = request or AbortRequest()
        return await let_go("abort", body.checkpoint_id, body.reason)

    @app.post("/v1/restore", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def restore(request: RestoreRequest | None = None) -> RestoreReply:
        """Verify a snapshot (default `latest`), then restore policy → agents → resources; the
        servers stay paused unless `resume` (then `POST /v1/resume` resumes them)."""
        body = request or RestoreRequest()

        async def restore_step(coord: Coordinator) -> RestoreReply:
            # with `resume`, one attempt that ends only once resumed (recovery finishes it if the
            # service dies on the way), never a restore recorded as done before its resume
            attempt = await coord.restore(body.snapshot, deadline_s=body.deadline_s, resume=body.resume)
            reply = RestoreReply(attempt=AttemptModel.of(attempt, outcome="restored"))
            if attempt.resume_outcome is not None:
                reply.resumed = OutcomeModel.of(attempt.resume_outcome)
            return reply

        reply: RestoreReply = await op("restore", restore_step)
        return reply

    @app.post("/v1/resume", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def resume(request: ResumeRequest | None = None) -> OutcomeModel:
        """Resume `checkpoint_id`, or (none given) whatever holds the servers: a restore, a
        published save's unfinished resume, what a rollback left paused (asked of the servers, as
        `Coordinator.resume()` does). A two-step save waiting here is resumed only when named."""
        checkpoint_id = request.checkpoint_id if request is not None else None
        if checkpoint_id is None:
            return OutcomeModel.of(await op("resume", lambda coord: coord.resume()))
        return await let_go("resume", checkpoint_id, "resumed by request before publication")

    @app.post("/v1/acknowledge", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def acknowledge(request: AcknowledgeRequest) -> AcknowledgeReply:
        """Tell agent `server` the caller now holds these finished results; returns the
        acknowledged set. Claims no operation: it may run while a save is in progress (it may be
        what lets that save prepare). 400 for a server not in the config or without the
        `completed_result_acknowledgement` feature; 409 when the agent refuses (nothing is
        assumed released); 422 for executions Gym would refuse."""
        coord = service.require_coordinator()
        done = await coord.acknowledge_completed(request.server, request.executions)
        return AcknowledgeReply(server=request.server, acknowledged=done)

    @app.get(
        "/v1/status", dependencies=guarded, responses=_ERRORS, tags=["cluster"], response_model=StatusModel
    )
    async def status() -> JSONResponse:
        """Live, read-only: every server's fence, what holds each held one (its kind, since when)
        and the command that frees it — what `quiesce status --json` prints. Claims no operation
        (served while an attempt runs) and records nothing."""
        coord, reader = service.require_observer()
        return JSONResponse(StatusModel.of(await coord.status(ledger=reader)).document())

    @app.get("/v1/snapshots", dependencies=guarded, responses=_ERRORS, tags=["cluster"])
    async def snapshots() -> list[SnapshotModel]:
        """The published snapshots, oldest first, `latest` marking the one `LATEST` names: what
        `quiesce snapshots --json` lists. Reads the snapshots folder only (no ledger, no operation)."""
        from quiesce.coordinator.snapshots import list_published

        listed = await anyio.to_thread.run_sync(list_published, service.config.snapshots)
        return [SnapshotModel.of(info) for info in listed]

    # -- reading the ledger -------------------------------------------------------------------

    @app.get("/v1/attempts", dependencies=guarded, responses=_ERRORS, tags=["ledger"])
    async def attempts(
        limit: Annotated[int, Query(ge=0, description="only the N most recent (0: all)")] = 0,
        outcome: Annotated[str | None, Query(description="an outcome, or `open`")] = None,
        before: Annotated[
            str | None, Query(description="only attempts started before this one (the next page back)")
        ] = None,
    ) -> list[HistoryRow]:
        """The `attempts` projection, oldest first (what `history()` returns); `limit` with
        `before` = the oldest id of a page gives the page before it."""
        reader = service.require_reader()
        anchor = None if before is None else await reader.start_key(before)
        if before is not None and anchor is None:
            raise NotFound(
                f"no attempt {before!r} in the ledger to page back from; GET /v1/attempts lists them"
            )
        # `open` selects attempts without a terminal event; `limit` reads that many index rows
        rows = await reader.attempts(outcome=outcome, limit=limit, before=anchor)
        return [HistoryRow.of(r) for r in rows]

    @app.get(
        "/v1/rollouts",
        dependencies=guarded,
        responses=_ERRORS,
        tags=["ledger"],
        response_model=RolloutsReply,
    )
    async def rollouts(
        rollout: Annotated[
            list[str] | None, Query(description="only this rollout (repeat the parameter for several)")
        ] = None,
        state: Annotated[RolloutState | None, Query(description="only rollouts in this state")] = None,
    ) -> JSONResponse:
        """Each rollout's lineage from the ledger — what `quiesce rollouts --json` prints: every
        rollout by id, or those named (in that order; `unknown` lists ids the ledger never
        recorded), in `state` only if given; `counts` over the rollouts read (every one, or those
        named), `violations` and `warnings` of those shown. Read from the read-only ledger: served
        beside an attempt; named rollouts through the `rollout_refs` projection."""
        from quiesce.ledger.rollout_refs import read_lineage_of
        from quiesce.tools.audit.lineage import chosen, document, unknown

        reader = service.require_reader()
        report = await read_lineage_of(reader, rollout)
        return JSONResponse(document(report, chosen(report, rollout, state), unknown(report, rollout)))

    async def resolved(reader: Ledger, checkpoint_id: str) -> str:
        """`checkpoint_id` itself; `latest`: the attempt in progress, else the ledger's newest (404: none)."""
        from quiesce.tools.audit.source import LATEST_ATTEMPT, resolve_attempt_id

        if checkpoint_id != LATEST_ATTEMPT:
            return checkpoint_id
        current = service.coord.current if service.coord is not None else None
        if current is not None:
            return current.checkpoint_id
        try:
            return await resolve_attempt_id(reader, checkpoint_id)
        except LedgerError:
            raise NotFound("no attempt in the ledger yet, so no latest one") from None

    async def view_of(checkpoint_id: str) -> tuple[Any, list[Any]]:
        from quiesce.tools.audit.source import load_attempt

        reader = service.require_reader()
        checkpoint_id = await resolved(reader, checkpoint_id)
        try:
            return await load_attempt(reader, checkpoint_id)
        except LedgerError as error:
            if await reader.attempt(checkpoint_id) is None:
                raise NotFound(str(error)) from None
            raise

    @app.get("/v1/attempts/{checkpoint_id}", dependencies=guarded, responses=_ERRORS, tags=["ledger"])
    async def show(checkpoint_id: str) -> dict[str, Any]:
        """One attempt explained from the ledger: what `quiesce show ID --json` prints."""
        from quiesce.tools.audit.check import check_events

        view, events = await view_of(checkpoint_id)
        document: dict[str, Any] = view.to_json()
        document["check"] = check_events(events).for_attempt(checkpoint_id).to_json()
        return document

    @app.get(
        "/v1/attempts/{checkpoint_id}/timeline",
        dependencies=guarded,
        responses=_ERRORS,
        response_class=Response,
        tags=["ledger"],
    )
    async def timeline(checkpoint_id: str) -> Response:
        """The attempt's timeline as the report draws it (inline SVG)."""
        from quiesce.tools.audit.report import gantt

        view, _ = await view_of(checkpoint_id)
        return Response(gantt(view), media_type="image/svg+xml")

    def stream(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def last_event_id(value: str | None) -> int:
        """The seq a stream resumes after: 0 without the header; 400 unless it is a seq the ledger
        can hold (a whole number from 0 to `MAX_EVENT_ID`, as the streams send in `id:`)."""
        text = (value or "").strip()
        if not text:
            return 0
        if text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= MAX_EVENT_ID:
            return int(text)
        problem = f"must be an event id this service sent: a whole number from 0 to {MAX_EVENT_ID}"
        raise InvalidHeader(f"header Last-Event-ID: {problem}", [("header.Last-Event-ID", problem)])

    @app.get("/v1/attempts/{checkpoint_id}/events", dependencies=guarded, responses=_ERRORS, tags=["ledger"])
    async def attempt_events(
        checkpoint_id: str, last_event_id_: Annotated[str | None, Header(alias="Last-Event-ID")] = None
    ) -> StreamingResponse:
        """Server-sent events: the attempt's events as the ledger holds them, then live, in seq
        order; `event: end` after its terminal event. Reconnect with `Last-Event-ID`. `latest`: the
        attempt in progress, else the newest one."""
        reader = service.require_reader()
        checkpoint_id = await resolved(reader, checkpoint_id)
        if await reader.attempt(checkpoint_id) is None and not _is_live(service, checkpoint_id):
            raise NotFound(f"no attempt {checkpoint_id!r} in the ledger; GET /v1/attempts lists them")

        async def outcome() -> str | None:
            row = await reader.attempt(checkpoint_id)
            return row.outcome if row is not None else None

        return stream(
            service.hub.tail(
                reader, checkpoint_id=checkpoint_id, after=last_event_id(last_event_id_), outcome=outcome
            )
        )

    @app.get("/v1/events", dependencies=guarded, responses=_ERRORS, tags=["ledger"])
    async def all_events(
        last_event_id_: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    ) -> StreamingResponse:
        """Server-sent events: every event committed from now on (after `Last-Event-ID` if given)."""
        reader = service.require_reader()
        return stream(service.hub.tail(reader, checkpoint_id=None, after=last_event_id(last_event_id_)))

    return app


async def coord_discovery(coord: Coordinator) -> Discovery:
    """The coordinator's last discovery, else a new one."""
    return coord.discovery if coord.discovery is not None else await coord.discover()


def _is_live(service: Service, checkpoint_id: str) -> bool:
    """Whether `checkpoint_id` is the attempt in progress (its `attempt.started` may still be staged)."""
    coord = service.coord
    current = coord.current if coord is not None else None
    return current is not None and current.checkpoint_id == checkpoint_id


__all__ = ["build_app", "error_body", "error_reply", "status_of"]
