"""coordinator/http.py against real loopback servers: framing, keep-alive, limits, failures, TLS.

The servers are raw sockets (anyio listeners) so each test controls every byte of the reply;
calls.py's error classes over this client are tested in test_publish_calls.py, and every real
save in the suite goes through it to uvicorn servers.
"""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from quiesce.coordinator import http
from quiesce.coordinator.http import (
    MAX_HEAD_BYTES,
    BadReply,
    ConnectFailed,
    ConnectionLost,
    HttpClient,
    Reply,
    ReplyTimeout,
    _origin_and_target,
)
from tests.coordinator.helpers import loopback

pytestmark = pytest.mark.anyio

Answer = Callable[[int, bytes, bytes], Awaitable[bytes | None]]


@dataclass
class Served:
    url: str
    connections: int = 0
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (connection, head, body)


async def get(client: HttpClient, url: str, timeout_s: float = 5, max_body: int = 99) -> Reply:
    return await client.request("GET", url, headers={}, body=None, timeout_s=timeout_s, max_body=max_body)


def reply(status: int, body: bytes, *extra: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@asynccontextmanager
async def serve(answer: Answer, *, tls: ssl.SSLContext | None = None) -> AsyncIterator[Served]:
    """A loopback server: for each request on a connection, sends `answer(connection, head, body)`;
    None closes the connection instead."""
    served = Served("")

    async def handle(stream: anyio.abc.ByteStream) -> None:
        served.connections += 1
        number = served.connections
        buffered = BufferedByteReceiveStream(stream)
        async with stream:
            with suppress(anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                          anyio.ClosedResourceError, ssl.SSLError):  # fmt: skip
                while True:
                    head = await buffered.receive_until(b"\r\n\r\n", 1 << 20)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    body = await buffered.receive_exactly(length) if length else b""
                    served.requests.append((number, head, body))
                    out = await answer(number, head, body)
                    if out is None:
                        return
                    await stream.send(out)

    async with loopback(handle, tls=tls) as url:
        served.url = url
        yield served


async def test_requests_share_one_keep_alive_connection_and_are_framed() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b'{"n": %d}' % len(body))

    client = HttpClient()
    try:
        async with serve(answer) as served:
            first = await client.request(
                "POST",
                served.url + "/a/b?x=1",
                headers={"Authorization": "Bearer t"},
                body=b'{"k":1}',
                timeout_s=5,
                max_body=1000,
            )
            second = await get(client, served.url + "/c", 5, 1000)
    finally:
        await client.aclose()
    assert (first.status, first.body, first.too_big) == (200, b'{"n": 7}', False)
    assert second.body == b'{"n": 0}'
    assert served.connections == 1
    (c1, head1, body1), (c2, head2, _) = served.requests
    assert (c1, c2) == (1, 1)
    lines = head1.split(b"\r\n")
    assert lines[0] == b"POST /a/b?x=1 HTTP/1.1"
    assert f"Host: {served.url.removeprefix('http://')}".encode() in lines
    assert b"Authorization: Bearer t" in lines
    assert b"Content-Length: 7" in lines
    assert body1 == b'{"k":1}'
    assert head2.split(b"\r\n")[0] == b"GET /c HTTP/1.1"
    assert b"content-length" not in head2.lower()


async def test_a_reply_that_closes_is_not_reused_and_a_hung_up_connection_is_replaced() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes | None:
        if b"/close" in head:
            return reply(200, b"{}", "connection: close")
        if b"/hangup" in head:
            return None
        return reply(200, b"{}")

    client = HttpClient()
    try:
        async with serve(answer) as served:
            await get(client, served.url + "/close", 5, 99)
            await get(client, served.url + "/keep", 5, 99)
            assert served.connections == 2  # the first said close: a new connection
            with pytest.raises(ConnectionLost):  # the server hangs up instead of replying
                await get(client, served.url + "/hangup", 5, 99)
            done = await get(client, served.url + "/keep", 5, 99)
    finally:
        await client.aclose()
    assert done.status == 200
    assert served.connections == 3
    assert [n for n, _, _ in served.requests] == [1, 2, 2, 3]


