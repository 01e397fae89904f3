"""The service's own API token: `QUIESCE_API_TOKEN`, sent as `Authorization: Bearer <token>`.

Rules kept here:
- The token is read from the environment once, at start, and never stored, logged or echoed: a
  refusal says only that the token was missing or wrong.
- The comparison is constant-time (`hmac.compare_digest` over the UTF-8 bytes).
- Without a token the service answers only on loopback: listening on any other address without
  one is a `ConfigError` before anything is bound (`require_token_beyond_loopback`).
- It is not the Gym control token (`token_env` of the cluster config); the two are never mixed.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Final

from quiesce.coordinator.errors import ConfigError

API_TOKEN_ENV: Final = "QUIESCE_API_TOKEN"


def api_token_from_env() -> str | None:
    """The API token, or None when `QUIESCE_API_TOKEN` is unset or empty."""
    value = os.environ.get(API_TOKEN_ENV, "")
    return value or None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_token_beyond_loopback(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without an API token."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"--listen {host}: listening beyond loopback needs an API token; set {API_TOKEN_ENV} in the"
            " environment (clients send it as `Authorization: Bearer ...`), or listen on 127.0.0.1"
        )


class BearerCheck:
    """Checks an `Authorization` header against the API token (anything passes without a token)."""

    __slots__ = ("_expected",)

    def __init__(self, token: str | None) -> None:
        self._expected = token.encode("utf-8") if token else None

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def allows(self, header: str | None) -> bool:
        if self._expected is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False  # says nothing about the token
        return hmac.compare_digest(given.strip().encode("utf-8"), self._expected)
