"""The `--listen HOST:PORT` rules of `quiesce serve`, apart from the server itself.

Rule: this module imports nothing beyond quiesce's errors, so `quiesce --help` and a bad
`--listen` are answered on a base install, without the `serve` extra (uvicorn's server,
prometheus_client) being loaded or even installed.
"""

from __future__ import annotations

from typing import Final

from quiesce.coordinator.errors import ConfigError

DEFAULT_LISTEN: Final = "127.0.0.1:8470"


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) → (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:8470 (port 0: any free port)")
    return host.strip("[]"), int(port)
