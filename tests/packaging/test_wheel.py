"""The built wheel, installed as a user installs it: one import name, a base install that never
crashes, and a user's project whose own `ledger`, `coordinator`, `tools` and `migrations`
packages come first on `sys.path`.

One fresh virtual environment (no system site-packages) gets the wheel with its base
dependencies only; the base-install checks run there first (every `--help`, a missing extra named
in one line with exit 2). Then the `serve` extra is added and, from the user's project, the CLI,
the embedded API, the service and a new ledger's migrations all run on a real reference cluster
started by the installed package itself. The project's own packages raise on import, so any bare
import inside quiesce fails these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import venv
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from quiesce.coordinator.protocol import TOKEN_ENV

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
SHADOWED = ("ledger", "coordinator", "tools", "migrations")
TOKEN = "wheel-test-token-0123456789"


@dataclass(frozen=True)
class Installed:
    """A virtual environment with the wheel installed, and the user's project beside it."""

    wheel: Path
    python: Path
    bin: Path
    project: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A user's environment: the venv's bin first, the project's packages first on the path,
        nothing of this repository's."""
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUIESCE_CONFIG", "VIRTUAL_ENV")
        }
        env["PATH"] = os.pathsep.join((str(self.bin), env.get("PATH", "")))
        env["PYTHONPATH"] = str(self.project)
        env["COLUMNS"] = "120"
        env.update(extra or {})
        return env

    def run(
        self, *argv: str, extra: Mapping[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """`argv` run in the project folder (argv[0] looked up in the venv's bin)."""
        program = self.bin / argv[0] if (self.bin / argv[0]).exists() else Path(argv[0])
        return subprocess.run(
            [str(program), *argv[1:]],
            cwd=self.project,
            env=self.env(extra),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _project(root: Path) -> Path:
    """A user's project whose own packages take quiesce's old top-level names; each one refuses
    to be imported, so a bare `import ledger` (etc.) anywhere in quiesce fails loudly."""
    project = root / "project"
    for name in SHADOWED:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(
            f"raise ImportError('the project\\'s own {name!r} package was imported by quiesce')\n"
        )
    (project / "run").mkdir()
    return project


def _source_copy(into: Path) -> Path:
    """The files git would commit (tracked, and new ones it does not ignore), links kept as links:
    a wheel built from the working tree itself could pick up a stale `build/` folder."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source, target = ROOT / name, into / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return into


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source = _source_copy(root / "source")
    dist = root / "dist"
    built = subprocess.run(  # build isolation, as a user's `pip wheel .` or `python -m build`
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("quiesce-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, str(wheel))
    return Installed(wheel, python, env_dir / "bin", _project(root))


def test_the_wheel_installs_one_top_level_name(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"quiesce"}
    for package in ("quiesce", *(f"quiesce/{name}" for name in SHADOWED)):
        assert f"{package}/__init__.py" in names, package
        assert f"{package}/py.typed" in names, package
    assert any(n.startswith("quiesce/migrations/versions/") and n.endswith(".py") for n in names)
    assert any(".dist-info/" in n and n.endswith("LICENSE") for n in names)  # the file pyproject names
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    with zipfile.ZipFile(installed.wheel) as wheel:
        assert wheel.read(top_level).decode().split() == ["quiesce"]


LIST_COMMANDS = """
import argparse
from quiesce.tools.cli.main import build_parser
for action in build_parser([])._actions:
    if isinstance(action, argparse._SubParsersAction):
        print(*action.choices)
"""


def _commands(installed: Installed) -> list[str]:
    """Every subcommand the installed CLI lists in its help."""
    listed = installed.run("python", "-c", LIST_COMMANDS)
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def test_a_base_install_answers_every_help(installed: Installed) -> None:
    """Base install only: no serve extra, no postgres extra (checked first), yet `quiesce`,
    `--help` of every command, and a mistyped command all answer without a traceback."""
    for missing in ("prometheus_client", "asyncpg"):
        probe = installed.run("python", "-c", f"import {missing}")
        assert probe.returncode != 0, f"{missing} is installed: this is not a base install"
    top = installed.run("quiesce", "--help")
    assert top.returncode == 0, top.stderr
    assert "usage: quiesce" in top.stdout
    commands = _commands(installed)
    assert {"serve", "checkpoint", "history", "db"} <= set(commands)
    for name in commands:
        done = installed.run("quiesce", name, "--help")
        assert done.returncode == 0, f"quiesce {name} --help: {done.stderr}"
        assert "Traceback" not in done.stderr
    bare = installed.run("quiesce")
    assert bare.returncode == 2
    assert "Traceback" not in bare.stderr
    wrong = installed.run("quiesce", "no-such-command")
    assert wrong.returncode == 2
    assert "Traceback" not in wrong.stderr


def _config(project: Path, ledger: str) -> Path:
    config = project / "missing-extras.yaml"
    config.write_text(
        f"ledger: {ledger}\nservers:\n  - {{name: policy_model, url: 'http://127.0.0.1:9'}}\n",
        encoding="utf-8",
    )
    return config


def test_a_missing_extra_is_one_line_and_exit_2(installed: Installed) -> None:
    config = _config(installed.project, "sqlite+aiosqlite:///run/extras.db")
    serve = installed.run("quiesce", "serve", "--config", str(config), extra={TOKEN_ENV: TOKEN})
    assert serve.returncode == 2, serve.stdout + serve.stderr
    assert "Traceback" not in serve.stderr
    assert "pip install 'quiesce[serve]'" in serve.stderr
    assert len(serve.stderr.strip().splitlines()) == 1, serve.stderr
    ledger = "postgresql+asyncpg://quiesce@127.0.0.1:9/quiesce"
    for argv in (
        ("history", "--ledger", ledger),
        ("db", "upgrade", "--ledger", ledger),
        ("checkpoint", "--config", str(_config(installed.project, ledger))),
    ):
        done = installed.run("quiesce", *argv, extra={TOKEN_ENV: TOKEN})
        assert done.returncode == 2, (argv, done.stdout + done.stderr)
        assert "Traceback" not in done.stderr
        assert "pip install 'quiesce[postgres]'" in done.stderr, (argv, done.stderr)
    # `config check` names it among its findings, as a failed offline check
    check = installed.run(
        "quiesce", "config", "check", "--config", str(_config(installed.project, ledger)), "--json"
    )
    assert check.returncode == 2, check.stdout + check.stderr
    found = {c["name"]: c for c in json.loads(check.stdout)["checks"]}
    assert found["install"]["ok"] is False
    assert "pip install 'quiesce[postgres]'" in found["install"]["detail"]


@dataclass
class Cluster:
    config: Path
    process: subprocess.Popen[str]


@pytest.fixture(scope="module")
def served(installed: Installed) -> Installed:
    """The same venv with the `serve` extra added (after the base-install checks ran)."""
    _pip(installed.python, f"{installed.wheel}[serve]")
    return installed


@pytest.fixture
def cluster(served: Installed) -> Iterator[Cluster]:
    """A reference Gym cluster started by the installed package from the project folder."""
    config = served.project / "cluster.yaml"
    config.unlink(missing_ok=True)
    process = subprocess.Popen(
        [str(served.bin / "quiesce"), "sim", "--config-out", str(config), "--ledger", "run/ledger.db"],
        cwd=served.project,
        env=served.env({TOKEN_ENV: TOKEN}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        give_up = time.monotonic() + 90
        while not config.exists():
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < give_up, "the installed gymsim did not start"
            time.sleep(0.05)
        yield Cluster(config, process)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


TRAINER = """
import json
import sys

import anyio

from quiesce import Coordinator


async def main() -> None:
    async with Coordinator.open("cluster.yaml") as coord:
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:
            (attempt.staging_dir / "trainer").mkdir()
            (attempt.staging_dir / "trainer" / "step.txt").write_text("7\\n")
    bare = sorted(m for m in sys.modules if m.split(".")[0] in {shadowed!r})
    print(json.dumps({{"id": attempt.checkpoint_id, "snapshot": str(attempt.snapshot), "bare": bare}}))


anyio.run(main)
"""


def test_cli_embedded_api_and_migrations_from_a_shadowing_project(
    served: Installed, cluster: Cluster
) -> None:
    env = {TOKEN_ENV: TOKEN}
    # a new ledger's migrations (alembic finds quiesce's own, not the project's `migrations`)
    fresh = served.run("quiesce", "db", "upgrade", "--ledger", "run/new.db", "--json", extra=env)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["changed"] is True
    # the embedded API, in the project's own script (its folder first on sys.path)
    (served.project / "train.py").write_text(TRAINER.format(shadowed=SHADOWED), encoding="utf-8")
    trained = served.run("python", "train.py", extra=env)
    assert trained.returncode == 0, trained.stderr
    result = json.loads(trained.stdout)
    assert result["bare"] == []
    snapshot = Path(result["snapshot"])
    snapshot = snapshot if snapshot.is_absolute() else served.project / snapshot
    assert (snapshot / "trainer" / "step.txt").read_text() == "7\n"
    # the CLI: another checkpoint, then the history lists both, ids whole
    checkpoint = served.run("quiesce", "checkpoint", "--config", "cluster.yaml", "--json", extra=env)
    assert checkpoint.returncode == 0, checkpoint.stderr
    second = json.loads(checkpoint.stdout)["checkpoint_id"]
    history = served.run("quiesce", "history", "--config", "cluster.yaml", "--json", extra=env)
    assert history.returncode == 0, history.stderr
    ids = [row["checkpoint_id"] for row in json.loads(history.stdout)]
    assert result["id"] in ids
    assert second in ids


SERVICE_CLIENT = """
import json
import os

import anyio

from quiesce import RemoteCoordinator


async def main() -> None:
    async with RemoteCoordinator(os.environ["SERVICE_URL"]) as coord:
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:
            pass
    print(json.dumps({"id": attempt.checkpoint_id}))


anyio.run(main)
"""


def test_the_service_from_a_shadowing_project(served: Installed, cluster: Cluster) -> None:
    env = {TOKEN_ENV: TOKEN, "QUIESCE_API_TOKEN": "wheel-api-token-0123456789"}
    service = subprocess.Popen(
        [
            str(served.bin / "quiesce"),
            "serve",
            "--config",
            "cluster.yaml",
            "--listen",
            "127.0.0.1:0",
            "--json",
        ],
        cwd=served.project,
        env=served.env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert service.stdout is not None
        line = service.stdout.readline()
        assert line, service.stderr.read() if service.stderr else ""
        url = json.loads(line)["listening"]
        (served.project / "remote.py").write_text(SERVICE_CLIENT, encoding="utf-8")
        done = served.run("python", "remote.py", extra={**env, "SERVICE_URL": url})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["id"].startswith("q")
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
    assert service.returncode == 0, service.stderr.read() if service.stderr else ""
