"""Python API to run a reference Gym cluster: in-process (threads) or as a real subprocess.

```python
from quiesce.tools.gymsim.cluster import start_cluster, spawn_cluster

with start_cluster(token="secret") as cluster:          # servers in a background thread
    cluster.urls["policy_model"]                          # 'http://127.0.0.1:41235'
    cluster.write_config("cluster.yaml", ledger_url="sqlite+aiosqlite:///q.db", snapshots_dir="snaps")

env = {"NEMO_GYM_CHECKPOINT_CONTROL_TOKEN": "secret"}
with spawn_cluster(spec, env=env) as proc:               # `python -m quiesce.tools.gymsim` in its own process
    proc.kill()                                           # SIGKILL: the whole cluster dies at once
```

Both expose `.urls` (server name → base URL) and `.config(ledger_url,
snapshots_dir, **overrides)` → a cluster config dict in the coordinator's format
(`README.md`, "Cluster config"). The token is never written to the config or the spec
file: the subprocess reads it from its environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.base import GymServer
from quiesce.tools.gymsim.host import Host
from quiesce.tools.gymsim.spec import ClusterSpec, SpecLike, load_spec
from quiesce.tools.gymsim.v2.server import V2Server

#: The folder that holds the `quiesce` package this code was imported from (the repository in a
#: checkout, site-packages in an installed wheel): a child put on it runs this same code.
IMPORT_ROOT = Path(__file__).parents[3]
STARTUP_TIMEOUT_S = 60.0


def cluster_config(
    spec: ClusterSpec,
    urls: Mapping[str, str],
    *,
    ledger_url: str | None = None,
    snapshots_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The coordinator's cluster config for these servers (`README.md`, "Cluster config").

    `instance_role` is written for auxiliary models (as in the seed example) and for
    servers whose spec sets `config_instance_role`.
    """
    servers: list[dict[str, Any]] = []
    for server in spec.expanded():
        entry: dict[str, Any] = {"name": server.name, "url": urls[server.name]}
        if server.config_instance_role is not None:
            entry["instance_role"] = server.config_instance_role
        elif server.kind == "model" and server.instance_role == "auxiliary":
            entry["instance_role"] = "auxiliary"
        servers.append(entry)
    config: dict[str, Any] = {
        "ledger": ledger_url if ledger_url is not None else spec.ledger,
        "snapshots": str(snapshots_dir) if snapshots_dir is not None else spec.snapshots,
        "deadline_s": spec.deadline_s,
        "token_env": TOKEN_ENV,
        "fanout": spec.fanout,
        "servers": servers,
    }
    config.update(overrides)
    return config


def write_yaml_atomic(path: str | os.PathLike[str], document: Any) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    os.replace(tmp, target)
    return target


