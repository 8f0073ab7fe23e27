"""The messages that cross the engine's boundaries: the two between the
scheduler and its ranks (:class:`StepPlan`, :class:`StepResult`), the request
a client hands an engine (:class:`EngineRequest`), and the record the engine
hands its clients (:class:`EngineOutput`, a step's worth for one client in
:class:`EngineOutputs`).

Only lists of ints, floats and short strings cross — never tensors, never
pickled objects. :mod:`iterserve.scheduler.codec` encodes them with msgpack.

A rank applies a :class:`StepPlan` in this order:

00. apply its :class:`KVTransfers` (``kv``): copy device blocks to host slots, then
    host slots to device blocks, then queue its disk reads and writes (they run in
    the background and are reported in a later result's :class:`KVReport`);
0. load every :class:`AdapterLoad` into its adapter slot (no sequence running
   in this plan uses the adapter the slot held before);
1. drop the state of every slot in ``released_slots`` (finished, aborted,
   preempted since the last plan) — a slot may be reused by step 2;
2. register every :class:`NewSequence` (full data, sent once);
3. for every :class:`ScheduledSeq`, append ``new_block_ids`` to the slot's block
   table and compute ``num_tokens`` tokens starting at ``start_pos``, plus
   ``num_pad_tokens`` padding tokens (static batching's padded prefill);
4. compute one padding token for each slot in ``padding_slots`` (static
   batching's finished-but-still-batched members);
5. sample one token for each scheduled sequence with ``sample`` set (one whose
   ``max_tokens`` is 0 is finished instead, with reason ``length``, unsampled);
   one with ``num_draft_tokens`` proposals (its ``draft_token_ids``, or its
   draft model's) samples after each of its rows and keeps the proposals those
   samples confirm: 1 to ``1 + num_draft_tokens`` tokens.

Within one step every entry's K/V is written before any entry attends (layer by
layer), so a sequence may start on cached blocks that another sequence of the
same step computes (prefix caching: ``NewSequence.num_cached_tokens``). A block
two sequences share is only ever written by the step that first computes it.

A plan built ``ahead`` was built while the step before it was still running,
so the scheduler did not yet know which sequences that step would end. A rank
turns each of its entries whose sequence ended in the previous step (by EOS or
a stop token: the scheduler foresees length limits) into one padding row: the
row is computed, as it would be on any machine, and its token discarded. Only
a plan built ahead may name such a slot; in any other plan it is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass(slots=True)
class NewSequence:
    """A sequence the ranks have not seen yet, sent in full once.

    ``seq_id`` names the sequence in every result; the scheduler never gives two
    requests the same one. ``label`` is its client's name for it (a user's request
    id), for logs only: it need not be unique, and the ranks key nothing by it
    (but the fake executor, a stand-in for tests, derives its tokens from it, so
    that a test can predict them). ``token_ids`` is the prompt plus
    any output produced before a preemption (recompute resumes from there); the
    first ``num_prompt_tokens`` are prompt. The first ``num_cached_tokens`` (whole
    blocks, fewer than ``len(token_ids)``) are in the KV cache already, in the
    first blocks of its first entry's ``new_block_ids``: its computation starts there.
    ``lora_slot`` is the adapter slot its rows compute with (0: the base model
    alone); the adapter stays in that slot while the sequence holds its slot.
    """

    seq_id: int
    label: str
    slot_idx: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    num_cached_tokens: int = 0
    lora_slot: int = 0


@dataclass(slots=True)
class AdapterLoad:
    """Puts a LoRA adapter into one of the ranks' adapter slots (1..max_loras),
    replacing whatever the slot held, before any row of the plan is computed.
    ``adapter_id`` names one registration of the adapter (a reload under the
    same name gets a new one); ``path`` is its PEFT checkpoint directory."""

    slot: int
    adapter_id: int
    name: str
    path: str


@dataclass(slots=True)
class ScheduledSeq:
    """Work for one sequence in one step.

    Computes positions ``[start_pos, start_pos + num_tokens)``; a decode is
    ``num_tokens == 1``, a prefill piece is a chunk of the prompt::

        block_size = 4, start_pos = 6, num_tokens = 5
        blocks:  [0 1 2 3][4 5 6 7][8 9 . .]
        cached:   x x x x  x x
        this step:             ^ ^  ^ ^ ^     <- a piece may start mid-block

    ``num_draft_tokens`` (speculative decoding, :mod:`.speculation`): a decode
    row's ``k`` proposed next tokens, ``draft_token_ids`` when the scheduler
    proposed them (prompt lookup), empty when the ranks' draft model
    proposes them. The entry computes its last known token and the proposals
    (``num_tokens == 1 + k``), samples after each, and keeps the proposals its
    samples confirm; the KV blocks of the positions it rejects are dropped
    from the table, here and on the ranks, by the rule of
    :meth:`~.seq_table.SequenceTable.take_drafts`.
    """

    slot_idx: int
    start_pos: int
    num_tokens: int
    # Read-only: the scheduler gives an entry that has none the shared empty tuple
    # (a decode in its last block; no proposals), so that a step of decodes does not
    # allocate two lists per sequence for the collector to count.
    new_block_ids: Sequence[int] = field(default_factory=list)
    sample: bool = False
    num_pad_tokens: int = 0
    draft_token_ids: Sequence[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # unset with named proposals: as many as they are

    def __post_init__(self) -> None:
        if self.draft_token_ids and not self.num_draft_tokens:
            self.num_draft_tokens = len(self.draft_token_ids)


@dataclass(slots=True)
class KVTransfers:
    """Moves between the KV cache's tiers that a step's plan carries (scheduler ->
    every rank; see :mod:`~iterserve.scheduler.kv_tiers`). A rank applies them at the
    start of the step, before any row, in this order:

    1. ``store_blocks[i]`` (a device block) -> ``store_slots[i]`` (a host slot);
    2. ``load_slots[i]`` (a host slot) -> ``load_blocks[i]`` (a fresh device block);
    3. ``clear_disk``: every file of the disk tier goes (before the writes below);
    4. queues the disk writes (host slot ``write_slots[i]`` as the file of
       ``write_keys[i]``, its parent ``write_parents[i]`` ("" for none) and tokens
       ``write_tokens[i]`` in the header), the deletions (``delete_keys``) and the
       reads (file ``read_keys[i]`` into host slot ``read_slots[i]``, reported by
       ``read_ids[i]``), which run in the background.

    Keys are block hashes in hex. Each rank reports every read once, in some later
    result's :class:`KVReport`, done or failed; a write it cannot make (its queue
    is full, the disk refuses) it reports as dropped.
    """

    store_blocks: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    clear_disk: bool = False
    write_slots: list[int] = field(default_factory=list)
    write_keys: list[str] = field(default_factory=list)
    write_parents: list[str] = field(default_factory=list)
    write_tokens: list[list[int]] = field(default_factory=list)
    delete_keys: list[str] = field(default_factory=list)
    read_ids: list[int] = field(default_factory=list)
    read_slots: list[int] = field(default_factory=list)
    read_keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class KVReport:
    """What a rank's KV tiers did since its last report (rank -> scheduler, in a
    :class:`StepResult`; every rank's are merged). ``reads_done``/``reads_failed``:
    disk reads (by read id) whose block is now in host memory, or is not (the file
    was gone, corrupt or foreign: deleted); ``writes_dropped``: keys whose write was
    not made. ``copy_s``: this step's stores and loads; ``read_s``/``write_s``: each
    finished read's and write's seconds."""

    reads_done: list[int] = field(default_factory=list)
    reads_failed: list[int] = field(default_factory=list)
    writes_dropped: list[str] = field(default_factory=list)
    copy_s: float = 0.0
    read_s: list[float] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """Scheduler -> every rank, once per iteration."""

    step: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    released_slots: list[int] = field(default_factory=list)
    padding_slots: list[int] = field(default_factory=list)
    ahead: bool = False  # built while the step before it ran
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    kv: KVTransfers | None = None  # moves between the KV tiers, before any row

    @property
    def num_tokens(self) -> int:
        """Real tokens computed by this step (padding excluded)."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_padding_tokens(self) -> int:
        return sum(s.num_pad_tokens for s in self.scheduled) + len(self.padding_slots)


