"""Fixtures for the client's tests: a stub server and clients of both kinds."""

from __future__ import annotations

from typing import Any

import pytest
from iterserve_client import AsyncClient, Client

from tests.client.stub import StubServer
from tests.client.util import resolve

# Backoff small enough that retries cost nothing in the tests.
FAST = {"backoff_base": 0.001, "backoff_max": 0.01}


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.close()


@pytest.fixture(params=["sync", "async"])
def kind(request) -> str:
    return request.param


@pytest.fixture
async def make_client(kind, stub):
    """``make_client(**kwargs)``: a Client or AsyncClient for the stub (or ``base_url``)."""
    clients: list[Any] = []

    def make(base_url: str | None = None, **kwargs: Any):
        cls = Client if kind == "sync" else AsyncClient
        client = cls(base_url or stub.url, **{**FAST, **kwargs})
        clients.append(client)
        return client

    yield make
    for client in clients:
        await resolve(client.close())
