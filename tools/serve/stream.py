"""The live tail of the ledger behind the server-sent event streams.

`EventHub.publish` is the coordinator's `observe` hook: it is called with each commit's events, in
seq order, once committed, and hands them to every subscriber without awaiting. A stream
(`tail`) subscribes *before* it reads what the ledger already holds, then emits the stored
events and after them the live ones, skipping every seq it already sent — so no event is missed
between the read and the subscription, none is sent twice, and the order is the ledger's (seq
order). A subscriber that falls `QUEUE_LIMIT` events behind is dropped (its stream ends; the
client reconnects with `Last-Event-ID` and reads the rest from the ledger).

An attempt's stream ends after the attempt's terminal event (`attempt.completed` or
`attempt.aborted`, or a `recovery.completed` that abandoned it): what `GET /v1/attempts/{id}`
then shows is final. Closing the hub (the service stopping or losing its lease) ends every stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiesce.ledger import Event, Ledger

#: Events a subscriber may lag behind before it is dropped.
QUEUE_LIMIT: Final = 10_000
#: Seconds between keep-alive comments on an idle stream (proxies close silent connections).
KEEPALIVE_S: Final = 15.0
TERMINAL_KINDS: Final = frozenset({"attempt.completed", "attempt.aborted"})


def event_json(event: Event) -> dict[str, Any]:
    """An event as the streams and `GET /v1/attempts/{id}` show it (every stored column)."""
    return event.columns()


def sse(event: Event) -> str:
    """One server-sent event: `id` is the seq (for `Last-Event-ID`), `event` the kind."""
    payload = json.dumps(event_json(event), separators=(",", ":"), default=str)
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {payload}\n\n"


def sse_end(document: dict[str, Any]) -> str:
    return f"event: end\ndata: {json.dumps(document, separators=(',', ':'))}\n\n"


def ends(event: Event, checkpoint_id: str) -> bool:
    """Whether `event` ends the attempt `checkpoint_id` (see the module docstring)."""
    if event.kind in TERMINAL_KINDS:
        return event.checkpoint_id == checkpoint_id
    if event.kind == "recovery.completed":
        outcomes = event.data.get("outcomes")
        return isinstance(outcomes, dict) and outcomes.get(checkpoint_id) == "abandoned"
    return False


def concerns(event: Event, checkpoint_id: str) -> bool:
    """Whether `event` belongs on the stream of `checkpoint_id`."""
    if event.checkpoint_id == checkpoint_id:
        return True
    if event.kind == "recovery.completed":
        outcomes = event.data.get("outcomes")
        return isinstance(outcomes, dict) and checkpoint_id in outcomes
    return False


@dataclass(eq=False)
class _Subscriber:
    wants: Callable[[Event], bool]
    send: MemoryObjectSendStream[Event]
    dropped: bool = field(default=False)


class EventHub:
    """Fans committed events out to the open streams (see the module docstring)."""

    def __init__(self) -> None:
        self._subscribers: set[_Subscriber] = set()
        self._closed = False
        #: the last seq published; streams that start later read up to it from the ledger
        self.last_seq = 0

    def publish(self, events: Sequence[Event]) -> None:
        """The `observe` hook: never awaits, never raises."""
        if not events:
            return
        self.last_seq = events[-1].seq
        for sub in list(self._subscribers):
            for event in events:
                if not sub.wants(event):
                    continue
                try:
                    sub.send.send_nowait(event)
                except anyio.WouldBlock:
                    self._drop(sub)
                    break
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    self._drop(sub)
                    break

    def _drop(self, sub: _Subscriber) -> None:
        sub.dropped = True
        self._subscribers.discard(sub)
        sub.send.close()

    def close(self) -> None:
        """End every stream (the service stops, or it lost the lease)."""
        self._closed = True
        for sub in list(self._subscribers):
            self._drop(sub)

    def reopen(self) -> None:
        self._closed = False

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(
        self, wants: Callable[[Event], bool]
    ) -> tuple[_Subscriber, MemoryObjectReceiveStream[Event]]:
        send, receive = anyio.create_memory_object_stream[Event](QUEUE_LIMIT)
        sub = _Subscriber(wants, send)
        if self._closed:
            send.close()
        else:
            self._subscribers.add(sub)
        return sub, receive

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        sub.send.close()

    async def tail(
        self,
        reader: Ledger,
        *,
        checkpoint_id: str | None,
        after: int = 0,
        outcome: Callable[[], Any] | None = None,
    ) -> AsyncIterator[str]:
        """The SSE text of one stream: stored events after `after`, then live ones.

        With `checkpoint_id`: that attempt's events, ending after its terminal event (or at once,
        after the stored ones, if the attempt had already ended). Without: every event, from
        `after` (0: from now on — a global stream starts live, it does not replay the ledger).
        """
        key = checkpoint_id
        wants: Callable[[Event], bool] = (lambda e: concerns(e, key)) if key is not None else (lambda e: True)
        sub, receive = self.subscribe(wants)
        sent = after
        try:
            if key is not None or after > 0:
                async for event in reader.read(after=after, checkpoint_id=key):
                    if event.seq <= sent:
                        continue
                    sent = event.seq
                    yield sse(event)
                    if key is not None and ends(event, key):
                        yield sse_end({"checkpoint_id": key, "last_seq": sent})
                        return
                if key is not None and outcome is not None and await outcome() is not None:
                    yield sse_end({"checkpoint_id": key, "last_seq": sent})  # ended before this stream
                    return
            with receive:
                while True:
                    with anyio.move_on_after(KEEPALIVE_S) as idle:
                        event = await receive.receive()
                    if idle.cancelled_caught:
                        yield ": keep-alive\n\n"
                        continue
                    if event.seq <= sent:
                        continue
                    sent = event.seq
                    yield sse(event)
                    if key is not None and ends(event, key):
                        yield sse_end({"checkpoint_id": key, "last_seq": sent})
                        return
        except anyio.EndOfStream:
            return  # the hub closed, or this stream fell too far behind: the client reconnects
        finally:
            self.unsubscribe(sub)
