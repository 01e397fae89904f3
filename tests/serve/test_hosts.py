"""The names the service answers to and the origin it trusts (`tools/serve/hosts.py`), narrow.

- `Host` parsing: names, IPv4, bracketed IPv6, ports; anything else (a path, a user, a bare IPv6,
  a port past 65535, an empty name) is malformed;
- what a bound address serves: a loopback address also as `localhost`, a wildcard address any IP
  literal and `localhost` but no other name, a named host itself; always at the bound port; the
  advertised URL exactly; `QUIESCE_ALLOW_HOSTS` entries at any port (`NAME`) or one (`NAME:PORT`);
- `Origin`: http or https with the request's host and port (default ports by scheme) is the
  service's own; `null`, another host or port, a path or user part are not;
- a malformed `QUIESCE_ALLOW_HOSTS` stops `quiesce serve` before it binds (exit 2, one line).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.coordinator import ConfigError
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from quiesce.tools.serve.hosts import ALLOW_HOSTS_ENV, Authority, ServedHosts, parse_authority, same_origin


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:8470", Authority("127.0.0.1", 8470)),
        ("LocalHost", Authority("localhost", None)),
        ("[::1]:80", Authority("::1", 80)),
        ("[0:0:0:0:0:0:0:1]", Authority("::1", None)),
        ("quiesce-1.example.org:443", Authority("quiesce-1.example.org", 443)),
        ("", None),
        (":8470", None),
        ("::1", None),  # an IPv6 address in a Host is bracketed
        ("evil.example/x", None),
        ("user@evil.example", None),
        ("evil.example:65536", None),
        ("evil.example:80x", None),
        ("evil..example", Authority("evil..example", None)),  # a name never served, not an error
        ("-evil", None),
        ("[::1", None),
        ("[::1]x", None),
    ],
)
def test_host_parsing(text: str, parsed: Authority | None) -> None:
    assert parse_authority(text) == parsed


def test_what_a_bound_address_serves() -> None:
    loop = ServedHosts.of("127.0.0.1", 8470)
    assert [h for h in ("127.0.0.1:8470", "localhost:8470", "LOCALHOST:8470") if loop.allows(h)] == [
        "127.0.0.1:8470",
        "localhost:8470",
        "LOCALHOST:8470",
    ]
    for refused in ("127.0.0.1:8471", "127.0.0.1", "[::1]:8470", "evil.example:8470", "10.0.0.5:8470", None):
        assert not loop.allows(refused), refused

    six = ServedHosts.of("[::1]", 8470)
    assert six.allows("[::1]:8470")
    assert six.allows("[0::1]:8470")
    assert six.allows("localhost:8470")
    assert not six.allows("127.0.0.1:8470")

    anywhere = ServedHosts.of("0.0.0.0", 8470)
    for allowed in ("10.0.0.5:8470", "[fe80::1]:8470", "localhost:8470"):
        assert anywhere.allows(allowed), allowed
    for refused in ("10.0.0.5:9000", "evil.example:8470"):
        assert not anywhere.allows(refused), refused

    named = ServedHosts.of(
        "node-7.cluster.internal",
        80,
        advertise="https://q.example",
        allowed=["proxy.example", "tunnel.example:9000", "[::2]:1"],
    )
    for allowed in ("node-7.cluster.internal", "node-7.cluster.internal:80", "q.example", "q.example:443",
                    "proxy.example:1234", "proxy.example", "tunnel.example:9000", "[::2]:1"):  # fmt: skip
        assert named.allows(allowed), allowed
    for refused in ("q.example:8470", "tunnel.example:9001", "localhost:80", "[::2]:2", "evil.example"):
        assert not named.allows(refused), refused
    assert "tunnel.example:9000" in named.describe()

    harness = ServedHosts.loopback()  # a harness binding its own loopback socket, port unknown here
    assert harness.allows("127.0.0.1:41234")
    assert harness.allows("localhost")
    assert not harness.allows("evil.example:41234")


def test_a_malformed_allowed_host_is_a_config_error() -> None:
    for entry in ("http://quiesce.example", "quiesce.example/", "a b", "x:99999"):
        with pytest.raises(ConfigError, match=ALLOW_HOSTS_ENV):
            ServedHosts.of("127.0.0.1", 8470, allowed=[entry])
    assert ServedHosts.of("127.0.0.1", 1, allowed=["::1"]).allows("[::1]:5")  # bare IPv6: any port


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8470", "127.0.0.1:8470", True),
        ("http://LOCALHOST:8470", "localhost:8470", True),
        ("https://quiesce.example", "quiesce.example", True),
        ("http://quiesce.example:80", "quiesce.example", True),
        ("https://quiesce.example:443", "quiesce.example", True),
        ("http://[::1]:8470", "[::1]:8470", True),
        ("http://127.0.0.1:8471", "127.0.0.1:8470", False),
        ("http://localhost:8470", "127.0.0.1:8470", False),
        ("http://evil.example", "127.0.0.1:8470", False),
        ("null", "127.0.0.1:8470", False),
        ("file://", "127.0.0.1:8470", False),
        ("http://127.0.0.1:8470/", "127.0.0.1:8470", False),
        ("http://user@127.0.0.1:8470", "127.0.0.1:8470", False),
        ("ws://127.0.0.1:8470", "127.0.0.1:8470", False),
        ("http://127.0.0.1:8470", None, False),
    ],
)
def test_the_services_own_origin(origin: str, host: str | None, same: bool) -> None:
    assert same_origin(origin, host) is same


def test_serve_refuses_a_malformed_allowed_host_before_binding(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, token: str
) -> None:
    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps")
    env = {k: v for k, v in os.environ.items() if k != "QUIESCE_API_TOKEN"}
    env.update({"PYTHONPATH": str(IMPORT_ROOT), TOKEN_ENV: token, ALLOW_HOSTS_ENV: "ok.example, http://x"})
    done = subprocess.run(
        [sys.executable, "-m", "quiesce", "serve", "--config", str(config), "--listen", "127.0.0.1:0"],
        cwd=str(IMPORT_ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert ALLOW_HOSTS_ENV in done.stderr
    assert "'http://x'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not Path(sqlite_url.removeprefix("sqlite+aiosqlite:///")).exists()  # nothing was opened