class _ConfigMixin:
    spec: ClusterSpec
    urls: dict[str, str]

    def config(
        self,
        ledger_url: str | None = None,
        snapshots_dir: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> dict[str, Any]:
        """A cluster config dict for the coordinator, pointing at these servers."""
        return cluster_config(
            self.spec, self.urls, ledger_url=ledger_url, snapshots_dir=snapshots_dir, **overrides
        )

    def write_config(
        self,
        path: str | os.PathLike[str],
        ledger_url: str | None = None,
        snapshots_dir: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> Path:
        """Write `config(...)` as YAML to `path` (atomically) and return the path."""
        return write_yaml_atomic(path, self.config(ledger_url, snapshots_dir, **overrides))


class RunningCluster(_ConfigMixin):
    """A cluster served from a background thread of this process (`start_cluster`)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.spec = host.spec
        self.urls = dict(host.urls)

    @property
    def servers(self) -> dict[str, GymServer]:
        """The live server objects (inspect only from tests; they belong to the cluster's loop)."""
        return self.host.servers

    @property
    def v2_servers(self) -> dict[str, V2Server]:
        """The live v2 server objects (inspect only from tests; they belong to the cluster's loop)."""
        return self.host.v2_servers


@contextlib.contextmanager
def start_cluster(spec: SpecLike = None, *, token: str | None) -> Iterator[RunningCluster]:
    """Run the cluster's servers in-process, in a background thread with its own event loop.

    `token` is the control-plane bearer token the servers accept (None: every
    control request is 401). On exit every server is stopped and the thread joined.
    """
    import asyncio

    host = Host(load_spec(spec), token=token)
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(host.serve(on_started=started.set))
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=run, name="gymsim-cluster", daemon=True)
    thread.start()
    if not started.wait(STARTUP_TIMEOUT_S) or failure:
        host.stop()
        raise RuntimeError(f"gymsim cluster did not start: {failure[0] if failure else 'timeout'}")
    try:
        yield RunningCluster(host)
    finally:
        while thread.is_alive():
            host.stop()
            thread.join(timeout=0.5)


class ClusterProcess(_ConfigMixin):
    """A cluster running as `python -m quiesce.tools.gymsim` in its own process (`spawn_cluster`)."""

    def __init__(
        self, process: subprocess.Popen[bytes], spec: ClusterSpec, config_path: Path, log_path: Path
    ):
        self.process = process
        self.spec = spec
        self.config_path = config_path
        self.log_path = log_path
        written = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        self.urls = {entry["name"]: entry["url"] for entry in written["servers"]}

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log(self) -> str:
        """What the process wrote to stdout and stderr so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def kill(self) -> None:
        """SIGKILL the cluster process and reap it: no server gets to clean up."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a clean shutdown); SIGKILL if it does not exit within `timeout_s`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.wait()


@contextlib.contextmanager
def spawn_cluster(
    spec: SpecLike = None,
    *,
    env: Mapping[str, str],
    workdir: str | os.PathLike[str] | None = None,
) -> Iterator[ClusterProcess]:
    """Run `python -m quiesce.tools.gymsim` as a subprocess and wait for the config it writes.

    `env` is added to this process's environment (put the control token there, e.g.
    `{"NEMO_GYM_CHECKPOINT_CONTROL_TOKEN": "..."}`). The spec goes to the child as a
    YAML file; the config file is written by the child once every server listens.
    On exit the process is terminated (SIGTERM, then SIGKILL) unless already dead.
    """
    cluster_spec = load_spec(spec)
    with contextlib.ExitStack() as stack:
        folder = (
            Path(workdir).resolve()
            if workdir is not None
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        folder.mkdir(parents=True, exist_ok=True)
        spec_path = folder / "gymsim-spec.yaml"
        config_path = folder / "gymsim-cluster.yaml"
        log_path = folder / "gymsim.log"
        with contextlib.suppress(FileNotFoundError):
            config_path.unlink()
        spec_path.write_text(
            yaml.safe_dump(cluster_spec.model_dump(mode="json"), sort_keys=False), encoding="utf-8"
        )
        child_env = {**os.environ, **env}
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(IMPORT_ROOT), child_env.get("PYTHONPATH")) if p
        )
        log_file = stack.enter_context(open(log_path, "wb"))
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "quiesce.tools.gymsim",
                "--spec",
                str(spec_path),
                "--config-out",
                str(config_path),
            ],
            env=child_env,
            cwd=str(IMPORT_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            give_up = time.monotonic() + STARTUP_TIMEOUT_S
            while not config_path.exists():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"gymsim exited with {process.returncode} before it was ready:\n"
                        + log_path.read_text(errors="replace")
                    )
                if time.monotonic() > give_up:
                    raise RuntimeError("gymsim did not write its config in time:\n" + log_path.read_text())
                time.sleep(0.02)
            cluster = ClusterProcess(process, cluster_spec, config_path, log_path)
        except BaseException:
            if process.poll() is None:
                process.kill()
            process.wait()
            raise
        try:
            yield cluster
        finally:
            cluster.terminate()
