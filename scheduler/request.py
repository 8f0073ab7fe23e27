"""A request and its lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .adapters import Adapter
from .block_hash import chain_block_hashes
from .messages import DEFAULT_TENANT, PromptLogprobs
from .sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= RequestStatus.FINISHED_STOPPED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """Why a sequence ended, as reported by the rank that sampled its last token."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        return _REASON_TO_STATUS[self]

    @property
    def openai(self) -> str:
        """The OpenAI ``finish_reason``: ``length``, else ``stop`` (an abort included)."""
        return "length" if self is FinishReason.LENGTH else "stop"

    @property
    def category(self) -> str:
        """What metrics count it as: ``stop`` (EOS or a stop token), ``length``,
        ``abort`` or ``error``."""
        return _CATEGORIES[self]


_CATEGORIES = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}
_REASON_TO_STATUS = {
    FinishReason.EOS: RequestStatus.FINISHED_STOPPED,
    FinishReason.STOP_TOKEN: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate.

    The scheduler schedules by token count, not by phase: a request has
    ``num_tokens`` tokens (prompt + output so far) of which the first
    ``num_computed_tokens`` are in the KV cache. A step computes some of the
    rest; when it reaches ``num_tokens`` the step samples one more token::

        prompt            output
        [p p p p p p p p][o o o]
        |<- computed ---------->|   num_computed_tokens == num_tokens - 1: decoding
        |<- computed ->|            partial prefill (or recompute after preemption)

    ``num_computed_tokens`` advances when a step is *scheduled*. While a step
    that samples for the request is still running, its token is counted in
    ``num_pending`` (known to the ranks, not yet to the scheduler), so a
    decode can be scheduled again before the last one's token has come back.

    With prefix caching, a request admitted with its first blocks found in the
    cache starts with ``num_computed_tokens`` at the end of those blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # The caller's own name for the request (a client's request id), for logs and
    # the ranks; unlike ``request_id`` it need not be unique. Empty: request_id.
    label: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0
    slot_idx: int = -1
    seq_id: int = -1  # given by the scheduler at admission: unique, unlike request_id
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Mixed into the hash of its first KV block: requests share cached blocks only
    # with requests of the same salt (a tenant's isolation key, an adapter's id).
    cache_salt: str = ""
    # Content hashes of its full blocks of known tokens, extended as tokens come.
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens its first admission found in the prefix cache (None: not admitted yet).
    num_cached_tokens: int | None = None
    # Tokens computed before its last preemption: what recompute may have to redo.
    num_dropped_tokens: int = 0
    # Whose request it is (``scheduling_policy: fair`` takes turns between tenants),
    # and when its first token is due (monotonic seconds; None: no target).
    tenant: str = DEFAULT_TENANT
    ttft_deadline: float | None = None
    # The LoRA adapter its tokens compute with (None: the base model), named by the
    # client as ``lora_name``; the scheduler resolves the name when it queues it.
    lora_name: str | None = None
    adapter: Adapter | None = None
    lora_slot: int = 0  # the ranks' slot of that adapter while it runs; 0: none
    # What the engine around the scheduler keeps of a request lives here too, so
    # that a request is in one table (Scheduler.requests): the client that reads
    # its outputs, and the times its metrics are measured from (``now`` of the
    # schedule() that first admitted it; its first and latest output tokens).
    client: str = ""
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.label = self.label or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def finishes_in_flight(self) -> bool:
        """Whether a step already running samples this request's last token (max_tokens)."""
        return self.num_pending > 0 and (
            self.num_output_tokens + self.num_pending >= self.params.max_tokens
        )

    @property
    def is_decoding(self) -> bool:
        return self.num_remaining_tokens == 1 and self.num_output_tokens > 0

    def full_block_hashes(self, block_size: int) -> list[bytes]:
        """The hashes of its full blocks of known tokens (prompt and output so far)."""
        hashes = self.block_hashes
        end = self.num_tokens // block_size * block_size
        start = len(hashes) * block_size
        if start < end:  # only the new blocks' tokens are sliced: a decode fills one
            prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
            if start >= n:
                tokens = self.output_token_ids[start - n : end - n]
            else:
                tokens = prompt[start:end] + self.output_token_ids[: max(0, end - n)]
            parent = hashes[-1] if hashes else None
            hashes.extend(chain_block_hashes(parent, tokens, block_size, self.cache_salt))
        return hashes

    def sort_key(self) -> tuple[int, float, str]:
        """Service order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    # (logprob, [(token_id, logprob)]) per token; the shared empty tuple until one
    # comes (most requests ask for none: no list per output for the collector).
    new_logprobs: list | tuple = ()
    finish_reason: FinishReason | None = None
    # Set on a request's first output with tokens: how many of its prompt tokens
    # were found in the prefix cache (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int | None = None
    # The prompt's logprobs, in the output of the step that completed the prompt
    # of a request that asked for them.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling engine's vector of the prompt, in the output that finishes it.
    pooled: list[float] | None = None
    request: Request | None = field(default=None, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
