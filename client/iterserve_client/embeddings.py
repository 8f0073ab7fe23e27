"""``client.embeddings``: ``POST /v1/embeddings`` (a server started with
``--runner pooling``), with its typed result. A ``base64`` answer is decoded:
``embedding`` is a list of floats either way."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from typing import Any

from iterserve_client._base import json_body, request_body
from iterserve_client.types import Usage, _opt, _pick


def _floats(value: Any) -> list[float]:
    if isinstance(value, str):  # little-endian float32s, as OpenAI's base64
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return list(value or [])


@dataclass
class Embedding:
    index: int = 0
    embedding: list[float] = field(default_factory=list)
    object: str = "embedding"

    @classmethod
    def from_dict(cls, data: Any) -> Embedding:
        data = data if isinstance(data, dict) else {}
        return _pick(cls, data, embedding=_floats(data.get("embedding")))


@dataclass
class EmbeddingList:
    """The answer of ``POST /v1/embeddings``: ``data[i]`` is input ``i``'s."""

    data: list[Embedding] = field(default_factory=list)
    model: str = ""
    object: str = "list"
    usage: Usage | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: Any) -> EmbeddingList:
        data = data if isinstance(data, dict) else {}
        items = sorted(data.get("data") or [], key=lambda d: d.get("index", 0))
        return cls(
            data=[Embedding.from_dict(item) for item in items],
            model=str(data.get("model", "")),
            object=str(data.get("object", "list")),
            usage=_opt(Usage, data.get("usage")),
            raw=data,
        )


class Embeddings:
    """``client.embeddings``."""

    def __init__(self, client: Any):
        self._client = client

    def create(
        self,
        *,
        model: str,
        input: str | list[str] | list[int] | list[list[int]],
        dimensions: int | None = None,
        encoding_format: str | None = None,
        **extra: Any,
    ) -> EmbeddingList:
        """``POST /v1/embeddings``; ``extra`` (``normalize``, ``priority``, ...) is sent as is.

        >>> out = client.embeddings.create(model="demo-embed", input=["a cat", "a dog"])
        >>> len(out.data), len(out.data[0].embedding)
        """
        body = request_body(locals())
        return EmbeddingList.from_dict(json_body(self._client._send("POST", "/v1/embeddings",
                                                                    json=body)))  # fmt: skip


class AsyncEmbeddings(Embeddings):
    """``client.embeddings`` of the :class:`~iterserve_client.AsyncClient`."""

    async def create(self, **kwargs: Any) -> EmbeddingList:  # type: ignore[override]
        """As :meth:`Embeddings.create`, awaited."""
        response = await self._client._send("POST", "/v1/embeddings", json=request_body(kwargs))
        return EmbeddingList.from_dict(json_body(response))
