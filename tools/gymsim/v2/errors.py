"""Refusals of the v2 plane: `{"error": {"code", "detail"}}` with the status of
`protocol_v2.CODE_STATUS`."""

from __future__ import annotations

from quiesce.coordinator.protocol_v2 import CODE_STATUS
from quiesce.tools.gymsim.common import ControlRejection


def refuse(code: str, detail: str) -> ControlRejection:
    """The rejection of `code` (409 for a code the table does not know)."""
    return ControlRejection(code, detail, CODE_STATUS.get(code, 409))
