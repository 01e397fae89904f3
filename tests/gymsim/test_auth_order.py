"""The order of body validation and the token check, as Gym's own routes and as gymsim's default.

Gym's FastAPI routes validate the body (or query) first and check the token inside the handler:
a request with neither a valid token nor a valid body gets 422, one with a valid body 401 — and a
refused request changes nothing. gymsim refuses a bad token before anything else unless the spec
says `body_before_auth`.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import AGENT, CAPABILITIES_PATH, MODEL, UNAUTHORIZED_DETAIL, route
from quiesce.tools.gymsim.cluster import start_cluster
from tests.gymsim.conftest import TOKEN, auth

pytestmark = pytest.mark.timeout(60)


def _spec(body_before_auth: bool) -> dict[str, Any]:
    return {
        "servers": [
            {"kind": "model", "name": "policy_model", "body_before_auth": body_before_auth},
            {
                "kind": "agent",
                "name": "simple_agent",
                "policy": "policy_model",
                "acknowledgement": "receipt_status",
                "body_before_auth": body_before_auth,
            },
        ]
    }


@pytest.mark.parametrize("body_before_auth", [False, True])
def test_a_bad_token_is_refused_before_or_after_the_body_as_the_spec_says(body_before_auth: bool) -> None:
    malformed = 422 if body_before_auth else 401
    with start_cluster(_spec(body_before_auth), token=TOKEN) as gym, httpx.Client(timeout=10) as http:
        agent, model = gym.urls["simple_agent"], gym.urls["policy_model"]
        valid = {"checkpoint_id": "ck-order", "deadline_ts": time.time() + 30}
        cases: list[tuple[str, str, str, dict[str, Any], int]] = [
            # (method, url, path, body or query, status without a valid token)
            ("POST", agent, route(AGENT, "prepare").full_path, {"checkpoint_id": "-bad"}, malformed),
            ("POST", agent, route(AGENT, "prepare").full_path, valid, 401),
            ("POST", model, route(MODEL, "pause").full_path, {**valid, "extra": 1}, malformed),
            ("POST", model, route(MODEL, "pause").full_path, valid, 401),
            ("POST", agent, route(AGENT, "acknowledge").full_path, {"executions": []}, malformed),
            ("GET", agent, route(AGENT, "status").full_path, {}, malformed),
            ("GET", agent, route(AGENT, "status").full_path, {"checkpoint_id": "ck-order"}, 401),
        ]
        for token in (None, "not-the-token"):
            for method, url, path, data, status in cases:
                sent = (
                    http.post(url + path, json=data, headers=auth(token))
                    if method == "POST"
                    else http.get(url + path, params=data, headers=auth(token))
                )
                assert sent.status_code == status, (method, path, data, sent.text)
                if status == 401:
                    assert sent.json() == {"detail": UNAUTHORIZED_DETAIL}
        for url in (agent, model):  # nothing refused changed a fence
            caps = http.get(url + CAPABILITIES_PATH).json()
            assert (caps["phase"], caps["active_checkpoint_id"]) == ("idle", None)
            log = [
                e
                for e in http.get(url + "/gymsim/admin/control-log").json()
                if e["path"] != CAPABILITIES_PATH
            ]
            assert len(log) == 2 * len([c for c in cases if c[1] == url])
            assert all(e["authorized"] is False and e["status"] in (401, 422) for e in log), log
        # with the token the same valid request goes through
        ok = http.post(agent + route(AGENT, "prepare").full_path, json=valid, headers=auth())
        assert ok.status_code == 200, ok.text
        done = http.post(
            agent + route(AGENT, "resume").full_path,
            json={**valid, "deadline_ts": time.time() + 30},
            headers=auth(),
        )
        assert done.status_code == 200, done.text
