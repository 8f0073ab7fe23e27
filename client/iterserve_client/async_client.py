"""The asynchronous client: the same surface as :class:`~iterserve_client.Client`, awaited."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from iterserve_client._base import (
    RetryPolicy,
    default_headers,
    health_message,
    json_body,
    make_timeout,
    request_body,
    server_root,
    status_error,
    transport_error,
)
from iterserve_client.embeddings import AsyncEmbeddings
from iterserve_client.responses import AsyncResponses
from iterserve_client.stats import EngineStats
from iterserve_client.streaming import AsyncStream
from iterserve_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    Completion,
    CompletionChunk,
    Health,
    Model,
)


class AsyncClient:
    """An asyncio client for one iterserve server; arguments as for ``Client``.

    Connection failures and 429/503 answers are retried up to ``max_retries``
    times with exponential backoff and full jitter (``backoff_base``, ``backoff_max``);
    ``max_retries=0`` turns retries off. ``http_client`` replaces the
    ``httpx.AsyncClient`` the client would create.

    >>> import asyncio
    >>> from iterserve_client import AsyncClient
    >>> async def main():
    ...     async with AsyncClient("http://127.0.0.1:8000") as client:
    ...         out = await client.completions.create(model="demo", prompt="Hi", max_tokens=8)
    ...         print(out.choices[0].text, (await client.stats()).num_running)
    >>> asyncio.run(main())
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = 60.0,
        max_retries: int = 2,
        *,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        headers: dict[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ):
        self.base_url = server_root(base_url)
        self.timeout = make_timeout(timeout)
        self.retry = RetryPolicy(max_retries, backoff_base, backoff_max)
        self._headers = default_headers(api_key, headers)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient()
        self.completions = AsyncCompletions(self)
        self.chat = AsyncChat(self)
        self.responses = AsyncResponses(self)
        self.embeddings = AsyncEmbeddings(self)

    # -- the API ----------------------------------------------------------------------

    async def models(self) -> list[Model]:
        """``GET /v1/models``: the served models (``[m.id for m in client.models()]``)."""
        body = json_body(await self._send("GET", "/v1/models"))
        return [Model.from_dict(m) for m in body.get("data", [])]

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """``POST /v1/load_lora_adapter``: serves the PEFT adapter at ``lora_path`` (a
        directory on the server) as model ``lora_name``; returns the server's message.
        A bad adapter raises the 400's error, naming the problem."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return (await self._send("POST", "/v1/load_lora_adapter", json=body)).text

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """``POST /v1/unload_lora_adapter``: stops serving adapter ``lora_name``
        (requests on it already running finish on it)."""
        body = {"lora_name": lora_name}
        return (await self._send("POST", "/v1/unload_lora_adapter", json=body)).text

    async def health(self) -> Health:
        """``GET /health``: truthy when healthy; a 503 is an unhealthy answer, not an error."""
        response = await self._send("GET", "/health", accept=(503,))
        return Health(
            healthy=response.is_success,
            status_code=response.status_code,
            message=health_message(response),
            body=response.text,
        )

    async def stats(self) -> EngineStats:
        """``GET /v1/stats``: running and waiting requests, slots, KV blocks, policy."""
        return EngineStats.from_dict(json_body(await self._send("GET", "/v1/stats")))

    # -- the operator's routes (vLLM's paths; docs/serving.md, Operator routes) -------

    async def pause(self, mode: str = "abort", timeout: float | None = 600.0) -> dict[str, Any]:
        """``POST /pause``: every engine replica stops generating. ``mode``: ``abort``
        ends what runs, ``wait`` lets it finish first (the call returns then), ``keep``
        keeps it to go on at :meth:`resume`. Requests sent meanwhile wait."""
        return json_body(await self._send("POST", "/pause", params={"mode": mode}, timeout=timeout))

    async def resume(self) -> dict[str, Any]:
        """``POST /resume``: generating again (a 409 while asleep: :meth:`wake_up` first)."""
        return json_body(await self._send("POST", "/resume"))

    async def is_paused(self) -> bool:
        """``GET /is_paused``: whether every engine replica is paused."""
        return bool(json_body(await self._send("GET", "/is_paused"))["is_paused"])

    async def sleep(
        self, level: int = 1, mode: str = "abort", timeout: float | None = 600.0
    ) -> dict[str, Any]:
        """``POST /sleep``: pauses (``mode``), then the ranks release their weights and
        KV cache (``level`` 1 or 2: the same here, docs/serving.md)."""
        params = {"level": level, "mode": mode}
        return json_body(await self._send("POST", "/sleep", params=params, timeout=timeout))

    async def wake_up(self, timeout: float | None = 900.0) -> dict[str, Any]:
        """``POST /wake_up``: the ranks reload (as long as a start takes), and a pause the
        sleep made ends."""
        return json_body(await self._send("POST", "/wake_up", timeout=timeout))

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: whether any engine replica is asleep."""
        return bool(json_body(await self._send("GET", "/is_sleeping"))["is_sleeping"])

    # -- transport --------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        stream: bool = False,
        accept: tuple[int, ...] = (),
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """One request, retried per ``self.retry``; returns a 2xx (or ``accept``ed)
        answer or raises its typed error. With ``stream`` the body is left unread."""
        url = self.base_url + path
        attempt = 0
        while True:
            request = self._http.build_request(
                method, url, json=json, params=params, headers=self._headers,
                timeout=self.timeout if timeout is None else make_timeout(timeout),
            )  # fmt: skip
            try:
                response = await self._http.send(request, stream=stream)
                if response.is_success or response.status_code in accept:
                    return response
                await response.aread()
                await response.aclose()
            except httpx.TransportError as exc:
                delay = self.retry.next_delay(attempt, exc)
                if delay is None:
                    raise transport_error(exc, url) from exc
            else:
                error = status_error(response)
                delay = self.retry.next_delay(attempt, error)
                if delay is None:
                    raise error
            await asyncio.sleep(delay)
            attempt += 1

    async def _create(self, path: str, body: dict, cls: Any, chunk_cls: Any) -> Any:
        if body.get("stream"):
            response = await self._send("POST", path, json=body, stream=True)
            return AsyncStream(response, chunk_cls.from_dict)
        return cls.from_dict(json_body(await self._send("POST", path, json=body)))

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


