"""quiesce: a crash-safe checkpoint coordinator for NeMo Gym servers, with a hash-chained ledger.

Everything quiesce installs lives under this one import name: ``quiesce.ledger`` (the ledger),
``quiesce.coordinator`` (the embedded coordinator), ``quiesce.tools`` (the CLI, the service, the
reference servers, the audit and bench tools) and ``quiesce.migrations`` (the ledger's schema).
The names a trainer needs are here too — every public name of ``quiesce.coordinator``, and
``RemoteCoordinator``, the same shapes over ``quiesce serve``::

    from quiesce import Coordinator, RemoteCoordinator

Rule: importing ``quiesce`` loads nothing heavy; each public name imports its module on first use,
so ``quiesce --help`` and a light read of a ledger stay cheap, and an optional dependency (the
``serve`` and ``postgres`` extras) is imported only by the code that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from quiesce.coordinator import __all__ as _COORDINATOR_NAMES  # names only: no module is loaded

if TYPE_CHECKING:
    from quiesce.coordinator import *  # noqa: F403
    from quiesce.coordinator.version import VERSION as __version__
    from quiesce.tools.serve.client import RemoteCoordinator

#: Public names and the module each lives in (imported on first use).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_COORDINATOR_NAMES, "quiesce.coordinator"),
    "RemoteCoordinator": "quiesce.tools.serve.client",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return importlib.import_module("quiesce.coordinator.version").VERSION
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'quiesce' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [*_COORDINATOR_NAMES, "RemoteCoordinator", "__version__"]
