"""A tiny loopback HTTP server for measure #2: ``python -m quiesce.tools.bench.tinyserver PORT_FILE``.

uvicorn serving a bare ASGI app: every request gets one fixed, valid control-plane reply (an
agent ``prepare`` reply), with ``Content-Length``, after its body is read. The listening socket is
made with ``proto=IPPROTO_TCP`` so that asyncio sets ``TCP_NODELAY`` on every connection. The
chosen port is written to ``PORT_FILE`` once the server accepts connections; it stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

REPLY = json.dumps(
    {"state": "prepared", "ready_to_commit": True, "running": 0, "parked": 3, "active": 3}
).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message: Any = await receive()
        more = bool(message.get("more_body"))
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": REPLY})


async def serve(port_file: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    tmp = Path(f"{port_file}.tmp")
    tmp.write_text(str(sock.getsockname()[1]), encoding="ascii")  # noqa: ASYNC240 - tiny, once
    os.replace(tmp, port_file)
    await task


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