async def test_a_connection_idle_too_long_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b"{}")

    monkeypatch.setattr(http, "IDLE_REUSE_S", 0.05)
    client = HttpClient()
    try:
        async with serve(answer) as served:
            await get(client, served.url + "/")
            await get(client, served.url + "/")  # at once: reused
            await anyio.sleep(0.2)
            await get(client, served.url + "/")  # idle too long: a new connection
    finally:
        await client.aclose()
    assert [n for n, _, _ in served.requests] == [1, 1, 2]


async def test_an_idle_connection_the_server_closed_is_not_taken_again() -> None:
    client = HttpClient()
    try:
        # each connection: one keep-alive reply, then the server ends it (a keep-alive timeout)
        async with one_shot(reply(200, b"{}")) as url:
            await get(client, url)
            await anyio.sleep(0.1)  # the close reaches the client while the connection is idle
            again = await get(client, url)
    finally:
        await client.aclose()
    assert again.status == 200


@asynccontextmanager
async def one_shot(*chunks: bytes) -> AsyncIterator[str]:
    """A loopback server that reads one request, sends `chunks` (10 ms apart) and closes."""

    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await stream.receive()
            for chunk in chunks:
                await stream.send(chunk)
                await anyio.sleep(0.01)

    async with loopback(handle) as url:
        yield url + "/"


