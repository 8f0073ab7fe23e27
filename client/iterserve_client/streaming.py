"""Server-Sent Event streams of typed chunks.

The server sends ``data: {json}`` events separated by blank lines and ends
with ``data: [DONE]``. A stream that ends without ``[DONE]`` was cut short and
raises :class:`APIConnectionError`; an ``{"error": ...}`` event raises the
error it describes. Nothing here retries: once the first byte has arrived,
the request is running on the server.

Whenever iteration stops early — ``break``, an exception, ``close()``, the
``with`` block ending, the stream being garbage collected — the HTTP
connection is closed, and the server aborts the request and frees its slot.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, TypeVar

import httpx

from iterserve_client.errors import APIConnectionError, APIError, APITimeoutError, stream_error

T = TypeVar("T")
DONE = "[DONE]"


class SSEDecoder:
    """Lines in, event data out (``data:`` lines of one event joined by newlines)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line without its newline; returns an event's data when a blank line ends it."""
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: carry nothing the API uses

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def _transport_error(exc: httpx.HTTPError, request_id: str | None) -> APIError:
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"the stream broke off: {type(exc).__name__}: {exc}", request_id=request_id)


class _Events:
    """Turns event data into chunks; shared by the sync and async streams."""

    def __init__(self, parse: Callable[[dict], T], request_id: str | None):
        self.parse = parse
        self.request_id = request_id
        self.decoder = SSEDecoder()

    def chunk(self, data: str) -> Any:
        try:
            body = json.loads(data)
        except ValueError:
            raise APIConnectionError(
                f"the stream sent an event that is not JSON: {data[:200]!r}",
                request_id=self.request_id,
            ) from None
        if isinstance(body, dict) and "error" in body:
            raise stream_error(body, self.request_id)
        return self.parse(body)

    def cut_short(self) -> APIError:
        return APIConnectionError(
            "the stream ended before data: [DONE]", request_id=self.request_id
        )


class Stream(Generic[T]):
    """An iterator of typed chunks over one streaming HTTP response.

    >>> with client.completions.create(model="m", prompt="Hi", stream=True) as stream:
    ...     for chunk in stream:
    ...         print(chunk.choices[0].text, end="")
    """

    def __init__(self, response: httpx.Response, parse: Callable[[dict], T]):
        self.response = response
        self.request_id = response.headers.get("x-request-id")
        self._events = _Events(parse, self.request_id)
        self._iterator = self._iterate()

    def _iterate(self) -> Iterator[T]:
        try:
            # The trailing "" ends a last event that lacks its blank line.
            for line in itertools.chain(self.response.iter_lines(), [""]):
                data = self._events.decoder.feed(line)
                if data is None:
                    continue
                if data.strip() == DONE:
                    return
                yield self._events.chunk(data)
            raise self._events.cut_short()
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.request_id) from exc
        finally:
            self.close()

    def __iter__(self) -> Iterator[T]:
        # A fresh generator per loop: when a ``for`` loop is left by ``break`` its
        # generator is dropped at once, and its ``finally`` closes the connection.
        yield from self._iterator

    def __next__(self) -> T:
        return next(self._iterator)

    def close(self) -> None:
        """Closes the connection; the server then aborts the request."""
        self.response.close()

    @property
    def closed(self) -> bool:
        return self.response.is_closed

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        response = getattr(self, "response", None)
        if response is not None:
            response.close()


_PENDING_CLOSES: set[asyncio.Task] = set()


class AsyncStream(Generic[T]):
    """An async iterator of typed chunks over one streaming HTTP response.

    >>> stream = await client.completions.create(model="m", prompt="Hi", stream=True)
    >>> async with stream:
    ...     async for chunk in stream:
    ...         print(chunk.choices[0].text, end="")
    """

    def __init__(self, response: httpx.Response, parse: Callable[[dict], T]):
        self.response = response
        self.request_id = response.headers.get("x-request-id")
        self._events = _Events(parse, self.request_id)
        self._iterator = self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        try:
            async for line in self._lines():
                data = self._events.decoder.feed(line)
                if data is None:
                    continue
                if data.strip() == DONE:
                    return
                yield self._events.chunk(data)
            raise self._events.cut_short()
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.request_id) from exc
        finally:
            await self.close()

    async def _lines(self) -> AsyncIterator[str]:
        async for line in self.response.aiter_lines():
            yield line
        yield ""  # ends a last event that lacks its blank line

    async def __aiter__(self) -> AsyncIterator[T]:
        # As in Stream.__iter__: a dropped loop generator is finalised by the
        # event loop, which runs its ``finally`` and closes the connection.
        try:
            async for chunk in self._iterator:
                yield chunk
        finally:
            await self.close()

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def close(self) -> None:
        """Closes the connection; the server then aborts the request."""
        await self.response.aclose()

    @property
    def closed(self) -> bool:
        return self.response.is_closed

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def __del__(self) -> None:
        response = getattr(self, "response", None)
        if response is None or response.is_closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to close it on; the pool drops the socket later
            return
        task = loop.create_task(response.aclose())
        _PENDING_CLOSES.add(task)
        task.add_done_callback(_PENDING_CLOSES.discard)
