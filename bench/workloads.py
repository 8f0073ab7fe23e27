"""The batching lab's workloads: seeded request lists, the same for every policy.

- ``longtail``: Poisson arrivals faster than any policy serves them, short
  chat-turn prompts (1/128 to 1/32 of the context), lognormal output lengths
  capped at a quarter of the context (many short, a few long): the
  first-finisher problem.
- ``long-prompts``: steady streams decoding long outputs while prompts of 60-90% of
  the context arrive periodically: the prefill stall.
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
