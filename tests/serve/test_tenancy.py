"""A request's tenant and first-token target at the HTTP edge (no Ray): read from
the gateway's header, else the OpenAI ``user`` field; refused by name when bad."""

from __future__ import annotations

import pytest

from iterserve.cluster.openai.tenancy import FAIRNESS_HEADER, SLO_HEADER
from tests.serve.conftest import MODEL, inproc

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app(tools_tokenizer_dir):
    return inproc(tools_tokenizer_dir)


def post(app, route=COMPLETIONS, headers=None, **fields):
    http, engine = app
    engine.opened.clear()
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return http.post(route, json=body, headers=headers or {}), engine.opened


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_the_user_field_names_the_tenant_and_the_gateways_header_wins(app, route):
    r, opened = post(app, route, user="alice")
    assert r.status_code == 200, r.text
    assert [params.get("tenant") for _, params in opened] == ["alice"]
    r, opened = post(app, route, headers={FAIRNESS_HEADER: "team-a"}, user="alice")
    assert r.status_code == 200 and opened[0][1]["tenant"] == "team-a"


def test_without_either_the_request_is_the_default_tenants(app):
    r, opened = post(app)
    assert r.status_code == 200 and "tenant" not in opened[0][1]
    r, opened = post(app, user="")
    assert r.status_code == 200 and "tenant" not in opened[0][1]


def test_every_choice_carries_the_tenant_and_the_target(app):
    r, opened = post(app, headers={SLO_HEADER: "250"}, user="bob", n=3)
    assert r.status_code == 200, r.text
    assert [(p["tenant"], p["slo_ttft_ms"]) for _, p in opened] == [("bob", 250.0)] * 3


@pytest.mark.parametrize("user", [123, 1.5, True, ["alice"], {"id": "alice"}])
def test_a_user_that_is_not_a_string_is_a_400_naming_it(app, user):
    r, opened = post(app, user=user)
    assert r.status_code == 400 and not opened
    error = r.json()["error"]
    assert error["param"] == "user" and "must be a string" in error["message"]


def test_a_tenant_past_its_length_is_a_400_naming_where_it_came_from(app):
    r, opened = post(app, user="u" * 129)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user" and not opened
    r, opened = post(app, headers={FAIRNESS_HEADER: "h" * 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == FAIRNESS_HEADER


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "1e9"])
def test_a_first_token_target_that_is_not_a_sane_number_is_a_400(app, value):
    r, opened = post(app, headers={SLO_HEADER: value})
    assert r.status_code == 400 and not opened
    assert r.json()["error"]["param"] == SLO_HEADER
