"""`quiesce abort --config C [ID] [--json]` — roll back the attempt that holds the servers.

Without ID it asks every configured server which checkpoint id holds it (capabilities, recorded)
and rolls each back: every server a save before publication may have paused is resumed, in resume
order (a server that never paused is recorded as such), and its staging folder removed. What
cannot be rolled back is let go as `quiesce resume` would: a published save is resumed
(`published`), a restore finished and resumed. With ID, acts on that checkpoint id only. `--json`:
`{"checkpoint_id", "outcome", "servers", "also"?}` (`none` when nothing is held).
"""

from __future__ import annotations

from typing import Any

from quiesce.tools.cli.cluster_cmd import register_outcome


def register(subparsers: Any) -> None:
    register_outcome(
        subparsers,
        "abort",
        help="roll back the attempt that holds the servers, or checkpoint ID",
        description="Roll back the attempt that holds the servers (asked now), or the checkpoint ID given.",
    )
