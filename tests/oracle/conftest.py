"""The oracle's own tests see the v2 reference servers' traffic too (`oracle_v2`)."""

from __future__ import annotations

from tests.oracle.wire import oracle_v2

__all__ = ["oracle_v2"]
