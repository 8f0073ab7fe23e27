"""Prefix caching at GPU scale: the simulator's ``shared-prefix`` workload, cache on and off.

The real scheduler shares blocks by content; a request admitted on cached
blocks starts its prefill after them, and the roofline cost model prices what
each plan computes (a cached context is still read by attention). So the
simulator predicts what the cache saves where a step's prefill is the
expensive part, which this machine's CPU cannot show at size:
``iterserve simulate --workload shared-prefix``.
"""

from __future__ import annotations

import math

import numpy as np

from .costmodel import CostModel
from .simulator import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    NUM_REQUESTS,
    OUTPUT_MEDIAN,
    OUTPUT_SIGMA,
    REQUEST_RATE,
    simulate_policy,
)

# A few long system prompts (instructions, tool definitions, few-shot examples),
# each followed by a question of its own, and chat-length answers.
NUM_PREFIXES = 8
PREFIX_LEN = 2000
QUESTION = (50, 300)  # uniform
MODES = {"cache_off": False, "cache_on": True}


def prefix_workload(
    num_requests: int = NUM_REQUESTS,
    request_rate: float = REQUEST_RATE,
    seed: int = 0,
    num_prefixes: int = NUM_PREFIXES,
    prefix_len: int = PREFIX_LEN,
) -> dict[str, list]:
    """Seeded Poisson arrivals; each prompt is one of ``num_prefixes`` system prompts
    of ``prefix_len`` tokens (``prefix_id``, uniform) and a question of 50-300
    tokens; outputs as :func:`~iterserve.bench.simulator.workload`'s."""
    rng = np.random.default_rng(seed)
    if math.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    questions = rng.integers(QUESTION[0], QUESTION[1] + 1, num_requests)
    outputs = rng.lognormal(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA, num_requests)
    outputs = np.clip(np.rint(outputs), 1, MAX_TOKENS).astype(int)
    return {
        "arrival_s": arrivals.tolist(),
        "prompt_len": (questions + prefix_len).tolist(),
        "output_len": outputs.tolist(),
        "prefix_id": rng.integers(0, num_prefixes, num_requests).tolist(),
        "prefix_len": [prefix_len] * num_requests,
    }


def simulate_prefix(
    gpu: str = "h200",
    model: str = "8b",
    tp: int | None = None,
    policy: str = "chunked",
    num_requests: int = NUM_REQUESTS,
    request_rate: float = REQUEST_RATE,
    seed: int = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    num_prefixes: int = NUM_PREFIXES,
    prefix_len: int = PREFIX_LEN,
) -> dict:
    """One policy on the same seeded shared-prefix load, with the cache off and on."""
    cost = CostModel(gpu, model, tp)
    load = prefix_workload(num_requests, request_rate, seed, num_prefixes, prefix_len)
    modes = {
        name: simulate_policy(
            policy,
            cost,
            load,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=on,
        )  # fmt: skip
        for name, on in MODES.items()
    }
    on, off = modes["cache_on"], modes["cache_off"]
    return {
        "gpu": cost.gpu.name,
        "model": cost.model.name,
        "tp": cost.tp,
        "num_kv_blocks": cost.num_kv_blocks(BLOCK_SIZE),
        "policy": policy,
        "workload": {
            "name": "shared-prefix",
            "num_requests": num_requests,
            "request_rate": None if math.isinf(request_rate) else request_rate,
            "seed": seed,
            "num_prefixes": num_prefixes,
            "prefix_len": prefix_len,
            "question_len": list(QUESTION),
            "mean_prompt_len": float(np.mean(load["prompt_len"])),
            "mean_output_len": float(np.mean(load["output_len"])),
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
        },
        "modes": modes,
        "ratios": {
            "ttft_p50_on_over_off": on["ttft_p50_s"] / off["ttft_p50_s"],
            "ttft_p99_on_over_off": on["ttft_p99_s"] / off["ttft_p99_s"],
            "throughput_on_over_off": on["throughput_tok_s"] / off["throughput_tok_s"],
            "prefill_tokens_on_over_off": on["prefill_tokens"] / off["prefill_tokens"],
        },
    }
