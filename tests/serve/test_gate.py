"""The ASGI gate on its own (no Ray): request ids, auth, and the last-resort 500."""

from __future__ import annotations

from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from iterserve.cluster.openai.gate import APISettings, Gate


async def failing_app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/boom":
        raise RuntimeError("a bug")
    await PlainTextResponse("ok")(scope, receive, send)


def client(**settings) -> TestClient:
    return TestClient(Gate(failing_app, APISettings(**settings)))


def test_an_unexpected_exception_is_a_500_in_the_error_shape():
    http = client()
    r = http.get("/boom", headers={"X-Request-Id": "abc"})
    assert r.status_code == 500
    assert r.headers["x-request-id"] == "abc"
    error = r.json()["error"]
    assert error["code"] == "internal_error" and error["request_id"] == "abc"
    assert "a bug" not in error["message"]  # internals stay in the log


def test_every_response_gets_a_request_id():
    http = client()
    first, second = http.get("/x"), http.get("/x")
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


def test_the_key_is_checked_everywhere_but_health():
    http = client(api_key="k")
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
    assert http.get("/health").status_code == 200
