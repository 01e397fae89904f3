"""`quiesce conformance`: exit codes, the table, `--json`, token handling, the plane (detected or
`--plane`) and `--lease-check`."""

from __future__ import annotations

import json
import socket

import pytest

from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.cli.main import main
from tests.conformance.conftest import TOKEN, StartFake, StartFakeV2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)


def test_json_output_and_exit_0_on_a_conformant_server(
    start_fake: StartFake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake(AGENT)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["conformance", url, "--json", "--timeout", "10"]) == 0
    out = capsys.readouterr().out
    document = json.loads(out)
    assert document["passed"] is True
    assert document["component"] == AGENT
    assert document["summary"]["fail"] == 0
    rows = {c["name"]: c for c in document["checks"]}
    assert rows["cycle.commit"]["status"] == "pass"
    assert set(rows["cycle.commit"]) == {"name", "status", "detail"}
    assert TOKEN not in out


def test_table_and_exit_1_on_a_broken_server(
    start_fake: StartFake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake(RESOURCES, faults=frozenset({"wrong_digest"}))
    monkeypatch.setenv(TOKEN_ENV_FALLBACK, TOKEN)  # the fallback variable is read too
    assert main(["conformance", url, "--timeout", "10"]) == 1
    out = capsys.readouterr().out
    assert "artifacts.manifest_digest" in out
    assert "FAIL" in out
    assert "not conformant" in out
    assert TOKEN not in out


def test_token_env_option_names_the_variable(
    start_fake: StartFake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake(MODEL, role="policy")
    monkeypatch.setenv("MY_GYM_TOKEN", TOKEN)
    monkeypatch.setenv(TOKEN_ENV, "a-wrong-token-that-must-not-be-used")
    assert main(["conformance", url, "--token-env", "MY_GYM_TOKEN", "--json", "--timeout", "10"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_exit_2_when_the_token_variable_is_unset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert TOKEN_ENV in err
    assert TOKEN_ENV_FALLBACK in err
    assert main(["conformance", "http://127.0.0.1:9", "--token-env", "NOPE_UNSET"]) == 2
    assert "NOPE_UNSET" in capsys.readouterr().err


def test_exit_2_when_the_url_is_unreachable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["conformance", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 2
    captured = capsys.readouterr()
    assert "cannot reach" in captured.err
    assert TOKEN not in captured.err + captured.out
    assert main(["conformance", "not-a-url", "--timeout", "5"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_the_unified_plane_is_detected_and_reported_in_json(
    start_fake_v2: StartFakeV2, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake_v2("environment", grace_s=1.0)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["conformance", url, "--json", "--timeout", "10", "--lease-check"]) == 0
    out = capsys.readouterr().out
    document = json.loads(out)
    assert (document["plane"], document["component"], document["name"]) == ("v2", "environment", "fake")
    rows = {c["name"]: c for c in document["checks"]}
    assert rows["plane.detected"]["status"] == "pass"
    assert rows["lease.expiry"]["status"] == "pass"
    assert rows["cleanup.idle"]["status"] == "pass"
    assert TOKEN not in out


def test_plane_forces_a_checker(
    start_fake_v2: StartFakeV2, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake_v2("model")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    # v1's checker on a v2 participant: no capabilities, not conformant.
    assert main(["conformance", url, "--plane", "v1", "-o", "jsonl", "--timeout", "10"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["name"] == "capabilities.shape"
    assert lines[0]["status"] == "fail"
    assert main(["conformance", url, "--plane", "v2", "--timeout", "10"]) == 0
    out = capsys.readouterr().out
    assert "unified plane" in out
    assert "--plane v2 given" in out
    with pytest.raises(SystemExit) as bad:
        main(["conformance", url, "--plane", "v3"])
    assert bad.value.code == 2
    assert "choose from v1, v2" in capsys.readouterr().err


def test_a_broken_v2_participant_exits_1_with_the_row_named(
    start_fake_v2: StartFakeV2, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = start_fake_v2("resources", faults=frozenset({"never_fence"}))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["conformance", url, "--timeout", "10"]) == 1
    out = capsys.readouterr().out
    assert "fence.stale_after_resume" in out
    assert "not conformant" in out
