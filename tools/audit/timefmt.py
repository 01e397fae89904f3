"""Durations and event times as short text: plain functions (no rich), shared by the terminal
views (`quiesce.tools.audit.present`), the HTML report and `quiesce history`."""

from __future__ import annotations

from datetime import UTC, datetime


def duration(seconds: float | None) -> str:
    """A short human duration: `850ms`, `1.24s`, `2m03s`, `1h02m`; `-` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def short_at(at: str | None) -> str:
    """`2025-01-02 03:04:05` from an event's `at` (UTC)."""
    if not at:
        return "-"
    try:
        return datetime.fromisoformat(at).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return at
