"""Simulated coordinator deaths for in-process recovery tests, and small shared checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from quiesce.coordinator import crashpoints
from quiesce.ledger import Event, FencedError

__all__ = ["Died", "Dying", "Predicate", "kind_is"]


class Died(FencedError):
    """The simulated death of a coordinator (tests only)."""


Predicate = Callable[[Event], bool]


class Dying(crashpoints.CrashPoints):
    def __init__(self, when: Predicate, nth: int) -> None:
        super().__init__(at_append=nth)
        self.when = when
        self.seen = 0
        self.last: Event | None = None

    def after_append(self, events: Sequence[Event]) -> None:
        if self.last is not None:
            raise AssertionError(f"append after the simulated death: {[e.kind for e in events]}")
        self.appends += 1
        self.seen += sum(1 for e in events if self.when(e))
        if self.seen >= (self.at_append or 1):
            self.last = events[-1]
            raise Died(f"simulated coordinator death after {events[-1].kind} seq {events[-1].seq}")


def kind_is(kind: str, **data: object) -> Predicate:
    """Events of `kind` whose payload has `data` (and `server=` matches the column)."""
    server = data.pop("server", None)
    return lambda e: (
        e.kind == kind
        and (server is None or e.server == server)
        and all(e.data.get(k) == v for k, v in data.items())
    )