@dataclass(slots=True)
class SampledToken:
    """One sampled token; ``top_logprobs`` holds ``(token_id, logprob)`` pairs."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class FinishedSeq:
    """A sequence the rank finished, with the KV blocks it held.

    ``reason`` is ``"eos"``, ``"stop_token"`` or ``"length"`` (or ``"error"``
    when the rank cannot go on with this one sequence: a grammar that refuses
    a token). The scheduler checks ``block_ids`` against its own block table.
    """

    seq_id: int
    reason: str
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """The log-probabilities of a prompt's tokens, for a sequence that asked for them
    (``prompt_logprobs``), sent once: with the step that completes its prompt.

    Entry ``i`` is prompt token ``i + 1`` given the tokens before it (the first
    token has none): its logprob, its rank in the vocabulary (1 is the most
    likely) and the top ``prompt_logprobs`` ``(token_id, logprob)`` pairs.
    """

    seq_id: int
    token_logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(slots=True)
class PooledOutput:
    """A pooling runner's vector for one sequence (its prompt's final hidden states
    pooled, ``hidden_size`` floats), sent once: with the step that completes its
    prompt, which also finishes it."""

    seq_id: int
    data: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """Ranks -> scheduler, once per iteration (rank 0 carries the tokens)."""

    step: int
    sampled: list[SampledToken] = field(default_factory=list)
    finished: list[FinishedSeq] = field(default_factory=list)
    forward_s: float = 0.0
    num_tokens: int = 0
    num_padding_tokens: int = 0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    pooled: list[PooledOutput] = field(default_factory=list)
    kv: KVReport | None = None  # what the KV tiers did (every rank's, merged)


# A request's tenant: whose turn it is under ``scheduling_policy: fair``, a label of
# the metrics. A gateway's fairness id, else the OpenAI ``user`` field, else this one.
DEFAULT_TENANT = "default"
MAX_TENANT_LEN = 128  # characters
MAX_SLO_TTFT_MS = 3_600_000.0  # an hour: a first-token target beyond it is not one


@dataclass(slots=True)
class EngineRequest:
    """Client -> engine: one request to queue (the engine channel's ``ADD``).

    ``request_id`` is the engine's id of it, which the client makes unique;
    ``label`` the client's own name for it (logs). ``lora_name`` names a loaded
    LoRA adapter (None: the base model). ``tenant`` is whose request it is
    (:data:`DEFAULT_TENANT` when nobody said), ``slo_ttft_ms`` its first-token
    target, if it has one (``fair`` orders admission by it; a request past it
    is counted, not dropped). The engine checks every value again (intake).
    """

    request_id: str
    label: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora_name: str | None = None
    tenant: str = DEFAULT_TENANT
    slo_ttft_ms: float | None = None


# One token's logprob and its top alternatives: ``(logprob, [(token_id, logprob), ...])``.
TokenLogprobs = tuple[float, list[tuple[int, float]]]
FINISH_REASONS = ("eos", "stop_token", "length", "abort", "error")


@dataclass(slots=True)
class EngineOutput:
    """Engine -> client: what one step produced for one request.

    ``request_id`` is the engine's id of the request (the one its client chose
    when it added it). ``logprobs`` holds one entry per token of ``token_ids``
    when the request asked for logprobs; ``prompt_logprobs`` comes once, in the
    output of the step that completed the prompt, when it asked for those.
    ``finish_reason`` (one of ``FINISH_REASONS``) is set on its last output;
    ``error`` says why, when that reason is ``error``. ``num_cached_tokens`` is
    set on its first output with tokens: prompt tokens found in the prefix cache.
    ``pooled`` is a pooling engine's vector of the prompt, in its last output.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, message: str) -> EngineOutput:
        """The last output of a request the engine (or the way to it) failed."""
        return cls(request_id, finish_reason="error", error=message)

    @classmethod
    def aborted(cls, request_id: str) -> EngineOutput:
        return cls(request_id, finish_reason="abort")


@dataclass(slots=True)
class EngineOutputs:
    """Engine -> one client: everything one step produced for that client's
    requests, in one message."""

    outputs: list[EngineOutput] = field(default_factory=list)
