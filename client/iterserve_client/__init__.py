"""Python client for iterserve's OpenAI-compatible HTTP API.

>>> from iterserve_client import Client
>>> client = Client("http://127.0.0.1:8000")
>>> client.completions.create(model="demo", prompt="Hello", max_tokens=8).choices[0].text

Needs only httpx: it imports neither torch, ray nor triton.
"""

from iterserve_client._base import RetryPolicy
from iterserve_client._version import __version__
from iterserve_client.async_client import AsyncClient
from iterserve_client.client import Client
from iterserve_client.embeddings import Embedding, EmbeddingList
from iterserve_client.errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConnectionError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    TimeoutError,
    UnprocessableEntityError,
)
from iterserve_client.responses import Response, ResponseEvent, ResponseItem, ResponseUsage
from iterserve_client.stats import EngineStats
from iterserve_client.streaming import AsyncStream, Stream
from iterserve_client.types import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatLogprobs,
    ChatMessage,
    ChoiceDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    Health,
    Model,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatLogprobs",
    "ChatMessage",
    "ChoiceDelta",
    "Client",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "ConnectionError",
    "Embedding",
    "EmbeddingList",
    "EngineStats",
    "Health",
    "InternalServerError",
    "Model",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitError",
    "Response",
    "ResponseEvent",
    "ResponseItem",
    "ResponseUsage",
    "RetryPolicy",
    "ServiceUnavailableError",
    "Stream",
    "TimeoutError",
    "TokenLogprob",
    "TopLogprob",
    "UnprocessableEntityError",
    "Usage",
    "__version__",
]
