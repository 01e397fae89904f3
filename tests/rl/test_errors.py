"""`quiesce.rl.errors`: the backend's one error pickles to an equal-looking error and never shows
the control token; `from_quiesce` and `is_transient` judge quiesce's, Ray's and RL's failures by
RL's rule — transient when trying again may succeed, permanent when a retry would hide a broken
invariant — and name the server at fault where the error does."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from quiesce.coordinator.errors import (
    AcknowledgementError,
    ConfigError,
    DeadlineExceeded,
    DiscoveryError,
    FencedError,
    LedgerError,
    MissingExtra,
    PhaseError,
    QuiesceError,
    ServersHeld,
    SnapshotError,
)
from quiesce.coordinator.http import BadReply, ConnectFailed, ConnectionLost, ConnectTimeout, ReplyTimeout
from quiesce.coordinator.stranded import LedgerStranded
from quiesce.ledger.errors import BrokenChainError, LedgerUrlError
from quiesce.rl.errors import CODES, EnvironmentCheckpointError, from_quiesce, is_transient

TOKEN = "tok-3f9c1e77a2b54d0e"


def phase_error(
    reason: str, *, code: str | None = None, server: str | None = "env", phase: str = "commit"
) -> PhaseError:
    return PhaseError(
        f"checkpoint c1 rolled back: {reason}.", phase=phase, server=server, reason=reason, code=code
    )


# Stand-ins for NeMo RL's coordinator errors, which quiesce cannot import: the same names and
# the attributes RL's source gives them (`failures`, `blockers`).
class GymCheckpointUnavailable(RuntimeError):
    pass


class GymCheckpointNotReady(RuntimeError):
    def __init__(self, blockers: dict[str, dict[str, tuple[str, ...]]]) -> None:
        super().__init__(f"not ready: {blockers!r}")
        self.blockers = blockers


class GymCheckpointOperationError(RuntimeError):
    def __init__(self, operation: str, failures: dict[str, BaseException]) -> None:
        super().__init__(f"{operation} failed on {sorted(failures)}")
        self.operation = operation
        self.failures = failures


# ---------------------------------------------------------------------------------------------
# The error itself
# ---------------------------------------------------------------------------------------------


def test_the_error_pickles_to_an_equal_looking_error() -> None:
    error = EnvironmentCheckpointError(
        "commit failed at env", operation="commit", code="timeout", transient=True, server="env"
    )
    error.add_note("rolled back; every server is accepting again")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is EnvironmentCheckpointError
    assert str(again) == str(error) == "commit failed at env"
    assert (again.operation, again.server, again.code, again.transient) == ("commit", "env", "timeout", True)
    assert again.args == error.args
    assert again.__notes__ == ["rolled back; every server is accepting again"]
    assert repr(again) == repr(error)
    assert "operation='commit'" in repr(error)


def test_a_subclass_pickles_as_itself() -> None:
    class CutMismatch(EnvironmentCheckpointError):
        pass

    globals()["CutMismatch"] = CutMismatch  # pickled by reference: it must be reachable
    CutMismatch.__qualname__ = "CutMismatch"
    try:
        error = CutMismatch("cut differs", operation="snapshot", code="cut_mismatch", transient=False)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is CutMismatch
        assert (str(again), again.server, again.transient) == ("cut differs", None, False)
    finally:
        del globals()["CutMismatch"]


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"operation": ""}, ValueError, "names its operation"),
        ({"code": "Not-A-Code"}, ValueError, "lowercase letters"),
        ({"code": ""}, ValueError, "lowercase letters"),
        ({"transient": 1}, TypeError, "transient must be true or false"),
        ({"server": ""}, ValueError, "server must be a non-empty string"),
    ],
)
def test_the_error_refuses_fields_it_cannot_carry(
    fields: dict[str, Any], error: type[Exception], words: str
) -> None:
    given: dict[str, Any] = {"operation": "commit", "code": "failed", "transient": False, **fields}
    with pytest.raises(error, match=words):
        EnvironmentCheckpointError("x", **given)


def test_a_message_never_holds_the_token() -> None:
    error = EnvironmentCheckpointError(
        f"refused: Authorization: Bearer {TOKEN}; token {TOKEN}; ledger postgresql://q:{TOKEN}@db/q",
        operation="prepare",
        code="unauthorized",
        transient=False,
        secrets=[TOKEN],
    )
    assert TOKEN not in str(error)
    assert "Bearer <redacted>" in str(error)
    assert "postgresql://q:<redacted>@db/q" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error)
    # a bearer credential is removed even when the token was not given
    unnamed = EnvironmentCheckpointError(
        f"sent Bearer {TOKEN}", operation="renew", code="failed", transient=False
    )
    assert TOKEN not in str(unnamed)


def test_every_code_is_a_stable_lowercase_name() -> None:
    for code in CODES:
        EnvironmentCheckpointError("x", operation="snapshot", code=code, transient=CODES[code])
    assert {c for c, transient in CODES.items() if transient} == {
        "not_ready",
        "timeout",
        "connection",
        "unavailable",
        "servers_held",
        "busy",
        "lease_lost",
    }


# ---------------------------------------------------------------------------------------------
# quiesce's errors
# ---------------------------------------------------------------------------------------------

QUIESCE_CASES: list[tuple[BaseException, str, bool, str | None]] = [
    # not ready, deadlines, calls that got no reply: transient
    (
        DeadlineExceeded(
            "rolled back",
            phase="prepare",
            server="env",
            reason="not ready by the deadline — env: 2 episodes mid-turn",
        ),
        "not_ready",
        True,
        "env",
    ),
    (
        DeadlineExceeded(
            "rolled back",
            phase="prepare",
            server="agent",
            reason="agent never became ready to commit before the deadline (agent_prepare_incomplete)",
            code="agent_prepare_incomplete",
        ),
        "not_ready",
        True,
        "agent",
    ),
    (
        DeadlineExceeded("rolled back", phase="commit", server="env", reason="the attempt's deadline passed"),
        "timeout",
        True,
        "env",
    ),
    (phase_error("commit failed: timeout: no reply within 3.000s (the deadline)"), "timeout", True, "env"),
    (phase_error("prepare failed: connect: could not connect: refused"), "connection", True, "env"),
    (
        phase_error("prepare failed: http 409 deadline_exceeded: late", code="deadline_exceeded"),
        "timeout",
        True,
        "env",
    ),
    # held by another checkpoint, a lease that ran out: transient
    (
        phase_error("prepare failed: http 409 checkpoint_conflict: held by c0", code="checkpoint_conflict"),
        "servers_held",
        True,
        "env",
    ),
    (
        phase_error("commit failed: http 409 stale_checkpoint: resumed", code="stale_checkpoint"),
        "lease_lost",
        True,
        "env",
    ),
    (
        phase_error("commit failed: http 409 invalid_phase: idle", code="invalid_phase"),
        "lease_lost",
        True,
        "env",
    ),
    (
        phase_error(
            "a lease was lost: env no longer holds checkpoint c1: its renewal was refused (http 409"
            " stale_checkpoint) — its lease had run out",
            server=None,
        ),
        "lease_lost",
        True,
        None,
    ),
    (
        phase_error(
            "prepare answered phase 'idle': the server let go of this checkpoint while it was preparing",
            phase="prepare",
        ),
        "lease_lost",
        True,
        "env",
    ),
    (ServersHeld("held", {"model": "c7", "env": "c7"}), "servers_held", True, "env"),
    (ServersHeld("held"), "servers_held", True, None),
    (
        QuiesceError(
            "env no longer holds checkpoint c1: its renewal was refused (http 409 stale_checkpoint) — its"
            " lease had run out, or something resumed it"
        ),
        "lease_lost",
        True,
        "env",
    ),
    (
        QuiesceError(
            "cannot retire: env is prepared under checkpoint c9 (free it with `quiesce resume c9`)."
            " Gym refuses both until then: resume first"
        ),
        "servers_held",
        True,
        None,
    ),
    (QuiesceError("cannot prepare: attempt c1 is prepared; resume or abort it first"), "busy", True, None),
    (
        QuiesceError("cannot forget while checkpoint c1 is open (prepared): Gym refuses both"),
        "busy",
        True,
        None,
    ),
    (
        DiscoveryError(
            "cannot discover",
            [
                ("env", "cannot be reached at http://127.0.0.1:1: connect: could not connect"),
                ("agent", "cannot be reached"),
            ],
        ),
        "connection",
        True,
        "env",
    ),
    # malformed replies, refusals, config, ledger, snapshots: permanent
    (phase_error("commit failed: protocol: reply is not valid JSON"), "malformed_reply", False, "env"),
    (
        phase_error("commit failed: http 409 checkpoint_error: disk full", code="checkpoint_error"),
        "refused",
        False,
        "env",
    ),
    (
        phase_error(
            "prepare failed: http 401: missing or invalid control-plane bearer token", phase="prepare"
        ),
        "unauthorized",
        False,
        "env",
    ),
    (phase_error("env exported r1, which the scope does not name"), "phase_failed", False, "env"),
    (ConfigError("servers[0].url: required"), "config", False, None),
    (
        DiscoveryError("cannot discover", [("env", "is not a checkpoint participant: it answers 404")]),
        "discovery",
        False,
        "env",
    ),
    (DiscoveryError("mixed planes"), "discovery", False, None),
    (
        SnapshotError("snapshot /s/c1: records.jsonl digest differs", ["digest"]),
        "snapshot_invalid",
        False,
        None,
    ),
    (
        AcknowledgementError("refused", server="agent", status=409, code="x"),
        "acknowledgement",
        False,
        "agent",
    ),
    (FencedError("a newer coordinator (epoch 4) owns the ledger"), "fenced", False, None),
    (BrokenChainError("the chain breaks at seq 12", seq=12), "ledger_tampered", False, None),
    (LedgerUrlError("not a ledger URL"), "config", False, None),
    (LedgerError("schema ahead"), "ledger_unavailable", False, None),
    (LedgerStranded("disk full", checkpoint_id="c1", left_paused=["env"]), "ledger_unavailable", False, None),
    (MissingExtra(extra="ray", module="ray", needed_by="quiesce.rl"), "missing_extra", False, None),
    (QuiesceError("the ledger has no attempt c1"), "failed", False, None),
]


@pytest.mark.parametrize(("error", "code", "transient", "server"), QUIESCE_CASES)
def test_from_quiesce_classifies_quiesces_errors(
    error: BaseException, code: str, transient: bool, server: str | None
) -> None:
    converted = from_quiesce("snapshot", error)
    assert (converted.operation, converted.code, converted.transient, converted.server) == (
        "snapshot",
        code,
        transient,
        server,
    )
    assert is_transient(error) is transient
    assert str(error) in str(converted)
    assert f"({code})" in str(converted)
    again = pickle.loads(pickle.dumps(converted))
    assert (str(again), again.code, again.transient, again.server) == (
        str(converted),
        code,
        transient,
        server,
    )


# ---------------------------------------------------------------------------------------------
# Python's, the HTTP client's, Ray's and RL's failures
# ---------------------------------------------------------------------------------------------

OTHER_CASES: list[tuple[BaseException, str, bool]] = [
    (TimeoutError("no reply within 5.0s of the commit call"), "timeout", True),
    (ConnectTimeout("connect deadline"), "timeout", True),
    (ReplyTimeout("reply deadline"), "timeout", True),
    (ConnectionRefusedError(111, "refused"), "connection", True),
    (ConnectFailed("refused"), "connection", True),
    (ConnectionLost("reset"), "connection", True),
    (BadReply("not HTTP"), "malformed_reply", False),
    (ValueError("Gym checkpoint inventory does not match the live actor topology"), "invariant", False),
    (RuntimeError("two environment servers own r1"), "invariant", False),
    (TypeError("summary is not a GymCheckpointCommitSummary"), "invariant", False),
    (GymCheckpointNotReady({"gym/replica-0": {"env": ("r1",)}}), "not_ready", True),
    (GymCheckpointUnavailable("checkpoint_conflict"), "unavailable", True),
]


@pytest.mark.parametrize(("error", "code", "transient"), OTHER_CASES)
def test_other_failures_follow_rls_rule(error: BaseException, code: str, transient: bool) -> None:
    converted = from_quiesce("commit", error)
    assert (converted.code, converted.transient, converted.server) == (code, transient, None)
    assert is_transient(error) is transient
    assert type(error).__name__ in str(converted)


def test_an_operation_error_is_transient_only_when_every_failure_is() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    infra = GymCheckpointOperationError(
        "commit",
        {
            "gym/replica-1": TimeoutError("no reply"),
            "gym/replica-0": GymCheckpointUnavailable("conflict"),
            "gym/replica-2": ray_exceptions.ActorDiedError(),
        },
    )
    assert is_transient(infra)
    converted = from_quiesce("commit", infra)
    assert (converted.code, converted.transient, converted.server) == ("unavailable", True, "gym/replica-0")

    mixed = GymCheckpointOperationError(
        "commit", {"gym/replica-0": TimeoutError("no reply"), "gym/replica-1": ValueError("malformed reply")}
    )
    assert not is_transient(mixed)
    converted = from_quiesce("commit", mixed)
    assert (converted.code, converted.transient, converted.server) == ("invariant", False, "gym/replica-1")

    assert not is_transient(GymCheckpointOperationError("commit", {}))
    # a failure that names its own server keeps it
    named = GymCheckpointOperationError("restore", {"gym/replica-0": ServersHeld("held", {"env": "c3"})})
    assert from_quiesce("restore", named).server == "env"


def test_a_group_of_failures_is_transient_only_when_every_one_is() -> None:
    assert is_transient(ExceptionGroup("renewals", [TimeoutError(), ConnectionResetError()]))
    group = ExceptionGroup("renewals", [TimeoutError(), FencedError("fenced")])
    assert not is_transient(group)
    assert from_quiesce("renew", group).code == "fenced"


def test_rays_failures_are_judged_by_what_they_mean() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    assert from_quiesce("prepare", ray_exceptions.ActorDiedError()).code == "unavailable"
    assert is_transient(ray_exceptions.ActorUnavailableError("gone", b"0" * 16))
    assert is_transient(ray_exceptions.NodeDiedError("node"))
    assert from_quiesce("prepare", ray_exceptions.GetTimeoutError("late")).code == "timeout"
    assert not is_transient(ray_exceptions.ObjectFreedError("ab" * 20, "", ""))
    assert not is_transient(ray_exceptions.RuntimeEnvSetupError("bad env"))
    # a remote call's exception is judged by what it raised
    held = ray_exceptions.RayTaskError("checkpoint_prepare", "tb", ServersHeld("held", {"env": "c2"}))
    assert from_quiesce("prepare", held).code == "servers_held"
    assert from_quiesce("prepare", held.as_instanceof_cause()).server == "env"
    broken = ray_exceptions.RayTaskError("checkpoint_commit", "tb", ValueError("bad")).as_instanceof_cause()
    assert not is_transient(broken)


def test_an_environment_checkpoint_error_is_kept_as_it_is() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    ours = EnvironmentCheckpointError("custom", operation="snapshot", code="cut_check", transient=True)
    assert from_quiesce("restore", ours) is ours
    assert is_transient(ours)
    wrapped = ray_exceptions.RayTaskError("snapshot", "tb", ours).as_instanceof_cause()
    assert from_quiesce("restore", wrapped) is ours
    assert is_transient(ExceptionGroup("g", [ours, TimeoutError()]))


def test_from_quiesce_removes_the_token_it_is_given() -> None:
    error = RuntimeError(f"server echoed Authorization: {TOKEN}")
    converted = from_quiesce("prepare", error, secrets=[TOKEN])
    assert TOKEN not in str(converted)
    assert TOKEN not in str(pickle.loads(pickle.dumps(converted)))