class AsyncCompletions:
    """``client.completions``."""

    def __init__(self, client: AsyncClient):
        self._client = client

    async def create(
        self,
        *,
        model: str,
        prompt: str | list[str] | list[int] | list[list[int]],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        logprobs: int | None = None,
        priority: int | None = None,
        stream: bool = False,
        stream_options: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Completion | AsyncStream[CompletionChunk]:
        """``POST /v1/completions``. Arguments left ``None`` are not sent (the
        server's defaults apply); ``extra`` keywords are sent as they are.
        With ``stream=True`` returns an :class:`AsyncStream` of :class:`CompletionChunk`.

        >>> out = await client.completions.create(model="demo", prompt="Hi", max_tokens=8)
        >>> out.choices[0].text
        >>> stream = await client.completions.create(model="demo", prompt="Hi", stream=True)
        >>> async with stream:
        ...     async for chunk in stream:
        ...         print(chunk.choices[0].text if chunk.choices else "", end="")
        """
        body = request_body(locals())
        return await self._client._create("/v1/completions", body, Completion, CompletionChunk)


class AsyncChatCompletions:
    """``client.chat.completions``."""

    def __init__(self, client: AsyncClient):
        self._client = client

    async def create(
        self,
        *,
        model: str,
        messages: list[dict[str, Any] | ChatMessage],
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        priority: int | None = None,
        stream: bool = False,
        stream_options: dict[str, Any] | None = None,
        **extra: Any,
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST /v1/chat/completions``; ``messages`` are dicts or :class:`ChatMessage`.
        With ``stream=True`` returns an :class:`AsyncStream` of :class:`ChatCompletionChunk`.

        >>> messages = [{"role": "user", "content": "Hello!"}]
        >>> out = await client.chat.completions.create(model="demo", messages=messages)
        >>> out.choices[0].message.content
        >>> stream = await client.chat.completions.create(
        ...     model="demo", messages=messages, stream=True
        ... )
        >>> async for chunk in stream:
        ...     print(chunk.choices[0].delta.content or "", end="")
        """
        body = request_body(locals())
        return await self._client._create(
            "/v1/chat/completions", body, ChatCompletion, ChatCompletionChunk
        )


class AsyncChat:
    """``client.chat``: holds ``completions``."""

    def __init__(self, client: AsyncClient):
        self.completions = AsyncChatCompletions(client)
