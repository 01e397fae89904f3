"""Audit tools: they read the ledger only, never a Gym server, and never write.

- `attempts` — rebuild one attempt from its events: calls paired by `call_id`, phase spans,
  the participant × phase matrix, recovery evidence.
- `check` — the protocol check (order, touched servers settled, deadline, stale epochs).
- `bundle` — the offline-verifiable audit bundle (export / verify).
- `report` — the self-contained HTML timeline page.
- `source` — the few async reads these need, through `ledger.Ledger` opened read-only.

Every function here that takes events takes them in seq order, as `Ledger.read` yields them.
"""
