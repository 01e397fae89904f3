"""A coordinator process for the standby tests: `python -m tests.recovery.standby_child ROLE CONFIG`.

- `active`: open (takes the lease), discover, checkpoint; prints `{"event": "open", ...}` first. A
  `FencedError` prints `{"event": "fenced", "at": <time>, "error"}` and exits 3.
- `standby`: `Coordinator.open(config, standby=True)`: waits for the lease, takes over, recovers;
  prints `{"event": "took_over", "at": <time>, "epoch", "holder", "took_over_from", "recovery"}`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio

from quiesce.coordinator import Coordinator, FencedError


def say(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


async def active(config: str) -> int:
    try:
        async with Coordinator.open(config) as coord:
            lease = coord.ledger.lease
            say({"event": "open", "epoch": coord.epoch, "holder": lease.holder if lease else None})
            await coord.discover()
            await coord.checkpoint(deadline_s=60)
    except FencedError as error:
        say({"event": "fenced", "at": time.time(), "error": str(error)})
        return 3
    say({"event": "done"})
    return 0


async def standby(config: str) -> int:
    async with Coordinator.open(config, standby=True) as coord:
        took = time.time()
        previous = coord.ledger.took_over_from
        report = coord.last_recovery
        say(
            {
                "event": "took_over",
                "at": took,
                "epoch": coord.epoch,
                "took_over_from": None
                if previous is None
                else {"holder": previous.holder, "expires_at": previous.expires_at},
                "recovery": report.as_json() if report else None,
            }
        )
    return 0


def main() -> int:
    role, config = sys.argv[1], sys.argv[2]
    return anyio.run(active if role == "active" else standby, config)


if __name__ == "__main__":
    raise SystemExit(main())
