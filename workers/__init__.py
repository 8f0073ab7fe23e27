"""The model runtime: checkpoint loading, tokenizer, the decoder (dense and MoE), sampler, runner.

Public surface:
- :class:`ModelRunner` — ``execute(StepPlan) -> StepResult`` over a paged KV cache.
- :func:`load_checkpoint`, :class:`ModelConfig`, :class:`CheckpointError` — local HF checkpoints.
- :class:`Tokenizer`, :class:`IncrementalDetokenizer` — text in and streamed text out.

Names resolve lazily, so a process that only tokenizes never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "ModelConfig": "checkpoint",
    "load_checkpoint": "checkpoint",
    "ModelRunner": "runner",
    "Tokenizer": "tokenizer",
    "IncrementalDetokenizer": "tokenizer",
    "TokenizerError": "tokenizer",
}

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "IncrementalDetokenizer",
    "ModelConfig",
    "ModelRunner",
    "Tokenizer",
    "TokenizerError",
    "load_checkpoint",
]

if TYPE_CHECKING:
    from .checkpoint import (
        Checkpoint,
        CheckpointError,
        ModelConfig,
        load_checkpoint,
    )
    from .runner import ModelRunner
    from .tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