@pytest.mark.parametrize("body", [[b"abc"], [b"a", b"bc"]])
async def test_a_body_framed_by_end_of_file_is_read_to_the_end(body: list[bytes]) -> None:
    client = HttpClient()
    try:
        async with one_shot(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n", *body) as url:
            got = await get(client, url, 5, 99)
    finally:
        await client.aclose()
    assert (got.status, got.body) == (200, b"abc")


@pytest.mark.parametrize(
    "chunks",
    [
        [reply(200, b"x" * 50)[:-20]],  # promises 50 bytes, sends 30, closes
        [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"5\r\nabc"],  # chunk cut off
        [b"HTTP/1.1 200 OK\r\ncontent-le"],  # headers cut off
        [],  # nothing at all
    ],
)
async def test_a_reply_cut_short_is_a_lost_connection(chunks: list[bytes]) -> None:
    client = HttpClient()
    try:
        async with one_shot(*chunks) as url:
            with pytest.raises(ConnectionLost):
                await get(client, url, 5, 99)
    finally:
        await client.aclose()


async def test_a_trickled_reply_is_cut_off_at_the_deadline() -> None:
    client = HttpClient()
    started = anyio.current_time()
    try:
        async with one_shot(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", *([b"x"] * 300)) as url:
            with pytest.raises(ReplyTimeout):
                await get(client, url, 0.3, 999)
    finally:
        await client.aclose()
    assert anyio.current_time() - started < 2.5  # not when the trickle ends (3 s)


async def test_garbage_and_oversized_headers_are_bad_replies() -> None:
    async def garbage(n: int, head: bytes, body: bytes) -> bytes:
        return b"SSH-2.0-OpenSSH_9.2\r\n\r\n"

    async def flood(n: int, head: bytes, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"y" * (MAX_HEAD_BYTES + 100) + b"\r\n\r\n{}"

    client = HttpClient()
    try:
        async with serve(garbage) as served:
            with pytest.raises(BadReply, match=r"not an HTTP/1\.x reply"):
                await get(client, served.url + "/", 5, 99)
        async with serve(flood) as served:
            with pytest.raises(BadReply, match="headers larger than"):
                await get(client, served.url + "/", 5, 99)
    finally:
        await client.aclose()


async def test_a_body_past_the_cap_stops_the_read_and_drops_the_connection() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b"z" * 5000)

    client = HttpClient()
    try:
        async with serve(answer) as served:
            big = await get(client, served.url + "/", 5, 100)
            await get(client, served.url + "/", 5, 10_000)
    finally:
        await client.aclose()
    assert (big.status, big.too_big, big.body) == (200, True, b"z" * 100)
    assert served.connections == 2


async def test_bytes_after_the_reply_spoil_the_connection() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b"{}") + reply(200, b"[]")  # a second reply nobody asked for

    client = HttpClient()
    try:
        async with serve(answer) as served:
            first = await get(client, served.url + "/", 5, 99)
            second = await get(client, served.url + "/", 5, 99)
    finally:
        await client.aclose()
    assert first.body == second.body == b"{}"
    assert served.connections == 2


async def test_a_cancelled_request_closes_its_connection_and_the_next_one_works() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        if b"/slow" in head:
            await anyio.sleep(30)
        return reply(200, b"{}")

    client = HttpClient()
    try:
        async with serve(answer) as served:
            with anyio.move_on_after(0.2) as scope:
                await get(client, served.url + "/slow", 30, 99)
            assert scope.cancelled_caught
            done = await get(client, served.url + "/", 5, 99)
    finally:
        await client.aclose()
    assert done.status == 200
    assert served.connections == 2


async def test_refused_and_malformed_urls_fail_to_connect() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    client = HttpClient()
    try:
        with pytest.raises(ConnectFailed):
            await get(client, f"http://127.0.0.1:{port}/", 5, 9)
        for bad in ("ftp://127.0.0.1/", "http:///nohost", "http://127.0.0.1:99999/"):
            with pytest.raises(ConnectFailed):
                await get(client, bad, 5, 9)
    finally:
        await client.aclose()


def test_origin_host_header_and_target() -> None:
    origin, target = _origin_and_target("http://[::1]:8080/s/a/ng-control/v1/x?checkpoint_id=e1-000001")
    assert (origin.host, origin.port, origin.tls, origin.host_header) == ("::1", 8080, False, "[::1]:8080")
    assert target == "/s/a/ng-control/v1/x?checkpoint_id=e1-000001"
    origin, target = _origin_and_target("https://gym.example:443")
    assert (origin.port, origin.tls, origin.host_header, target) == (443, True, "gym.example", "/")
    assert _origin_and_target("HTTP://h/p")[0].key == ("http", "h", 80)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_verifies_the_server_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b'{"tls": true}')

    async with serve(answer, tls=server_tls) as served:
        untrusted = HttpClient()
        try:
            with pytest.raises(ConnectFailed, match="TLS handshake failed"):
                await get(untrusted, served.url + "/", 5, 99)
        finally:
            await untrusted.aclose()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the default context honours it
        trusting = HttpClient()
        try:
            got = await get(trusting, served.url + "/", 5, 99)
        finally:
            await trusting.aclose()
    assert got.body == b'{"tls": true}'


async def test_a_header_line_break_is_refused_before_anything_is_sent() -> None:
    async def answer(n: int, head: bytes, body: bytes) -> bytes:
        return reply(200, b"{}")

    client = HttpClient()
    try:
        async with serve(answer) as served:
            for headers in ({"Authorization": "Bearer a\r\nX-Evil: 1"}, {"X\nY": "v"}, {"A": "\u20ac"}):
                with pytest.raises(ValueError, match=r"line break|Latin-1") as caught:
                    await client.request(
                        "GET", served.url + "/", headers=headers, body=None, timeout_s=5, max_body=9
                    )
                assert "Evil" not in str(caught.value)
                assert "\u20ac" not in str(caught.value)
    finally:
        await client.aclose()
    assert served.requests == []


def test_the_request_target_is_percent_encoded_once() -> None:
    _, target = _origin_and_target("http://h:1/s/agent caf\u00e9/x%20y?q=a b")
    assert target == "/s/agent%20caf%C3%A9/x%20y?q=a%20b"
