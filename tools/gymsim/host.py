"""Hosting reference servers in one process: own ports, or path prefixes on one shared port.

A server with `prefix: false` gets its own loopback port (`http://127.0.0.1:PORT`);
servers with `prefix: true` share one port and live under `/s/<name>`
(`http://127.0.0.1:PORT/s/agent_17`), so hundreds of participants fit in one
process. All servers of a process run in one event loop; sockets are bound before
anything starts, so URLs are known up front and no port can be taken in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from quiesce.tools.gymsim.agent import AgentServer
from quiesce.tools.gymsim.base import GymServer, HostContext
from quiesce.tools.gymsim.faults import install_log_filter
from quiesce.tools.gymsim.model import ModelServer
from quiesce.tools.gymsim.resources import ResourcesServer
from quiesce.tools.gymsim.spec import ClusterSpec, ServerSpec
from quiesce.tools.gymsim.v2 import V2_KINDS
from quiesce.tools.gymsim.v2.server import V2Server

PREFIX_ROOT = "/s/"
_KINDS: dict[str, type[GymServer]] = {
    "model": ModelServer,
    "agent": AgentServer,
    "resources": ResourcesServer,
}


#: What a host serves: a v1 `GymServer` or a v2 `V2Server` (both expose name, spec, asgi, aclose).
Hosted = GymServer | V2Server


def make_server(spec: ServerSpec, ctx: HostContext) -> GymServer:
    """A v1 server (plane v1)."""
    return _KINDS[spec.kind](spec, ctx)


def make_v2_server(spec: ServerSpec, ctx: HostContext) -> V2Server:
    """A v2 server (plane v2: `tools/gymsim/v2`)."""
    return V2_KINDS[spec.kind](spec, ctx)


def make_hosted(spec: ServerSpec, ctx: HostContext) -> Hosted:
    """The server of `spec`'s plane (looked up by module attribute, so a test may wrap either maker)."""
    if spec.plane == "v2":
        return make_v2_server(spec, ctx)
    return make_server(spec, ctx)


class PrefixRouter:
    """Dispatch `/s/<name>/...` to that server's app (the prefix moves into `root_path`)."""

    def __init__(self, apps: dict[str, ASGIApp]) -> None:
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path: str = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and path.startswith(PREFIX_ROOT):
            name = path[len(PREFIX_ROOT) :].split("/", 1)[0]
            app = self.apps.get(name)
            if app is not None:
                root = scope.get("root_path", "") + PREFIX_ROOT + name
                await app({**scope, "root_path": root}, receive, send)
                return
        await PlainTextResponse("no such gymsim server", status_code=404)(scope, receive, send)


class _Current:
    """The ASGI app of whichever server is named `name` now: a restart swaps the server behind it."""

    def __init__(self, servers: dict[str, Hosted], name: str) -> None:
        self.servers = servers
        self.name = name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.servers[self.name].asgi(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the host decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind_listener(host: str) -> socket.socket:
    """A non-blocking listening TCP socket on a free port of `host`, for uvicorn's `sockets=`.

    proto=IPPROTO_TCP matters (see below); every loopback test server should bind with this."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket's proto is IPPROTO_TCP (proto 0 is not), and without it every reply written in
    # several pieces (headers, body) waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Host:
    """Every server of a `ClusterSpec`, bound to loopback sockets, served from one event loop."""

    def __init__(self, spec: ClusterSpec, *, token: str | None) -> None:
        self.spec = spec
        self.ctx = HostContext(token=token)
        self.hosted: dict[str, Hosted] = {}
        self.urls: dict[str, str] = {}
        self._sockets: list[tuple[socket.socket, ASGIApp]] = []
        self._uvicorns: list[_Server] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.ctx.restart = self.restart
        prefixed: dict[str, ASGIApp] = {}
        expanded = spec.expanded()
        for server_spec in expanded:
            self.hosted[server_spec.name] = make_hosted(server_spec, self.ctx)
        shared: socket.socket | None = None
        for server_spec in expanded:
            server = self.hosted[server_spec.name]
            if server_spec.prefix:
                if shared is None:
                    shared = bind_listener(spec.host)
                prefixed[server.name] = _Current(self.hosted, server.name)
                port = shared.getsockname()[1]
                self.urls[server.name] = f"http://{spec.host}:{port}{PREFIX_ROOT}{server.name}"
            else:
                sock = bind_listener(spec.host)
                self._sockets.append((sock, _Current(self.hosted, server.name)))
                self.urls[server.name] = f"http://{spec.host}:{sock.getsockname()[1]}"
        if shared is not None:
            self._sockets.append((shared, PrefixRouter(prefixed)))
        self.ctx.peers.update(self.urls)
        self.ctx.instances.update((s.name, s.instance_name) for s in expanded)

    @property
    def servers(self) -> dict[str, GymServer]:
        """The v1 servers of this host, by name."""
        return {name: s for name, s in self.hosted.items() if isinstance(s, GymServer)}

    @property
    def v2_servers(self) -> dict[str, V2Server]:
        """The v2 servers of this host, by name."""
        return {name: s for name, s in self.hosted.items() if isinstance(s, V2Server)}

    async def serve(self, on_started: Callable[[], None] | None = None) -> None:
        """Serve until `stop()`; call `on_started` once every socket accepts connections."""
        install_log_filter()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for _sock, app in self._sockets:
            config = uvicorn.Config(
                app,
                lifespan="off",
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=1,
                timeout_keep_alive=30,
                backlog=2048,
                proxy_headers=False,  # never behind a proxy: no X-Forwarded-* rewriting per request
            )
            self._uvicorns.append(_Server(config))
        tasks = [
            asyncio.create_task(server.serve(sockets=[sock]))
            for server, (sock, _) in zip(self._uvicorns, self._sockets, strict=True)
        ]
        try:
            while not all(server.started for server in self._uvicorns):
                failed = [t for t in tasks if t.done()]
                if failed:
                    failed[0].result()
                    raise RuntimeError("a gymsim listener exited during startup")
                await asyncio.sleep(0.01)
            if on_started is not None:
                on_started()
            await self._stop.wait()
        finally:
            for server in self.hosted.values():
                await server.aclose()
            await asyncio.gather(*self._closing, return_exceptions=True)
            for listener in self._uvicorns:
                listener.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.ctx.http.aclose()
            for sock, _ in self._sockets:
                sock.close()

    def restart(self, name: str) -> None:
        """Replace server `name` by a fresh one built from its spec, as a restarted process comes
        back: same URL, idle fence, open admission, nothing of its old state. The old one stops its
        background work (its rollouts die with it). Call from the host's event loop."""
        old = self.hosted[name]
        self.hosted[name] = make_hosted(old.spec, self.ctx)
        task = asyncio.get_running_loop().create_task(old.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def stop(self) -> None:
        """Ask `serve()` to shut down; safe from any thread."""
        loop, event = self._loop, self._stop
        if loop is None or event is None:
            return
        if loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(event.set)
