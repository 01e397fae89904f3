"""FastAPI's request validation errors, as the service's own error reply.

Rules kept here:
- A request whose body, path or query does not validate gets HTTP 422 and the same shape as every
  other error: `{"error": {"type": "InvalidRequest", "message": ..., "fields": [...]}}`.
- Each problem is `{"field": "body.deadline_s", "problem": "must be more than 0"}` (list items
  as `[0]`); `message` joins them with `; `.
- Nothing the caller sent is repeated: pydantic's `input`, `ctx`, `url` and `type` are dropped,
  and a secret given (the API token) is masked even in a field name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from quiesce.coordinator.wording import field_path, plain
from quiesce.tools.serve.errors import InvalidRequest

__all__ = ["invalid_request"]

_OBJECT_TYPES: Final = frozenset({"model_attributes_type", "model_type", "dict_type"})


def _problem(error: dict[str, Any]) -> tuple[str, str]:
    kind, loc = error.get("type"), list(error.get("loc") or ())
    if kind == "json_invalid":  # loc: ("body", character offset); ctx: the decoder's reason
        at = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        reason = (error.get("ctx") or {}).get("error")
        where = f" at character {at}" if at is not None else ""
        return "body", f"not valid JSON{where}" + (f": {reason}" if isinstance(reason, str) else "")
    if kind in _OBJECT_TYPES:
        return field_path(loc), "must be a JSON object"
    if kind == "extra_forbidden":
        return field_path(loc), "not a field of this request"
    return field_path(loc), plain(str(error.get("msg", "invalid")))  # a validator may nest pydantic's


def _masked(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def invalid_request(errors: Sequence[Any], *, secrets: Sequence[str] = ()) -> InvalidRequest:
    """The `InvalidRequest` FastAPI's validation `errors` (`RequestValidationError.errors()`) stand for."""
    secrets = [s for s in secrets if s]
    fields = [
        (_masked(where, secrets), _masked(what, secrets))
        for where, what in (_problem(e) if isinstance(e, dict) else ("request", "invalid") for e in errors)
    ] or [("request", "invalid")]
    return InvalidRequest("; ".join(f"{where}: {what}" for where, what in fields), fields)
