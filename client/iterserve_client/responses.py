"""``client.responses``: the Responses API (``POST /v1/responses``, ``GET`` and
``DELETE /v1/responses/{id}``), with its typed results.

A stream yields :class:`ResponseEvent` objects (``type``, ``sequence_number``,
and per type ``delta``, ``item``, ``response``); an ``error`` event raises the
error it describes, as a chat stream's error does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve_client._base import json_body, request_body
from iterserve_client.errors import stream_error
from iterserve_client.types import _list, _opt, _pick

# The error types of the codes an error event may carry (the server's own codes).
_ERROR_TYPES = {"timeout": "timeout_error", "engine_unavailable": "service_unavailable_error"}


@dataclass
class ResponseUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: dict[str, Any] = field(default_factory=dict)
    output_tokens_details: dict[str, Any] = field(default_factory=dict)

    @property
    def reasoning_tokens(self) -> int:
        return int(self.output_tokens_details.get("reasoning_tokens", 0))

    @classmethod
    def from_dict(cls, data: Any) -> ResponseUsage:
        return _pick(cls, data)


@dataclass
class ResponseItem:
    """One output item: a ``message`` (``content`` parts, ``text``), a
    ``function_call`` (``name``, ``arguments`` as JSON text, ``call_id``), or a
    ``reasoning`` item (``content`` parts, ``text``)."""

    type: str = ""
    id: str | None = None
    status: str | None = None
    role: str | None = None
    content: list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str:
        """A message's or a reasoning item's text, its parts joined."""
        return "".join(part.get("text", "") for part in self.content or [])

    def to_dict(self) -> dict[str, Any]:
        """The item as an input item of a later request."""
        return dict(self.raw)

    @classmethod
    def from_dict(cls, data: Any) -> ResponseItem:
        return _pick(cls, data)


@dataclass
class Response:
    """The answer of ``POST /v1/responses``; ``output_text`` joins its messages' text."""

    id: str = ""
    object: str = "response"
    created_at: float = 0
    status: str | None = None
    model: str = ""
    output: list[ResponseItem] = field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None
    error: dict[str, Any] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def output_text(self) -> str:
        return "".join(item.text for item in self.output if item.type == "message")

    @classmethod
    def from_dict(cls, data: Any) -> Response:
        data = data if isinstance(data, dict) else {}
        return _pick(
            cls,
            data,
            output=_list(ResponseItem, data.get("output")),
            usage=_opt(ResponseUsage, data.get("usage")),
        )


@dataclass
class ResponseEvent:
    """One streamed event. ``delta``: the text of a ``*.delta`` event; ``item``: the
    item of ``response.output_item.added``/``.done``; ``response``: the response of
    ``response.created``, ``.in_progress``, ``.completed`` and ``.incomplete``."""

    type: str = ""
    sequence_number: int = 0
    delta: str | None = None
    output_index: int | None = None
    item: ResponseItem | None = None
    response: Response | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any) -> ResponseEvent:
        data = data if isinstance(data, dict) else {}
        if data.get("type") == "error":
            error = {k: data.get(k) for k in ("message", "code", "param")}
            kind = _ERROR_TYPES.get(str(error["code"]), "internal_error")
            raise stream_error({"error": {**error, "type": kind}}, None)
        return _pick(
            cls,
            data,
            item=_opt(ResponseItem, data.get("item")),
            response=_opt(Response, data.get("response")),
        )


def _body(params: dict[str, Any]) -> dict[str, Any]:
    body = request_body(params)
    if isinstance(body.get("input"), list):
        body["input"] = [i.to_dict() if hasattr(i, "to_dict") else i for i in body["input"]]
    return body


class Responses:
    """``client.responses``."""

    def __init__(self, client: Any):
        self._client = client

    def create(
        self,
        *,
        model: str,
        input: str | list[dict[str, Any] | ResponseItem],
        instructions: str | None = None,
        previous_response_id: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        text: dict[str, Any] | None = None,
        store: bool | None = None,
        stream: bool = False,
        **extra: Any,
    ) -> Any:
        """``POST /v1/responses``; items of an earlier output (:class:`ResponseItem`)
        may be passed back in ``input``. With ``stream=True`` returns a
        :class:`~iterserve_client.Stream` of :class:`ResponseEvent`.

        >>> r = client.responses.create(model="demo", input="Say hi", max_output_tokens=16)
        >>> r.output_text, r.usage.output_tokens
        >>> with client.responses.create(model="demo", input="Hi", stream=True) as events:
        ...     for event in events:
        ...         if event.type == "response.output_text.delta":
        ...             print(event.delta, end="")
        """
        body = _body(locals())
        return self._client._create("/v1/responses", body, Response, ResponseEvent)

    def retrieve(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``: a stored response (NotFoundError when not stored)."""
        return Response.from_dict(json_body(self._client._send("GET", _path(response_id))))

    def delete(self, response_id: str) -> None:
        """``DELETE /v1/responses/{id}``."""
        self._client._send("DELETE", _path(response_id))


class AsyncResponses(Responses):
    """``client.responses`` of the :class:`~iterserve_client.AsyncClient`."""

    async def create(self, **kwargs: Any) -> Any:  # type: ignore[override]
        """As :meth:`Responses.create`, awaited."""
        body = _body(kwargs)
        return await self._client._create("/v1/responses", body, Response, ResponseEvent)

    async def retrieve(self, response_id: str) -> Response:  # type: ignore[override]
        response = await self._client._send("GET", _path(response_id))
        return Response.from_dict(json_body(response))

    async def delete(self, response_id: str) -> None:  # type: ignore[override]
        await self._client._send("DELETE", _path(response_id))


def _path(response_id: str) -> str:
    from urllib.parse import quote

    return f"/v1/responses/{quote(response_id, safe='')}"
