"""Reference NeMo Gym servers that speak checkpoint control plane v1 (NeMo Gym's own
`nemo_gym/_checkpoint/`, schema version 1).

Policy/auxiliary model servers (`model.py`), agents (`agent.py`), resources with a
judge-backed `/verify` (`resources.py`), all sharing the fence of spec §1.1
(`fence.py`), bearer auth and a control log (`base.py`) and fault injection
(`faults.py`). `host.py` serves many of them from one process, `cluster.py` is the
Python API (`start_cluster`, `spawn_cluster`), `launcher.py` the command line
(`python -m quiesce.tools.gymsim`, `quiesce sim`), `client.py` helpers to drive rollouts.

The point of these servers is exact restore: a rollout's final result is a pure
function of its id and the exact turns it ran, so checkpoint → kill → restore →
resume finishes every rollout as an uninterrupted run would.

Only `quiesce.coordinator.protocol` is imported from the coordinator package.
"""
