"""Errors of the service and its client, beside `quiesce.coordinator.errors` (every one is a `QuiesceError`).

- `Busy` (HTTP 409): another attempt or operation is in progress; names it.
- `Unauthorized` (HTTP 401): the API bearer token is missing or wrong.
- `Unavailable` (HTTP 503): this service is a standby (it names the active one's address), still
  recovering, or stopping; or (client side) no service answered.
- `NotFound` (HTTP 404): no such attempt (in the ledger, or awaiting its next step here).
- `InvalidRequest` (HTTP 422): the request's body, path or query did not validate; a `ConfigError`,
  as the embedded API raises for the same bad input. `InvalidHeader` (HTTP 400): a header did
  not (`Last-Event-ID` that is no event id).
- The refusals of `guard`, before any route runs: `MisdirectedHost` (HTTP 421: a `Host` this
  service does not answer to — DNS rebinding), `CrossOrigin` (HTTP 403: another site's page),
  `UnsupportedMediaType` (HTTP 415: a request that changes state without a JSON body),
  `BodyTooLarge` (HTTP 413).
- `OutcomeUnknown`: the connection broke after a request was sent: the client cannot tell whether
  it ran (the ledger can: `history()`).
"""

from __future__ import annotations

from collections.abc import Sequence

from quiesce.coordinator.errors import ConfigError, QuiesceError


class Busy(QuiesceError):
    """One attempt at a time: `checkpoint_id` (if known) and `operation` name what is in progress."""

    def __init__(
        self, message: str, *, checkpoint_id: str | None = None, operation: str | None = None
    ) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.operation = operation


class Unauthorized(QuiesceError):
    """The API bearer token was missing or did not match."""


class Unavailable(QuiesceError):
    """The service cannot take the request now; `active` is the active service's address when known."""

    def __init__(self, message: str, *, state: str | None = None, active: str | None = None) -> None:
        super().__init__(message)
        self.state = state
        self.active = active


class NotFound(QuiesceError):
    """No such attempt."""


class InvalidRequest(ConfigError):
    """The request did not validate; `fields` holds each problem as (where, what), e.g.
    `("body.deadline_s", "must be more than 0")`; the message joins them."""

    def __init__(self, message: str, fields: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.fields = list(fields)


class InvalidHeader(InvalidRequest):
    """A request header did not validate; `fields` names it as `header.NAME`."""


class MisdirectedHost(QuiesceError):
    """The request's `Host` is not one this service answers to."""


class CrossOrigin(QuiesceError):
    """The request's `Origin` is not the service's own."""


class UnsupportedMediaType(QuiesceError):
    """A request that changes state came without `Content-Type: application/json`."""


class BodyTooLarge(QuiesceError):
    """The request's body is larger than the service reads."""


class OutcomeUnknown(QuiesceError):
    """The connection to the service broke while a request was in flight."""
