"""The coordinator suite's fixtures (a reference Gym cluster on loopback, its config, a control
token), reused by the tests that check ledgers written by the real coordinator."""

from __future__ import annotations

from tests.coordinator.conftest import cluster, configure, make_cluster, token

__all__ = ["cluster", "configure", "make_cluster", "token"]
