"""``NullLedger``: a ``Ledger``-compatible object that stores nothing — the baseline of measure #3.

It has the methods the coordinator calls (``append``, ``stage``, ``flush``, ``append_many``,
``start_epoch``, ``last_seq``, ``head``, ``read``, ``attempts``, ``attempt``,
``unfinished_attempts``, ``epoch``) and does none of a ledger's work: no validation, no
redaction, no canonical encoding, no hash, no transaction, no fsync. ``append`` and ``stage``
only count seqs (so checkpoint ids stay unique) and return an ``Event`` with an empty payload;
reads find nothing. The same coordinator code run on it shows what the ledger itself costs.

Bench-only: it must never be used to drive real servers (nothing would be recoverable).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from quiesce.ledger import AppendItem, AttemptRow, Event


class NullLedger:
    """Appends nothing; see the module docstring. ``epoch`` keeps checkpoint ids apart from a real run."""

    def __init__(self, epoch: int = 999) -> None:
        self.epoch = epoch
        self.epoch_hash = ""
        self.url = "null:"
        self.readonly = False
        self._seq = 0
        self._head: Event | None = None

    def _event(self, kind: str, checkpoint_id: str | None, server: str | None, call_id: str | None) -> Event:
        self._seq += 1
        self._head = Event(self._seq, "", kind, checkpoint_id, server, call_id, self.epoch, {}, "", "")
        return self._head

    async def append(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = True,
    ) -> Event:
        return self._event(kind, checkpoint_id, server, call_id)

    async def stage(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = False,
    ) -> Event:
        return self._event(kind, checkpoint_id, server, call_id)

    async def flush(self) -> None:
        return None

    async def sync(self, *, ending: bool = True) -> None:
        return None

    def operation_ended(self) -> None:
        return None

    async def append_many(self, items: Sequence[AppendItem], *, durable: bool = True) -> list[Event]:
        return [self._event(i.kind, i.checkpoint_id, i.server, i.call_id) for i in items]

    async def start_epoch(self, data: Mapping[str, Any] | BaseModel) -> Event:
        return self._event("coordinator.started", None, None, None)

    async def last_seq(self) -> int:
        return self._seq

    async def head(self) -> Event | None:
        return self._head

    async def last_before(self, kind: str, seq: int) -> Event | None:
        return None

    async def read(
        self,
        after: int = 0,
        checkpoint_id: str | None = None,
        kinds: Sequence[str] | None = None,
        *,
        page_size: int = 1000,
    ) -> AsyncIterator[Event]:
        empty: tuple[Event, ...] = ()
        for event in empty:
            yield event

    async def attempts(self, since: Any = None, outcome: str | None = None) -> list[AttemptRow]:
        return []

    async def attempt(self, checkpoint_id: str) -> AttemptRow | None:
        return None

    async def unfinished_attempts(self) -> list[AttemptRow]:
        return []

    async def aclose(self) -> None:
        return None
