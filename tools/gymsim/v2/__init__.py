"""Reference NeMo Gym servers of the unified checkpoint control plane ("v2",
`/ng-control/v1/checkpoint/*`, Gym's `nemo_gym/_checkpoint/`), beside v1's (`tools/gymsim/*.py`).

Start: a spec whose servers say `plane: v2` (`spec.default_v2_spec()`: environment → agent →
policy_model + resources), served by `cluster.start_cluster` / `spawn_cluster` or `quiesce sim
--plane v2`; the written cluster config is v1's format (the coordinator probes the plane).

```python
with start_cluster(default_v2_spec(), token="secret") as cluster:
    trainer = Trainer(cluster.urls["environment"])           # trainer.py: start, advance, hold, ...
    control = Control(cluster.urls, token="secret", http=http)   # drive.py: raw stage-ordered calls
```

Modules: `plane.py` (phase machine, fencing, replay, lease, retire marks, the eight routes),
`store.py` (manifest-last storage), `environment.py` / `model.py` / `agent.py` / `resources.py`
(participants and their data planes), `logic.py` (the deterministic digests: a result is a pure
function of its task), `server.py` (app, admin routes, faults), `trainer.py`, `drive.py`.
Faults: v1's mechanism (`faults.py`) on any path suffix, e.g. `{"kind": "fail", "path":
"/checkpoint/restore", "status": 409, "code": "checkpoint_error"}`, `hang`, `malformed`, `delay`
(`when: during` slows the operation inside the plane's lock).

Only `quiesce.coordinator.protocol`, `protocol_v2` and `durable` are imported from the coordinator.
"""

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
