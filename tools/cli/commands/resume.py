"""`quiesce resume --config C [ID] [--json]` — let go of what holds the servers.

Without ID it asks every configured server which checkpoint id holds it (capabilities, recorded)
and lets go of each: a restore left paused or interrupted is finished (from its snapshot, under
its own id) and resumed; a published save's unfinished resume is finished (`published`); a save
still before publication is rolled back (`aborted`); what a rollback or a failed restore left
paused is resumed; an id this ledger has no attempt of (another ledger's) is resumed as it is.
With ID, acts on that checkpoint id only (as `dbos workflow resume <id>` does). Works from any
process. `--json`: `{"checkpoint_id", "outcome", "servers", "also"?, "resubmit"?}` (`none` when
nothing is held; `also` when several ids held servers; `resubmit` for a restore: what to send
`/run` for again, also printed as `send again: ...` lines). Exit 1 when a server could not be resumed.
"""

from __future__ import annotations

from typing import Any

from quiesce.tools.cli.cluster_cmd import register_outcome


def register(subparsers: Any) -> None:
    register_outcome(
        subparsers,
        "resume",
        help="resume what holds the servers (a restore, an attempt left paused), or checkpoint ID",
        description="Let go of what holds the servers (asked now), or of the checkpoint ID given.",
    )
