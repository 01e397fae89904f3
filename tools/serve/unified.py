"""The service's routes of Gym's unified plane: `POST /v1/retire` and `POST /v1/forget`.

Rules:
- Each is one `Service.run` operation (409 `Busy` while another runs), behind the API token like
  every mutating route (`build_app` includes `router` with its bearer check).
- Bodies are validated first (`RetireRequest`, `ForgetRequest`: unknown fields, no episode, an id
  Gym refuses → 422 `InvalidRequest`, nothing sent).
- The refusals are the embedded API's: a v1 cluster, or a save of this service still open (the
  two-step save awaiting its caller: the request is handed to the coordinator as that attempt's
  step, and it refuses naming it) → 409 with its message; a server that failed → 502 `PhaseError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from quiesce.coordinator import Coordinator, RetireOutcome
from quiesce.tools.serve.models import ForgetRequest, RetireReply, RetireRequest
from quiesce.tools.serve.service import Service

__all__ = ["router"]

router = APIRouter(tags=["cluster"])


def service_of(request: Request) -> Service:
    """The app's `Service` (`build_app` puts it on `app.state`)."""
    service: Service = request.app.state.service
    return service


Served = Annotated[Service, Depends(service_of)]


async def _operation(
    service: Service, name: str, fn: Callable[[Coordinator], Awaitable[RetireOutcome]]
) -> RetireReply:
    """Run `fn` as one operation. While a two-step save awaits its caller the operation is claimed
    as that attempt's step, so the coordinator — not `Busy` — says why it cannot run now."""
    pending = service.pending
    outcome = await service.run(name, fn, attempt_id=pending.checkpoint_id if pending is not None else None)
    return RetireReply.of(outcome)


@router.post("/v1/retire")
async def retire(request: RetireRequest, service: Served) -> RetireReply:
    """Retire these attempts on every server (environment → agent → model and resources): each stops
    them and every earlier attempt of their rollouts, and refuses them (`stale_attempt`) until they
    are forgotten. 409 on a v1 cluster or while a save is open (resume first); 502 naming each
    server that failed (retire again once fixed: it is idempotent)."""
    return await _operation(
        service, "retire", lambda coord: coord.retire(request.episodes, deadline_s=request.deadline_s)
    )


@router.post("/v1/forget")
async def forget(request: ForgetRequest, service: Served) -> RetireReply:
    """Drop the retire marks of these rollouts on every server (once a rollout is finished for good),
    in the same order, with the same refusals as `/v1/retire`."""
    return await _operation(
        service, "forget", lambda coord: coord.forget(request.rollout_ids, deadline_s=request.deadline_s)
    )
