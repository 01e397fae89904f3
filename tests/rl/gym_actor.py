"""A Ray actor standing in for NeMo RL's Gym actor (`NemoGym`), as far as quiesce uses it.

`NemoGym.remote(plane, prefix, token)` starts one gymsim deployment in its own process (the default
v1 or v2 spec), every server named `<prefix><gym name>`; each also reports the plain Gym name (v1:
as its name, v2: as its `instance`) and writes under it, so two actors are two replicas of one Gym
config: same reported names, distinct server names. A head server (uvicorn, loopback, in a thread
of the actor) answers Gym's `GET /global_config_dict_yaml` with the deployment's global config: a
JSON string of YAML whose top-level entries `<gym name>: {<server type>: {<implementation>:
{entrypoint, host, port}}}` are the servers. The actor keeps the head address where RL's does:
`head_server_config` (`.host`, `.port`).

The v2 episode methods run one `Trainer` on the actor's event loop (RL runs rollouts from this
actor too); the v1 ones start and resubmit rollouts on an agent. The control token is a
constructor argument handed to the gymsim process's environment only: never a file, never a log.

`BareHead` is an actor with nothing but a settable `head_server_config` (for hostile head servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import ray
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim import client as v1_client
from quiesce.tools.gymsim.cluster import ClusterProcess, spawn_cluster
from quiesce.tools.gymsim.spec import ClusterSpec, default_spec, default_v2_spec, replica_spec
from quiesce.tools.gymsim.v2.trainer import Trainer

Plane = Literal["v1", "v2"]

#: Gym's server type of each gymsim kind (the key under a server's top-level config entry).
SERVER_TYPE = {
    "model": "responses_api_models",
    "agent": "responses_api_agents",
    "resources": "resources_servers",
    "environment": "environment_servers",
}
STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HeadServerConfig:
    """Where a head server listens (the shape of Gym's `BaseServerConfig`)."""

    host: str
    port: int


def global_config(base: ClusterSpec, urls: dict[str, str], head: HeadServerConfig) -> dict[str, Any]:
    """Gym's resolved global config for these servers (gym name → URL)."""
    document: dict[str, Any] = {
        "head_server": {"host": head.host, "port": head.port},
        "default_host": head.host,
        "policy_api_key": "dummy_key",
        "port_range_low": 5000,
    }
    for server in base.expanded():
        parts = urlsplit(urls[server.name])
        document[server.name] = {
            SERVER_TYPE[server.kind]: {
                f"gymsim_{server.kind}": {"entrypoint": "app.py", "host": parts.hostname, "port": parts.port}
            }
        }
    return document


class HeadServer:
    """A uvicorn server on a loopback port, in its own thread, answering `routes` (path → reply)."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies

        async def answer(request: Request) -> Response:
            reply = self.replies.get(request.url.path)
            if reply is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            if isinstance(reply, Response):
                return reply
            return JSONResponse(reply)

        app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET"])])
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.config = HeadServerConfig(host="127.0.0.1", port=self.socket.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="gym-head", daemon=True
        )
        self.thread.start()
        give_up = STARTUP_TIMEOUT_S
        while not self.server.started and give_up > 0 and self.thread.is_alive():
            self.thread.join(0.01)
            give_up -= 0.01
        if not self.server.started:
            self.close()
            raise RuntimeError("the stand-in head server did not start")

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@ray.remote(max_restarts=0, max_task_retries=0)
class NemoGym:
    """One Gym deployment behind a Ray actor (module docstring)."""

    def __init__(self, plane: Plane, prefix: str, token: str) -> None:
        self.plane: Plane = plane
        self.base = default_v2_spec() if plane == "v2" else default_spec()
        self.spec = replica_spec(self.base, prefix)
        self.prefix = prefix
        self._stack = contextlib.ExitStack()
        try:
            self.cluster: ClusterProcess = self._stack.enter_context(
                spawn_cluster(self.spec, env={TOKEN_ENV: token})
            )
            self.gym_urls = {s.name: self.cluster.urls[prefix + s.name] for s in self.base.expanded()}
            self.head = HeadServer({})
            self._stack.callback(self.head.close)
            config = global_config(self.base, self.gym_urls, self.head.config)
            self.head.replies["/global_config_dict_yaml"] = yaml.safe_dump(config, sort_keys=False)
        except BaseException:
            self._stack.close()
            raise
        self.head_server_config: HeadServerConfig | None = self.head.config
        self.trainer: Trainer | None = None
        self.http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(60.0, read=None))

    # -- the deployment ----------------------------------------------------------------------

    def urls(self) -> dict[str, str]:
        """Gym name → base URL (what the head server lists)."""
        return dict(self.gym_urls)

    def server_names(self) -> dict[str, str]:
        """Gym name → the server's name in gymsim (`<prefix><gym name>`: quiesce's name for it; it
        reports the plain Gym name, as replicas do)."""
        return {name: self.prefix + name for name in self.gym_urls}

    def head_url(self) -> str:
        return self.head.url

    def pid(self) -> int:
        """The gymsim process's pid."""
        return self.cluster.pid

    def kill(self) -> None:
        """SIGKILL the gymsim process: every server of the deployment dies at once."""
        self.cluster.kill()

    async def stop(self) -> None:
        """Detach the trainer, stop the head server and the gymsim process (idempotent)."""
        if self.trainer is not None:
            await self.trainer.aclose()
            self.trainer = None
        await self.http.aclose()
        await asyncio.to_thread(self._stack.close)

    # -- v2 episodes (one Trainer on the environment) -------------------------------------

    def _trainer(self) -> Trainer:
        if self.plane != "v2":
            raise RuntimeError("v2 episode methods on a v1 deployment")
        if self.trainer is None:
            self.trainer = Trainer(self.gym_urls["environment"])
        return self.trainer

    async def start_episodes(
        self, tasks: dict[str, dict[str, Any]], *, paced: bool = False
    ) -> list[dict[str, Any]]:
        """Start one episode per task (rollout id → task, `trainer.make_tasks`), attempt 0; returns
        them as `{"rollout_id", "attempt"}` once the environment registered every one."""
        started = await self._trainer().start(tasks, paced=paced)
        return [e.model_dump() for e in started]

    async def advance(self, turns: int = 1, rollout_ids: list[str] | None = None) -> None:
        await self._trainer().advance(turns, rollout_ids)

    async def unpace(self, rollout_ids: list[str] | None = None) -> None:
        await self._trainer().unpace(rollout_ids)

    async def wait_parked(self) -> None:
        await self._trainer().wait_parked()

    async def hold_mid_turn(self, rollout_ids: list[str]) -> None:
        """Start these rollouts' next turn and hold them in it (a prepare blocker) until `release`."""
        await self._trainer().hold_mid_turn(rollout_ids)

    async def release(self) -> None:
        await self._trainer().release()

    async def in_flight(self) -> list[dict[str, Any]]:
        """Every unfinished rollout as its current attempt `{"rollout_id", "attempt"}`."""
        return [e.model_dump() for e in self._trainer().in_flight()]

    async def episodes_state(self) -> dict[str, Any]:
        """`{"tasks", "attempts", "results"}` of the trainer: what a fresh actor needs to continue."""
        trainer = self._trainer()
        return {
            "tasks": dict(trainer.tasks),
            "attempts": dict(trainer.attempts),
            "results": dict(trainer.results),
        }

    async def detach(self) -> None:
        """Stop waiting for the `/run` calls under way (their deployment is being left)."""
        await self._trainer().detach()

    async def continue_episodes(self, state: dict[str, Any], *, paced: bool = False) -> list[dict[str, Any]]:
        """Take over another actor's episodes (`episodes_state()`) and start attempt + 1 of every one
        in flight here: a restored one continues from its saved boundary, any other starts over."""
        trainer = self._trainer()
        trainer.tasks = dict(state["tasks"])
        trainer.attempts = {k: int(v) for k, v in state["attempts"].items()}
        trainer.results = dict(state["results"])
        started = await trainer.continue_on(self.gym_urls["environment"], paced=paced)
        return [e.model_dump() for e in started]

    async def wait_results(self, timeout_s: float = 120.0) -> dict[str, str]:
        """Every started rollout's result (`EpisodeFailed` if one ended without)."""
        return await self._trainer().wait_results(timeout_s)

    # -- v1 rollouts (on an agent) ------------------------------------------------------------

    def _agent(self, agent: str) -> str:
        if self.plane != "v1":
            raise RuntimeError("v1 rollout methods on a v2 deployment")
        return self.gym_urls[agent]

    async def start_rollouts(self, rollouts: dict[str, int], agent: str = "simple_agent") -> None:
        """Start every `rollout_id: turns` on `agent` (attempt 0)."""
        await v1_client.start_rollouts(self.http, self._agent(agent), rollouts)

    async def rollouts(self, agent: str = "simple_agent") -> dict[str, dict[str, Any]]:
        """The agent's rollouts: id → view (status, attempt_index, turns_done, result, ...)."""
        return await v1_client.get_rollouts(self.http, self._agent(agent))

    async def resubmit(self, executions: list[tuple[str, int]], agent: str = "simple_agent") -> None:
        """`/run` again for each restored continuation (rollout id, attempt index) waiting here."""
        chosen = [_Execution(rid, attempt) for rid, attempt in executions]
        await v1_client.resubmit(self.http, self._agent(agent), chosen)

    async def wait_finished(self, agent: str = "simple_agent", timeout_s: float = 120.0) -> dict[str, Any]:
        """Rollout id → final result, once every rollout on `agent` completed or failed."""
        views = await v1_client.wait_finished(self.http, self._agent(agent), timeout_s=timeout_s)
        return v1_client.final_results(views)


@dataclass(frozen=True)
class _Execution:
    rollout_id: str
    attempt_index: int


@ray.remote(max_restarts=0, max_task_retries=0)
class BareHead:
    """An actor with only a `head_server_config`, settable (None: never spun up)."""

    def __init__(self) -> None:
        self.head_server_config: Any = None

    def set_head(self, config: Any) -> None:
        self.head_server_config = config
