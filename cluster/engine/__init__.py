"""The engine: one scheduler and its ranks, and the one way clients reach it.

- :mod:`.core` — ``EngineCore``, the scheduler actor's loop (schedule, submit,
  collect, update, publish), its requests and their outputs;
- :mod:`.intake` — what it checks in a request from the wire;
- :mod:`.outputs` — each client's outputs, one batch per step;
- :mod:`.channel` — the engine channel, the socket every client speaks over,
  and the engine's end of it; :mod:`.connection` — the client's end;
- :mod:`.errors` — refusals and failures, as clients see them;
- :mod:`.server` — an engine copy as a Serve deployment;
- :mod:`.api` — ``AsyncEngine`` and ``LLM``, the engine in a Python program.

``AsyncEngine``, ``LLM`` and the error classes are importable from here.
"""

from __future__ import annotations

# What an engine's start-up answer and /version show of how its ranks compute: the
# dtype and why, the CPU's instruction set, the kernel each op runs, whether each row is
# computed apart from its batch, the weights' quantization.
RUNTIME_KEYS = ("dtype", "dtype_reason", "isa", "kernels", "batch_invariant", "quantization")

_API = {"AsyncEngine", "LLM", "Completion"}
_ERRORS = {
    "ContextLengthError", "EngineBusyError", "EngineDeadError", "EngineError", "EngineRefusal",
    "EngineUnavailableError", "InvalidRequestError",
}  # fmt: skip


def __getattr__(name: str):
    # Loaded on first use: the HTTP layer needs the errors without Ray's start-up code.
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in _ERRORS:
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
