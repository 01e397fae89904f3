"""Fixtures of the conformance checker tests: the anyio backend and the fake server factories
(`start_fake` for control plane v1, `start_fake_v2` for the unified plane)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from tests.conformance.fakegym import FakeGym, serve
from tests.conformance.fakegym_v2 import FakeGymV2
from tests.oracle.wire import oracle_v2

__all__ = ["TOKEN", "StartFake", "StartFakeV2", "oracle_v2"]

TOKEN = "conformance-test-token-5f1c"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


StartFake = Callable[..., tuple[FakeGym, str]]


@pytest.fixture
def start_fake() -> Iterator[StartFake]:
    """Start a `FakeGym` on loopback: `start_fake(component, role=..., faults={...})` -> (fake, url)."""
    with ExitStack() as stack:

        def start(
            component: str,
            *,
            name: str = "fake",
            role: str | None = None,
            faults: frozenset[str] = frozenset(),
            ack: bool = False,
            receipts: bool = False,
            body_first: bool = False,
            coordinator: bool = False,
        ) -> tuple[FakeGym, str]:
            fake = FakeGym(
                component,
                name,
                TOKEN,
                role=role,
                faults=faults,
                ack=ack,
                receipts=receipts,
                body_first=body_first,
                coordinator=coordinator,
            )
            return fake, stack.enter_context(serve(fake.app))

        yield start


StartFakeV2 = Callable[..., tuple[FakeGymV2, str]]


@pytest.fixture
def start_fake_v2() -> Iterator[StartFakeV2]:
    """Start a `FakeGymV2` on loopback: `start_fake_v2(kind, faults={...}, grace_s=...)` -> (fake, url)."""
    with ExitStack() as stack:

        def start(
            kind: str,
            *,
            instance: str = "fake",
            faults: frozenset[str] = frozenset(),
            grace_s: float = 600.0,
            live: tuple[str, ...] = ("r1", "r2-a1"),
        ) -> tuple[FakeGymV2, str]:
            fake = FakeGymV2(kind, instance, TOKEN, faults=faults, grace_s=grace_s, live=live)
            return fake, stack.enter_context(serve(fake.app))

        yield start
