"""Cluster config: validation names the file and the field; relative paths; the token's source."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from quiesce.coordinator import ConfigError, load_config, resolve_token
from quiesce.coordinator.calls import Caller, token_problem
from quiesce.coordinator.config import find_token
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK

GOOD = """
ledger: sqlite+aiosqlite:///state/quiesce.db
snapshots: ./checkpoints
servers:
  - {name: policy_model, url: "http://127.0.0.1:8001"}
  - {name: judge, url: "http://127.0.0.1:8002/", instance_role: auxiliary}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "cluster.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, GOOD))
    folder = (tmp_path / "conf").resolve()
    assert config.ledger == f"sqlite+aiosqlite:///{folder / 'state' / 'quiesce.db'}"
    assert config.snapshots == folder / "checkpoints"
    assert config.staging_root == folder / "checkpoints" / ".staging"
    assert (config.deadline_s, config.control_timeout_s, config.keep_latest) == (60.0, 10.0, 3)
    assert (config.fanout, config.durability, config.token_env) == ("sequential", "full", TOKEN_ENV)
    assert config.servers[1].url == "http://127.0.0.1:8002"
    assert config.servers[1].instance_role == "auxiliary"


def test_default_ledger_is_next_to_the_config(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "servers: [{name: m, url: 'http://h:1'}]\n"))
    assert config.ledger == f"sqlite+aiosqlite:///{(tmp_path / 'conf' / 'quiesce.db').resolve()}"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            "servers: [{name: a, url: 'http://h:1'}, {name: b, url: 'http://h:2'}, {name: c, url: 'nope'}]",
            "servers[2].url",
        ),
        ("servers: [{name: a, url: 'http://h:1', color: red}]", "servers[0].color"),
        ("servers: [{name: a, url: 'http://h:1', instance_role: judge}]", "servers[0].instance_role"),
        ("deadline_s: 0\nservers: [{name: a, url: 'http://h:1'}]", "deadline_s"),
        ("fanout: wide\nservers: [{name: a, url: 'http://h:1'}]", "fanout"),
        ("keep_latest: 0\nservers: [{name: a, url: 'http://h:1'}]", "keep_latest"),
        ("ledger: mysql://x\nservers: [{name: a, url: 'http://h:1'}]", "ledger"),
        ("servers: []", "servers"),
        ("snapshots: x", "servers"),
        ("servers: [{name: a, url: 'http://h:1'}, {name: a, url: 'http://h:2'}]", "servers[1].name"),
        ("servers: [{name: 'bad name', url: 'http://h:1'}]", "servers[0].name"),
        ("servers: [{name: a, url: 'http://h:99999'}]", "servers[0].url"),
    ],
)
def test_errors_name_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{field}:" in message


def test_unreadable_and_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "servers: [unclosed"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


def test_token_from_env_with_fallback(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, GOOD))
    assert resolve_token(config, {TOKEN_ENV: "a", TOKEN_ENV_FALLBACK: "b"}) == "a"
    assert resolve_token(config, {TOKEN_ENV_FALLBACK: "b"}) == "b"
    with pytest.raises(ConfigError) as caught:
        resolve_token(config, {})
    assert TOKEN_ENV in str(caught.value)
    custom = load_config(_write(tmp_path, "token_env: MY_TOKEN\n" + GOOD))
    assert resolve_token(custom, {"MY_TOKEN": "c", TOKEN_ENV: "a"}) == "c"


def test_the_version_constant_is_the_installed_package_version() -> None:
    """pyproject reads the version from `quiesce.coordinator.version` at build time; the metadata of the
    installed package (what pip shows) must agree with what `coordinator.started` records."""
    from importlib.metadata import version

    from quiesce.coordinator.coordinator import quiesce_version
    from quiesce.coordinator.version import VERSION

    assert version("quiesce") == VERSION == quiesce_version()


@pytest.mark.parametrize("token", ["two words", "line\nbreak", "caf\u00e9", "tab\t"])
def test_a_token_that_is_not_visible_ascii_is_refused_without_being_shown(tmp_path: Path, token: str) -> None:
    config = load_config(_write(tmp_path, "servers: [{name: m, url: 'http://h:1'}]\n"))
    with pytest.raises(ConfigError) as caught:
        resolve_token(config, {config.token_env: token})
    assert token not in str(caught.value)
    assert config.token_env in str(caught.value)
    assert token_problem(token) is not None
    with pytest.raises(ConfigError, match="control token holds") as refused:
        Caller(cast(Any, None), token, epoch=1)
    assert token not in str(refused.value)
    with pytest.raises(ConfigError) as unset_not:
        find_token(config, {config.token_env: token})
    assert token not in str(unset_not.value)


def test_no_token_is_none_for_find_token_and_an_error_for_resolve_token(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "servers: [{name: m, url: 'http://h:1'}]\n"))
    assert find_token(config, {}) is None
    assert find_token(config, {config.token_env: ""}) is None  # empty counts as unset
    with pytest.raises(ConfigError, match=config.token_env):
        resolve_token(config, {})
