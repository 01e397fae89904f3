"""The names the service answers to (`Host`) and the one origin it trusts (`Origin`).

These rules stop a web page from driving the service through the operator's browser:

- **DNS rebinding.** A request's `Host` must name the address served — the `--listen` host at
  the bound port (a loopback address also as `localhost`; a wildcard address, `0.0.0.0` or `::`,
  as any IP address, `localhost`, this machine's host name and its fully qualified name), the
  `--advertise` URL's host and port, or a host the operator allows (`QUIESCE_ALLOW_HOSTS`,
  separated by commas or spaces: `NAME` at any port, or `NAME:PORT`). A name another site's DNS
  points at this address (`evil.example`) is none of these, so its page cannot reach the service
  even from the same origin as itself.
- **Cross-origin requests.** An `Origin` header, when sent, must be the service's own: scheme
  http or https, and the host and port of the request's (allowed) `Host`, each port defaulting
  by its scheme. `null`, another host, another port, anything malformed: cross-origin.
- Names compare without regard to case; IP addresses by value (`[::1]`, `::1` and
  `0:0:0:0:0:0:0:1` are one address). Nothing here reads or writes the network.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from quiesce.coordinator.errors import ConfigError

__all__ = [
    "ALLOW_HOSTS_ENV",
    "Authority",
    "ServedHosts",
    "allowed_hosts_from_env",
    "parse_authority",
    "same_origin",
]

ALLOW_HOSTS_ENV: Final = "QUIESCE_ALLOW_HOSTS"
_NAME: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?")
_DEFAULT_PORT: Final = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Authority:
    """A host (lower case; an IP address in its canonical form, without brackets) and a port
    (None: not given)."""

    host: str
    port: int | None

    @property
    def is_ip(self) -> bool:
        return _ip(self.host) is not None

    def shown(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _host(text: str) -> str | None:
    """`text` as a canonical host, or None when it is neither an IP address nor a DNS name."""
    address = _ip(text)
    if address is not None:
        return str(address)
    name = text.lower()
    return name if len(name) <= 253 and _NAME.fullmatch(name) else None


def parse_authority(text: str, *, bare_ipv6: bool = False) -> Authority | None:
    """`HOST`, `HOST:PORT`, `[IPv6]` or `[IPv6]:PORT` (with `bare_ipv6`, also `::1`); None when
    malformed."""
    text = text.strip()
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or ":" not in inside or (rest and not rest.startswith(":")):
            return None
        host, port_text = inside, rest[1:] if rest else None
    elif bare_ipv6 and text.count(":") > 1:
        host, port_text = text, None
    else:
        host, colon, port = text.partition(":")
        port_text = port if colon else None
    canonical = _host(host)
    if canonical is None:
        return None
    if port_text is None:
        return Authority(canonical, None)
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5 or int(port_text) > 65535:
        return None
    return Authority(canonical, int(port_text))


def allowed_hosts_from_env() -> list[str]:
    """The hosts `QUIESCE_ALLOW_HOSTS` allows (commas or spaces between them), as written."""
    return [part for part in re.split(r"[,\s]+", os.environ.get(ALLOW_HOSTS_ENV, "")) if part]


@dataclass
class ServedHosts:
    """The `Host` values one service answers to (see the module docstring)."""

    port: int
    #: names served at `port` only
    names: set[str] = field(default_factory=set)
    #: whether any IP address at `port` is served (a wildcard listen address)
    any_ip: bool = False
    #: (host, port) pairs served exactly: the advertised URL, `NAME:PORT` entries
    exact: set[Authority] = field(default_factory=set)
    #: names served at any port (`NAME` entries)
    any_port: set[str] = field(default_factory=set)

    @classmethod
    def of(
        cls, listen_host: str, port: int, *, advertise: str | None = None, allowed: Iterable[str] = ()
    ) -> ServedHosts:
        """The hosts served by a socket bound to `listen_host`:`port`; `ConfigError` naming an
        allowed entry that is not `NAME` or `NAME:PORT`."""
        served = cls(port)
        bound = listen_host.strip("[]")
        address = _ip(bound)
        if address is not None and address.is_unspecified:
            served.any_ip = True
            served.names.update(
                h for h in (_host(n) for n in ("localhost", socket.gethostname(), socket.getfqdn())) if h
            )
        elif address is not None:
            served.names.add(str(address))
            if address.is_loopback:
                served.names.add("localhost")
        elif (name := _host(bound)) is not None:
            served.names.add(name)
            if name == "localhost":
                served.names.update(("127.0.0.1", "::1"))
        if advertise:
            parts = urlsplit(advertise)
            found = parse_authority(parts.netloc.rpartition("@")[2])
            if found is not None:
                port_ = found.port if found.port is not None else _DEFAULT_PORT.get(parts.scheme, 80)
                served.exact.add(Authority(found.host, port_))
        for entry in allowed:
            parsed = parse_authority(entry, bare_ipv6=True)
            if parsed is None:
                raise ConfigError(
                    f"{ALLOW_HOSTS_ENV}: {entry!r} is not a host; give NAME or NAME:PORT"
                    " (e.g. quiesce.example or quiesce.example:443), several separated by commas"
                )
            if parsed.port is None:
                served.any_port.add(parsed.host)
            else:
                served.exact.add(parsed)
        return served

    @classmethod
    def loopback(cls) -> ServedHosts:
        """`localhost`, `127.0.0.1` and `::1` at any port: what a socket on a loopback address
        serves when its port is not known here."""
        return cls(0, any_port={"localhost", "127.0.0.1", "::1"})

    def allows(self, host_header: str | None) -> bool:
        """Whether a request with this `Host` header is addressed to this service."""
        found = parse_authority(host_header) if host_header else None
        if found is None:
            return False
        if found.host in self.any_port:
            return True
        if any(a.host == found.host and _same_port(found.port, a.port) for a in self.exact):
            return True
        if not _same_port(found.port, self.port):
            return False
        return found.host in self.names or (self.any_ip and found.is_ip)

    def describe(self) -> str:
        """The hosts served, for a refusal's message."""
        shown = sorted(Authority(n, self.port).shown() for n in self.names)
        if self.any_ip:
            shown.insert(0, f"any IP address:{self.port}")
        shown += sorted(a.shown() for a in self.exact) + sorted(self.any_port)
        return ", ".join(dict.fromkeys(shown))


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether `origin` (an `Origin` header) is the origin of a page this service served under
    `host_header` (see the module docstring)."""
    scheme, sep, rest = origin.strip().partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _DEFAULT_PORT or not host_header:
        return False
    if any(c in rest for c in "/?#@"):
        return False
    theirs, ours = parse_authority(rest), parse_authority(host_header)
    if theirs is None or ours is None or theirs.host != ours.host:
        return False
    default = _DEFAULT_PORT[scheme]
    return (theirs.port or default) == (ours.port or default)


def _same_port(given: int | None, served: int | None) -> bool:
    """A `Host` without a port names the default port of the scheme its client used: 80, or 443
    through a proxy that terminates TLS."""
    return given == served or (given is None and served in (80, 443))
