"""What the scheduler raises: refusals the caller answers, and protocol bugs."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class PromptTooLongError(ValueError):
    """The prompt leaves no room for output within ``max_model_len``."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int):
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens; this model's context is "
            f"{max_model_len} tokens (max_model_len), which must hold the prompt and at least "
            f"one output token"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class ProtocolError(RuntimeError):
    """A rank's result contradicts the scheduler's own state: a bug, never user input."""
