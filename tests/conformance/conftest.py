"""Fixtures of the conformance checker tests: the anyio backend and a fake server factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from tests.conformance.fakegym import FakeGym, serve

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
            coordinator: bool = False,
        ) -> tuple[FakeGym, str]:
            fake = FakeGym(component, name, TOKEN, role=role, faults=faults, ack=ack, coordinator=coordinator)
            return fake, stack.enter_context(serve(fake.app))

        yield start
