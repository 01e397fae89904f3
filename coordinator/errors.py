"""quiesce's one error hierarchy; import errors from here.

    QuiesceError
    ├── ConfigError        bad cluster config, raised before any server is contacted
    ├── DiscoveryError     the cluster cannot take part (every reason listed)
    ├── PhaseError         a phase failed: names phase, server and reason
    ├── DeadlineExceeded   the attempt's absolute deadline passed
    ├── SnapshotError      a snapshot on disk is incomplete, altered, or does not match the cluster
    ├── AcknowledgementError  an agent refused (or answered wrongly) an acknowledgement of results
    ├── ServersHeld        a new attempt is refused: a participant is held by another checkpoint id
    ├── MissingExtra       (from ledger) an optional dependency is not installed: names the extra
    └── LedgerError        (from ledger) — FencedError: a newer coordinator owns the ledger

CLI exit codes: ConfigError, DiscoveryError and MissingExtra are 2 (usage / config / install);
every other QuiesceError is 1 (the operation failed).
"""

from __future__ import annotations

from quiesce.ledger.errors import FencedError, LedgerError, MissingExtra, QuiesceError

__all__ = [
    "AcknowledgementError",
    "ConfigError",
    "DeadlineExceeded",
    "DiscoveryError",
    "FencedError",
    "LedgerError",
    "MissingExtra",
    "PhaseError",
    "QuiesceError",
    "ServersHeld",
    "SnapshotError",
]


class ConfigError(QuiesceError):
    """The cluster config is invalid; the message names the field."""


class DiscoveryError(QuiesceError):
    """Discovery refused the setup; `reasons` lists every offender as (server name, reason)."""

    def __init__(self, message: str, reasons: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.reasons: list[tuple[str, str]] = list(reasons or [])


class PhaseError(QuiesceError):
    """A phase of an attempt failed. Carries what a caller needs to decide what to do next."""

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        server: str | None,
        reason: str,
        code: str | None = None,
        checkpoint_id: str | None = None,
        resumed: list[str] | None = None,
        not_resumed: list[str] | None = None,
        latest_snapshot: str | None = None,
        warnings: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.server = server
        self.reason = reason
        self.code = code
        self.checkpoint_id = checkpoint_id
        self.resumed: list[str] = list(resumed or [])
        self.not_resumed: list[str] = list(not_resumed or [])
        self.latest_snapshot = latest_snapshot
        #: what was said before the attempt began and still holds for its failure (a restore of a
        #: snapshot this ledger did not publish: what its provenance check could not verify)
        self.warnings: list[str] = list(warnings or [])


class DeadlineExceeded(PhaseError):
    """The attempt's absolute deadline passed before the phase was done."""


class SnapshotError(QuiesceError):
    """A snapshot is unusable; `differences` lists each problem found."""

    def __init__(self, message: str, differences: list[str] | None = None) -> None:
        super().__init__(message)
        self.differences: list[str] = list(differences or [])


class AcknowledgementError(QuiesceError):
    """An agent did not acknowledge exactly the completed results it was asked to release: it
    refused (`status`, `code` of its reply) or its reply covered another set; nothing is assumed
    released."""

    def __init__(
        self, message: str, *, server: str, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.server = server
        self.status = status
        self.code = code


class ServersHeld(QuiesceError):
    """A checkpoint or restore was refused before any request: participants are held by another
    checkpoint id. `held` maps each held server to that id; the message names each holder's kind,
    since when, and the command that frees it."""

    def __init__(self, message: str, held: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.held: dict[str, str] = dict(held or {})
