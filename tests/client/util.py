"""Helpers that let one test body drive the sync and the async client."""

from __future__ import annotations

import inspect
from typing import Any


async def resolve(value: Any) -> Any:
    """Awaits what the async client returns; passes the sync client's results through."""
    return await value if inspect.isawaitable(value) else value


async def collect(stream: Any) -> list:
    if hasattr(stream, "__aiter__"):
        return [chunk async for chunk in stream]
    return list(stream)
