"""The batching lab's workloads: seeded request lists, the same for every policy.

- ``longtail``: Poisson arrivals faster than any policy serves them, short
  chat-turn prompts (1/128 to 1/32 of the context), lognormal output lengths
  capped at a quarter of the context (many short, a few long): the
  first-finisher problem.
- ``long-prompts``: steady streams decoding long outputs while prompts of 60-90% of
  the context arrive periodically: the prefill stall.

The prefix-caching workloads (``iterserve bench prefix``, :class:`PrefixSpec`):

- ``shared-prefix``: a few long system prompts, each followed by many short
  questions, Poisson arrivals: the prompt work a cache saves is most of it.
- ``multi-turn``: conversations whose every turn sends the whole history (the
  earlier questions and answers) and a new question, after the previous answer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Spec:
    name: str
    num_requests: int  # longtail: all; long-prompts: streams + long prompts
    max_model_len: int
    max_num_seqs: int = 16
    chunk_budget: int = 128  # chunked's per-step token budget
    batch_timeout_s: float = 2.0  # static; at the longtail rate a full batch arrives in ~0.3 s
    batch_wait_s: float = 0.25  # dynamic
    request_rate: float = 32.0  # longtail arrivals per second (Poisson)
    output_median: int = 32  # longtail output lengths: lognormal(ln median, sigma), capped
    output_sigma: float = 1.3
    num_streams: int = 8  # long-prompts: streams decoding from t=0
    long_interval_s: float = 0.75  # long-prompts: one long prompt every this many seconds
    repeats: int = 1  # rounds of every policy; figures are medians (p99 ITL is noise-prone)


SPECS = {
    "longtail": {
        "full": Spec("longtail", num_requests=640, max_model_len=1024, max_num_seqs=32,
                     request_rate=96.0),
        "small": Spec("longtail", num_requests=24, max_model_len=128, max_num_seqs=4,
                      chunk_budget=16, batch_timeout_s=0.2, batch_wait_s=0.05, output_median=6),
    },
    "long-prompts": {
        "full": Spec("long-prompts", num_requests=8 + 16, max_model_len=1024, chunk_budget=64,
                     repeats=3),
        "small": Spec("long-prompts", num_requests=4 + 4, max_model_len=128, max_num_seqs=4,
                      chunk_budget=16, batch_timeout_s=0.2, batch_wait_s=0.05, num_streams=4,
                      long_interval_s=0.1),
    },
}  # fmt: skip


@dataclass
class BenchRequest:
    request_id: str
    arrival_s: float
    prompt_ids: list[int]
    output_len: int
    kind: str  # chat | stream | long


def build(spec: Spec, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The workload's requests in arrival order; the same for every policy."""
    rng = np.random.default_rng(seed)
    ctx = spec.max_model_len

    def prompt(n: int) -> list[int]:
        return rng.integers(3, vocab_size, int(n)).tolist()  # ids 0-2 are often special

    out: list[tuple[float, int, int, str]] = []  # (arrival, prompt_len, output_len, kind)
    if spec.name == "longtail":
        arrivals = np.cumsum(rng.exponential(1.0 / spec.request_rate, spec.num_requests))
        prompt_lens = rng.integers(ctx // 128, ctx // 32 + 1, spec.num_requests)
        drawn = rng.lognormal(math.log(spec.output_median), spec.output_sigma, spec.num_requests)
        output_lens = np.clip(np.rint(drawn), 2, ctx // 4)
        out = [
            (a - arrivals[0], p, o, "chat") for a, p, o in zip(arrivals, prompt_lens, output_lens)
        ]
    else:
        # Streams start together and decode for most of the run; long prompts keep coming.
        for i in range(spec.num_streams):
            out.append((0.02 * i, ctx // 32, int(ctx * rng.uniform(0.5, 0.6)), "stream"))
        for k in range(spec.num_requests - spec.num_streams):
            length = int(ctx * rng.uniform(0.6, 0.9))
            out.append((spec.long_interval_s * (k + 0.5), length, max(2, ctx // 64), "long"))
    return [
        BenchRequest(f"{kind}-{i}", round(float(a), 4), prompt(p), int(o), kind)
        for i, (a, p, o, kind) in enumerate(out)
    ]


def describe(spec: Spec, requests: list[BenchRequest], seed: int) -> dict:
    outputs = [r.output_len for r in requests]
    prompts = [len(r.prompt_ids) for r in requests]
    return {
        **asdict(spec),
        "seed": seed,
        "num_output_tokens": sum(outputs),
        "output_len": {"min": min(outputs), "p50": int(np.median(outputs)), "max": max(outputs)},
        "prompt_len": {"min": min(prompts), "p50": int(np.median(prompts)), "max": max(prompts)},
        "arrival_span_s": max(r.arrival_s for r in requests),
    }


# -- prefix caching ------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixSpec:
    name: str  # shared-prefix | multi-turn
    max_model_len: int = 2048
    max_num_seqs: int = 16
    chunk_budget: int = 512  # chunked's per-step token budget
    output_len: int = 32  # tokens of every answer
    # shared-prefix
    num_prefixes: int = 4
    prefix_len: int = 768
    num_requests: int = 128
    question_len: tuple[int, int] = (16, 48)  # uniform
    request_rate: float = 32.0  # Poisson arrivals per second
    # multi-turn
    num_conversations: int = 16
    num_turns: int = 8
    first_len: int = 512  # the first message: instructions, context
    turn_len: tuple[int, int] = (24, 48)  # every later question, uniform
    conversation_interval_s: float = 0.25  # conversations start this far apart
    repeats: int = 1  # rounds of cache on and off; figures are medians


PREFIX_SPECS = {
    "shared-prefix": {
        "full": PrefixSpec("shared-prefix"),
        "small": PrefixSpec("shared-prefix", max_model_len=128, max_num_seqs=4, chunk_budget=32,
                            output_len=4, num_prefixes=2, prefix_len=40, num_requests=12,
                            question_len=(4, 8), request_rate=50.0),
    },
    "multi-turn": {
        "full": PrefixSpec("multi-turn"),
        "small": PrefixSpec("multi-turn", max_model_len=128, max_num_seqs=4, chunk_budget=32,
                            output_len=4, num_conversations=3, num_turns=3, first_len=24,
                            turn_len=(4, 8), conversation_interval_s=0.05),
    },
}  # fmt: skip


@dataclass
class Conversation:
    """One conversation of ``multi-turn``: its turns' new messages, sent one after
    another, each with the whole history before it."""

    conversation_id: str
    start_s: float
    messages: list[list[int]]  # turn t's new tokens (the first: the opening message)
    output_len: int


def shared_prefix_requests(spec: PrefixSpec, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Questions on ``num_prefixes`` system prompts, round robin, in arrival order."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, vocab_size, spec.prefix_len).tolist()
                for _ in range(spec.num_prefixes)]  # fmt: skip
    arrivals = np.cumsum(rng.exponential(1.0 / spec.request_rate, spec.num_requests))
    lo, hi = spec.question_len
    requests = []
    for i, arrival in enumerate(arrivals - arrivals[0]):
        question = rng.integers(3, vocab_size, int(rng.integers(lo, hi + 1))).tolist()
        k = i % spec.num_prefixes
        requests.append(BenchRequest(f"prefix{k}-{i}", round(float(arrival), 4),
                                     prefixes[k] + question, spec.output_len, f"prefix{k}"))  # fmt: skip
    return requests


def conversations(spec: PrefixSpec, vocab_size: int, seed: int) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    lo, hi = spec.turn_len
    out = []
    for c in range(spec.num_conversations):
        messages = [rng.integers(3, vocab_size, spec.first_len).tolist()]
        for _ in range(spec.num_turns - 1):
            messages.append(rng.integers(3, vocab_size, int(rng.integers(lo, hi + 1))).tolist())
        out.append(Conversation(f"chat{c}", round(c * spec.conversation_interval_s, 4),
                                messages, spec.output_len))  # fmt: skip
    return out


def describe_prefix(spec: PrefixSpec, seed: int) -> dict:
    out = {**asdict(spec), "seed": seed}
    if spec.name == "shared-prefix":
        for key in ("num_conversations", "num_turns", "first_len", "turn_len",
                    "conversation_interval_s"):  # fmt: skip
            out.pop(key)
    else:
        for key in ("num_prefixes", "prefix_len", "num_requests", "question_len", "request_rate"):
            out.pop(key)
    return out
