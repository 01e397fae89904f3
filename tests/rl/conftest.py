"""Fixtures of the NeMo RL backend's tests: a local Ray (one per session) and stand-in Gym actors.

- `ray_local`: `ray.init(num_cpus=2)` without dashboard, shut down at the session's end. Workers get
  the repository on `PYTHONPATH`, so actors import `quiesce` and `tests.rl.gym_actor`.
- `token`: a fresh control token in `NEMO_GYM_CHECKPOINT_CONTROL_TOKEN` (the fallback unset).
- `gym_actors(plane)`: two stand-in `NemoGym` actors (`tests/rl/gym_actor.py`), shard `nemo_gym`,
  replicas 0 and 1, as RL's `checkpoint_handles` (`ShardSet`); every actor started is stopped and
  killed at the test's end, also when the test or a start failed.

Without Ray the folder is skipped, unless `QUIESCE_REQUIRE_RAY` is set: then it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

try:
    import ray
except ImportError as error:  # pragma: no cover - depends on the environment
    if os.environ.get("QUIESCE_REQUIRE_RAY"):
        raise RuntimeError(
            f"QUIESCE_REQUIRE_RAY is set but Ray cannot be imported ({error}); install the `ray` extra"
        ) from error
    pytest.skip(
        f"tests/rl need Ray, which cannot be imported ({error}); install `.[dev]` or `.[ray]`"
        " (set QUIESCE_REQUIRE_RAY=1 to make this a failure)",
        allow_module_level=True,
    )

from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.rl.deployments import DEFAULT_SHARD, quiesce_name
from tests.rl.gym_actor import NemoGym

#: The repository root (the folder holding `quiesce/` and `tests/`).
ROOT = Path(__file__).resolve().parents[2]
Plane = Literal["v1", "v2"]
STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local Ray for the whole session (2 CPUs, no dashboard, worker logs not sent here)."""
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "qzrl-" + secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, value)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    return value


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class ShardSet:
    """RL's shard set as quiesce reads it: `checkpoint_handles` maps `"<shard>/replica-<i>"` to the
    actor handle."""

    handles: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def checkpoint_handles(self) -> dict[str, Any]:
        return {
            f"{shard}/replica-{i}": handle
            for shard, replicas in self.handles.items()
            for i, handle in enumerate(replicas)
        }


def replica_prefix(shard: str, replica: int) -> str:
    """The server-name prefix of a stand-in replica: its servers' quiesce names (`quiesce_name`)."""
    return quiesce_name(shard, replica, "")


StartActors = Callable[..., Awaitable[ShardSet]]


@pytest.fixture
async def gym_actors(ray_local: None, token: str) -> Any:
    """`await gym_actors(plane, replicas=2, shard="nemo_gym")` → a `ShardSet` of started stand-ins.

    Every actor started (also by a call that failed half way) is stopped and killed at teardown."""
    started: list[Any] = []

    async def start(plane: Plane, *, replicas: int = 2, shard: str = DEFAULT_SHARD) -> ShardSet:
        actors = []
        for i in range(replicas):
            actor = NemoGym.remote(plane, replica_prefix(shard, i), token)  # type: ignore[attr-defined]
            started.append(actor)
            actors.append(actor)
        await _ready(actors)
        return ShardSet({shard: actors})

    yield start
    for actor in started:
        # an actor that failed to start has nothing to stop; one that hangs is killed anyway
        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.stop.remote(), STOP_TIMEOUT_S)
        ray.kill(actor)


async def _ready(actors: list[Any]) -> None:
    for actor in actors:
        await actor.urls.remote()


def env_handles(shard_set: ShardSet, **others: Any) -> Mapping[str, Any]:
    """RL's `env_handles`: the Gym shard set under its task name, next to other environments."""
    return {"nemo_gym": shard_set, **others}


def backend_over(shard_set: ShardSet, master_config: Any, made: list[Any], **options: Any) -> Any:
    """quiesce's backend for `shard_set`, built as RL's selector builds it (no rollout manager or
    data-plane client), kept in `made` so the test closes it; `options`: `expected`, `scope`..."""
    from quiesce.rl.builder import build_quiesce_environment_checkpoint

    backend = build_quiesce_environment_checkpoint(
        master_config, env_handles=env_handles(shard_set), rollout_manager=None, dp_client=None, **options
    )
    made.append(backend)
    return backend


def settings(tmp_path: Path, plane: Plane = "v2") -> dict[str, Any]:
    """RL's master config as quiesce reads it: its `quiesce` settings (a SQLite ledger in `tmp_path`)."""
    quiesce = {
        "ledger": f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}",
        "snapshots": str(tmp_path / "snapshots"),
        "deadline_s": 30,
    }
    return {"quiesce": {**quiesce, "plane": plane} if plane != "v2" else quiesce}


@pytest.fixture
async def backends() -> Any:
    """Every backend a test makes (`backend_over`) is closed at its end."""
    made: list[Any] = []
    yield made
    for backend in made:
        await backend.aclose()
