"""The scheduler's frozen configuration. No I/O; derived values are properties."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("static", "dynamic", "continuous", "chunked")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches.

    policy: ``static`` | ``dynamic`` | ``continuous`` | ``chunked``.
    max_num_seqs: slots, i.e. sequences that may run at once (static's batch size).
    max_num_batched_tokens: the per-step token budget (padding included).
    max_model_len: prompt + output tokens of one sequence, at most.
    block_size / num_kv_blocks: the paged KV cache.
    kv_layout: ``paged`` allocates blocks as tokens are scheduled; ``slab``
        reserves ``max_model_len`` worth of blocks per sequence at admission
        (the naive one-slab-per-slot layout, for comparison).
    max_queue_len: waiting requests beyond this are refused (queue full).
    max_num_partial_prefills: prompts that may be part-way through prefill at once (chunked).
    long_prefill_token_threshold: a prompt with more tokens left than this is
        "long"; each of its pieces is capped at this many tokens so it takes only
        its share of the budget (chunked; 0 = no cap).
    batch_timeout_s: static waits this long for a full batch before launching a partial one.
    batch_wait_s: dynamic launches a pending batch when it is full or its oldest
        request has waited this long.
    """

    policy: str = "chunked"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 4096
    kv_layout: str = "paged"
    max_queue_len: int = 4096
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    batch_timeout_s: float = 1.0
    batch_wait_s: float = 0.02
    max_n: int = 16
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.kv_layout not in ("paged", "slab"):
            raise ValueError(f"kv_layout must be 'paged' or 'slab', got {self.kv_layout!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
            "max_num_partial_prefills",
            "max_n",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_queue_len", "long_prefill_token_threshold", "max_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.batch_timeout_s < 0 or self.batch_wait_s < 0:
            raise ValueError("batch_timeout_s and batch_wait_s must be >= 0")
        if self.num_kv_blocks < self.blocks_per_seq_max:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) cannot hold one sequence of max_model_len "
                f"{self.max_model_len} ({self.blocks_per_seq_max} blocks of {self.block_size})"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"policy {self.policy!r} prefills whole prompts: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )

    @property
    def chunked_prefill(self) -> bool:
        return self.policy == "chunked"

    @property
    def blocks_per_seq_max(self) -> int:
        return -(-self.max_model_len // self.block_size)
