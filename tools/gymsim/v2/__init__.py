"""Reference NeMo Gym servers of the unified checkpoint control plane ("v2",
`/ng-control/v1/checkpoint/*`)."""

from __future__ import annotations

from quiesce.tools.gymsim.v2.agent import AgentServer
from quiesce.tools.gymsim.v2.environment import EnvironmentServer
from quiesce.tools.gymsim.v2.model import ModelServer
from quiesce.tools.gymsim.v2.resources import ResourcesServer
from quiesce.tools.gymsim.v2.server import V2Server

V2_KINDS: dict[str, type[V2Server]] = {
    "environment": EnvironmentServer,
    "model": ModelServer,
    "agent": AgentServer,
    "resources": ResourcesServer,
}
