"""Run the service: bind `--listen`, serve with uvicorn, stop cleanly on SIGTERM or SIGINT.

- The socket is bound before anything else, so `--listen 127.0.0.1:0` works: the address actually
  bound is printed on stdout once the service is taking requests (or waiting as a standby) — with
  `as_json`, as one JSON line (`{"listening": "http://127.0.0.1:41234", ...}`).
- Listening beyond loopback needs `QUIESCE_API_TOKEN` (`auth.require_token_beyond_loopback`).
- The app answers only to the hosts of the address bound, of `advertise`, and those allowed
  (`allow_hosts` and `QUIESCE_ALLOW_HOSTS`; `hosts.ServedHosts`); a malformed entry is a
  `ConfigError` before anything is bound.
- uvicorn's own signal handling is replaced: on SIGTERM (or SIGINT) the service stops first
  (`Service.stop`: no new operation, the one in progress finishes or rolls back within its
  deadline, a waiting two-step save is settled, the lease released), and only then does uvicorn
  close its connections and exit. A second signal does not cut that short: servers must not be
  left paused. `serve` returns 0 after a clean stop and raises what made the service fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence

import anyio
import uvicorn

from quiesce.coordinator import ClusterConfig
from quiesce.coordinator.errors import ConfigError, QuiesceError
from quiesce.tools.serve.app import build_app
from quiesce.tools.serve.auth import api_token_from_env, require_token_beyond_loopback
from quiesce.tools.serve.hosts import ServedHosts, allowed_hosts_from_env
from quiesce.tools.serve.listen import parse_listen
from quiesce.tools.serve.service import Service


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers (the runner decides when to stop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    config: ClusterConfig,
    listen: str,
    *,
    advertise: str | None = None,
    as_json: bool = True,
    config_path: str | None = None,
    allow_hosts: Sequence[str] = (),
) -> int:
    """Serve until SIGTERM/SIGINT (see the module docstring); the exit status."""
    host, port = parse_listen(listen)
    api_token = api_token_from_env()
    require_token_beyond_loopback(host, api_token)
    allowed = [*allow_hosts, *allowed_hosts_from_env()]
    ServedHosts.of(host, port, advertise=advertise, allowed=allowed)  # a bad entry: before the bind
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it a keep-alive reply written in two parts waits ~40 ms for a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"--listen {listen}: cannot bind ({error.strerror}); choose another port") from None
    sock.listen(128)
    sock.setblocking(False)
    bound_port = sock.getsockname()[1]
    bound = _url(host, bound_port)
    service = Service(config, advertise=advertise or bound, config_path=config_path)
    hosts = ServedHosts.of(host, bound_port, advertise=advertise, allowed=allowed)
    server = _Server(
        uvicorn.Config(
            build_app(service, api_token=api_token, hosts=hosts),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
        )
    )
    with sock:
        async with anyio.create_task_group() as tg:
            await tg.start(service.serve)
            tg.start_soon(_announce, service, bound, api_token is not None, as_json)
            tg.start_soon(_stop_on_signal, service)
            tg.start_soon(_exit_when_finished, service, server)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    if service.failure is not None:
        if isinstance(service.failure, QuiesceError):
            raise service.failure
        raise RuntimeError(f"quiesce serve failed: {service.failure!r}") from service.failure
    return 0


async def _exit_when_finished(service: Service, server: uvicorn.Server) -> None:
    await service.finished.wait()
    server.should_exit = True


async def _announce(service: Service, url: str, authenticated: bool, as_json: bool) -> None:
    """Print the address once the service takes requests or waits as a standby."""
    await service.settled.wait()
    if service.state == "stopped":
        return  # it failed to start: the error is raised once the server has stopped
    if as_json:
        line = {"listening": url, "state": service.state, "auth": authenticated, "pid": os.getpid()}
        sys.stdout.write(json.dumps(line) + "\n")
    else:
        sys.stdout.write(
            f"serving {url} ({service.state}{', API token required' if authenticated else ''})\n"
        )
    sys.stdout.flush()


async def _stop_on_signal(service: Service) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            service.stop()
