"""A hostile front for a real reference Gym server: byte-level misbehaviour on one route.

`hostile_front(upstream, rule)` listens on a loopback port and, for every request on every
connection, forwards it to the real gymsim server `upstream` and relays the reply — except the
first `rule.times` requests whose path ends with `rule.path`, which get `rule.act` instead. The
coordinator is pointed at the front (its config URL for that server), so everything else it does
with that server is real: discovery, the other phases, the rollback's resume.

Acts (each a coroutine that owns the connection until it returns; False closes it):

- `hang` — reads the request and never answers;
- `status_500` — a 500 with a control-error body;
- `status_500_then_drop` — a 500 kept alive, then the connection dropped at the next request;
- `not_json` — a 200 whose body is an HTML page;
- `huge` — a 200 announcing and sending 50 MB;
- `trickle` — the real reply, one byte per second;
- `cut` — the real reply's head and half its body, then the connection closes;
- `endless_chunked` — a 200 with `transfer-encoding: chunked` whose chunks never end;
- `endless_headers` — a status line followed by header lines that never end;
- `rewrite(fn)` — the real reply with its JSON body passed through `fn`;
- `after(fn)` — forwarded, then `fn(request body)` runs (it changes the server's files) before the
  real reply is relayed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.coordinator.helpers import loopback

#: One request as read by the front.
Request = tuple[str, str, dict[str, str], bytes]  # method, target, headers (lowercase names), body
Act = Callable[["Front", anyio.abc.ByteStream, Request], Awaitable[bool]]

HUGE_BYTES = 50 * 2**20
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Rule:
    """Misbehave with `act` on the first `times` requests whose path ends with `path`."""

    path: str
    act: Act
    times: int = 1
    fired: list[str] = field(default_factory=list)  # the targets it fired on


def head(status: int, headers: dict[str, str], reason: str = "X") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def whole(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    return head(status, {"content-type": content_type, "content-length": str(len(body))}) + body


class Front:
    def __init__(self, upstream: str, rule: Rule, http: httpx.AsyncClient) -> None:
        self.upstream = upstream
        self.rule = rule
        self.http = http

    async def real_reply(self, request: Request) -> tuple[int, str, bytes]:
        """(status, content type, body) of the upstream server's reply to `request`."""
        method, target, headers, body = request
        sent = {k: v for k, v in headers.items() if k not in _HOP}
        reply = await self.http.request(method, self.upstream + target, headers=sent, content=body)
        return reply.status_code, reply.headers.get("content-type", "application/json"), reply.content

    async def forward(self, stream: anyio.abc.ByteStream, request: Request) -> bool:
        status, kind, body = await self.real_reply(request)
        await stream.send(whole(status, body, kind))
        return True

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        buffered = BufferedByteReceiveStream(stream)
        async with stream:
            with suppress(
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                anyio.DelimiterNotFound,
                ConnectionError,
            ):
                while True:
                    raw = await buffered.receive_until(b"\r\n\r\n", 1 << 20)
                    lines = raw.decode("latin-1").split("\r\n")
                    method, target, _ = lines[0].split(" ", 2)
                    headers = {}
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                    length = int(headers.get("content-length", "0"))
                    body = await buffered.receive_exactly(length) if length else b""
                    request: Request = (method, target, headers, body)
                    rule = self.rule
                    path = target.split("?", 1)[0]
                    if len(rule.fired) < rule.times and path.endswith(rule.path):
                        rule.fired.append(target)
                        keep = await rule.act(self, stream, request)
                    else:
                        keep = await self.forward(stream, request)
                    if not keep:
                        return


@asynccontextmanager
async def hostile_front(upstream: str, rule: Rule) -> AsyncIterator[str]:
    """Serve the front on a loopback port; yields its base URL."""
    async with httpx.AsyncClient(timeout=60) as http:
        front = Front(upstream, rule, http)
        async with loopback(front.handle) as url:
            yield url


# -- acts ---------------------------------------------------------------------------------------


async def hang(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    await anyio.sleep_forever()
    return False


async def status_500(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    body = json.dumps({"error": {"code": "internal_error", "detail": "the front failed on purpose"}})
    await stream.send(whole(500, body.encode()))
    return True


async def status_500_then_drop(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    """What a FastAPI server does when its error handler itself fails (Gym's agents on a
    non-finite `deadline_ts`): a 500 without `connection: close`, then the connection is closed —
    here only once the client has sent its next request on it, so the client always meets it."""
    await stream.send(whole(500, b"Internal Server Error", "text/plain; charset=utf-8"))
    await stream.receive()
    return False


async def not_json(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    await stream.send(whole(200, b"<html><body>502 Bad Gateway (not JSON)</body></html>", "text/html"))
    return True


async def nested(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    """A 200 whose JSON nests 100,000 levels deep (a RecursionError for a recursive parser)."""
    depth = 100_000
    await stream.send(whole(200, b'{"phase": ' + b"[" * depth + b"]" * depth + b"}"))
    return True


async def lone_surrogate(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    """A 200 whose JSON holds a lone UTF-16 surrogate escape: valid JSON text, no UTF-8 encoding."""
    await stream.send(whole(200, b'{"phase": "paused", "detail": "\\ud800"}'))
    return True


async def surrogate_error(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    """A 409 whose error detail holds a lone surrogate escape (an error text is recorded too)."""
    await stream.send(whole(409, b'{"error": {"code": "invalid_phase", "detail": "bad \\udfff"}}'))
    return True


async def overflow(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    """A 200 with a number no float holds (it would read as infinity, which JSON cannot record)."""
    await stream.send(whole(200, b'{"phase": "paused", "inflight": 1e999}'))
    return True


async def huge(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    await stream.send(head(200, {"content-type": "application/json", "content-length": str(HUGE_BYTES)}))
    chunk = b'{"pad": "' + b"x" * (2**20 - 10)
    for _ in range(HUGE_BYTES // len(chunk)):
        await stream.send(chunk)
    return False


async def trickle(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    status, kind, body = await front.real_reply(request)
    for byte in whole(status, body, kind):
        await stream.send(bytes([byte]))
        await anyio.sleep(1.0)
    return False


async def cut(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    status, kind, body = await front.real_reply(request)
    await stream.send(whole(status, body, kind)[: -max(1, len(body) // 2)])
    return False


async def endless_chunked(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    await stream.send(head(200, {"content-type": "application/json", "transfer-encoding": "chunked"}))
    await stream.send(b"1\r\n{\r\n")
    while True:
        await stream.send(b"40\r\n" + b" " * 64 + b"\r\n")
        await anyio.sleep(0.005)


async def endless_headers(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
    await stream.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    number = 0
    while True:
        number += 1
        await stream.send(f"x-more-{number}: {'y' * 200}\r\n".encode())
        await anyio.sleep(0.001)


def rewrite(fn: Callable[[dict[str, Any]], None]) -> Act:
    async def act(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
        status, kind, body = await front.real_reply(request)
        document = json.loads(body)
        fn(document)
        await stream.send(whole(status, json.dumps(document).encode(), kind))
        return True

    return act


def after(fn: Callable[[dict[str, Any]], None]) -> Act:
    async def act(front: Front, stream: anyio.abc.ByteStream, request: Request) -> bool:
        status, kind, body = await front.real_reply(request)
        await anyio.to_thread.run_sync(fn, json.loads(request[3]))
        await stream.send(whole(status, body, kind))
        return True

    return act
