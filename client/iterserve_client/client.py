"""The synchronous client."""

from __future__ import annotations

import time
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
from iterserve_client.embeddings import Embeddings
from iterserve_client.responses import Responses
from iterserve_client.stats import EngineStats
from iterserve_client.streaming import Stream
from iterserve_client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    Completion,
    CompletionChunk,
    Health,
    Model,
)


class Client:
    """A client for one iterserve server.

    ``base_url`` is the server's root (``/v1`` at its end is accepted too).
    ``timeout`` is in seconds, per read while streaming. Connection failures
    and 429/503 answers are retried up to ``max_retries`` times with
    exponential backoff and full jitter (``backoff_base``, ``backoff_max``);
    ``max_retries=0`` turns retries off. ``http_client`` replaces the
    ``httpx.Client`` the client would create (proxies, TLS, transports).

    >>> from iterserve_client import Client
    >>> with Client("http://127.0.0.1:8000", api_key="secret") as client:
    ...     out = client.completions.create(model="demo", prompt="Once upon a", max_tokens=8)
    ...     print(out.choices[0].text)
    ...     print(client.health().healthy, client.stats().slot_utilization)
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
        http_client: httpx.Client | None = None,
    ):
        self.base_url = server_root(base_url)
        self.timeout = make_timeout(timeout)
        self.retry = RetryPolicy(max_retries, backoff_base, backoff_max)
        self._headers = default_headers(api_key, headers)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.Client()
        self.completions = Completions(self)
        self.chat = Chat(self)
        self.responses = Responses(self)
        self.embeddings = Embeddings(self)

    # -- the API ----------------------------------------------------------------------

    def models(self) -> list[Model]:
        """``GET /v1/models``: the served models (``[m.id for m in client.models()]``)."""
        body = json_body(self._send("GET", "/v1/models"))
        return [Model.from_dict(m) for m in body.get("data", [])]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """``POST /v1/load_lora_adapter``: serves the PEFT adapter at ``lora_path`` (a
        directory on the server) as model ``lora_name``; returns the server's message.
        A bad adapter raises the 400's error, naming the problem."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return (self._send("POST", "/v1/load_lora_adapter", json=body)).text

    def unload_lora_adapter(self, lora_name: str) -> str:
        """``POST /v1/unload_lora_adapter``: stops serving adapter ``lora_name``
        (requests on it already running finish on it)."""
        body = {"lora_name": lora_name}
        return (self._send("POST", "/v1/unload_lora_adapter", json=body)).text

    def health(self) -> Health:
        """``GET /health``: truthy when healthy; a 503 is an unhealthy answer, not an error."""
        response = self._send("GET", "/health", accept=(503,))
        return Health(
            healthy=response.is_success,
            status_code=response.status_code,
            message=health_message(response),
            body=response.text,
        )

    def stats(self) -> EngineStats:
        """``GET /v1/stats``: running and waiting requests, slots, KV blocks, policy."""
        return EngineStats.from_dict(json_body(self._send("GET", "/v1/stats")))

    # -- the operator's routes (vLLM's paths; docs/serving.md, Operator routes) -------

    def pause(self, mode: str = "abort", timeout: float | None = 600.0) -> dict[str, Any]:
        """``POST /pause``: every engine replica stops generating. ``mode``: ``abort``
        ends what runs, ``wait`` lets it finish first (the call returns then), ``keep``
        keeps it to go on at :meth:`resume`. Requests sent meanwhile wait."""
        return json_body(self._send("POST", "/pause", params={"mode": mode}, timeout=timeout))

    def resume(self) -> dict[str, Any]:
        """``POST /resume``: generating again (a 409 while asleep: :meth:`wake_up` first)."""
        return json_body(self._send("POST", "/resume"))

    def is_paused(self) -> bool:
        """``GET /is_paused``: whether every engine replica is paused."""
        return bool(json_body(self._send("GET", "/is_paused"))["is_paused"])

    def sleep(
        self, level: int = 1, mode: str = "abort", timeout: float | None = 600.0
    ) -> dict[str, Any]:
        """``POST /sleep``: pauses (``mode``), then the ranks release their weights and
        KV cache (``level`` 1 or 2: the same here, docs/serving.md)."""
        params = {"level": level, "mode": mode}
        return json_body(self._send("POST", "/sleep", params=params, timeout=timeout))

    def wake_up(self, timeout: float | None = 900.0) -> dict[str, Any]:
        """``POST /wake_up``: the ranks reload (as long as a start takes), and a pause the
        sleep made ends."""
        return json_body(self._send("POST", "/wake_up", timeout=timeout))

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: whether any engine replica is asleep."""
        return bool(json_body(self._send("GET", "/is_sleeping"))["is_sleeping"])

    # -- transport --------------------------------------------------------------------

    def _send(
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
                response = self._http.send(request, stream=stream)
                if response.is_success or response.status_code in accept:
                    return response
                response.read()
                response.close()
            except httpx.TransportError as exc:
                delay = self.retry.next_delay(attempt, exc)
                if delay is None:
                    raise transport_error(exc, url) from exc
            else:
                error = status_error(response)
                delay = self.retry.next_delay(attempt, error)
                if delay is None:
                    raise error
            time.sleep(delay)
            attempt += 1

    def _create(self, path: str, body: dict, cls: Any, chunk_cls: Any) -> Any:
        if body.get("stream"):
            return Stream(self._send("POST", path, json=body, stream=True), chunk_cls.from_dict)
        return cls.from_dict(json_body(self._send("POST", path, json=body)))

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Completions:
    """``client.completions``."""

    def __init__(self, client: Client):
        self._client = client

    def create(
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
    ) -> Completion | Stream[CompletionChunk]:
        """``POST /v1/completions``. Arguments left ``None`` are not sent (the
        server's defaults apply); ``extra`` keywords are sent as they are.
        With ``stream=True`` returns a :class:`Stream` of :class:`CompletionChunk`.

        >>> out = client.completions.create(
        ...     model="demo", prompt="The capital of France is", max_tokens=8, temperature=0
        ... )
        >>> out.choices[0].text, out.choices[0].finish_reason, out.usage.total_tokens
        >>> for chunk in client.completions.create(model="demo", prompt="Hi", stream=True):
        ...     print(chunk.choices[0].text if chunk.choices else "", end="", flush=True)
        """
        body = request_body(locals())
        return self._client._create("/v1/completions", body, Completion, CompletionChunk)


class ChatCompletions:
    """``client.chat.completions``."""

    def __init__(self, client: Client):
        self._client = client

    def create(
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
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """``POST /v1/chat/completions``; ``messages`` are dicts or :class:`ChatMessage`.
        With ``stream=True`` returns a :class:`Stream` of :class:`ChatCompletionChunk`.

        >>> out = client.chat.completions.create(
        ...     model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16
        ... )
        >>> out.choices[0].message.content
        >>> stream = client.chat.completions.create(
        ...     model="demo", messages=[{"role": "user", "content": "Hello!"}], stream=True
        ... )
        >>> with stream:
        ...     for chunk in stream:
        ...         print(chunk.choices[0].delta.content or "", end="")
        """
        body = request_body(locals())
        return self._client._create(
            "/v1/chat/completions", body, ChatCompletion, ChatCompletionChunk
        )


class Chat:
    """``client.chat``: holds ``completions``."""

    def __init__(self, client: Client):
        self.completions = ChatCompletions(client)
