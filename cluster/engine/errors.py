"""What an engine's clients see go wrong, in one place for every client.

A request the engine refuses before it starts raises an :class:`EngineRefusal`
whose class says why; the wire carries only its ``kind``, and :func:`refusal`
is the one mapping back. A request that fails after it was accepted ends with
an error output (``EngineOutput.failed``); an in-process client raises
:class:`EngineError` for it, the HTTP layer answers 503.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a request (its ranks failed, or it is gone)."""


class EngineRefusal(Exception):
    """The engine refused a request before it started; ``kind`` names why, as
    the engine channel carries it."""

    kind = "unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequestError(EngineRefusal, ValueError):
    """The request was refused for its content; the message names the problem."""

    kind = "invalid"


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room for output in the engine's context."""

    kind = "prompt_too_long"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model (a LoRA adapter) the engine does not serve."""

    kind = "model_not_found"


class EngineBusyError(EngineRefusal):
    """The engine's waiting queue is full; retry later."""

    kind = "queue_full"


class EngineUnavailableError(EngineRefusal, EngineError):
    """No engine could take the request (none answers, or its channel closed)."""

    kind = "unavailable"


class EngineDeadError(EngineUnavailableError):
    """The engine's ranks are gone and could not be restarted."""

    kind = "engine_dead"


class EngineDrainingError(EngineUnavailableError):
    """The engine is stopping: it finishes what it has and takes nothing new."""

    kind = "draining"


_BY_KIND = {
    cls.kind: cls
    for cls in (
        InvalidRequestError,
        ContextLengthError,
        ModelNotFoundError,
        EngineBusyError,
        EngineUnavailableError,
        EngineDeadError,
        EngineDrainingError,
    )
}


def refusal(kind: str, message: str) -> EngineRefusal:
    """The refusal a client raises for ``(kind, message)`` from the engine."""
    return _BY_KIND.get(kind, EngineUnavailableError)(message)
