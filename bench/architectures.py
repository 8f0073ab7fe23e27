"""What an architecture's own features cost, and what experts cost, as ratios.

``compare_architectures``: each supported architecture at the shape of the
benchmark's random Llama (:data:`~iterserve.bench.forward.RANDOM_LLAMA`: same
hidden size, layers, heads, MLP width and vocabulary), with its own features
(q/k norms, Gemma's extra norms, GELU, soft-caps and scaled embeddings, Phi-3's
partial rotary, sliding windows as its checkpoints ship them), random weights;
its decode and prefill tokens/s divided by the Llama's. The models are
measured in turn, ``rounds`` times over, and each ratio is the median of the
rounds' own (a shared machine's load moves between rounds more than within
one). A ratio below 1 is what those features cost on this machine.

``moe_experts_used``: one mixture-of-experts model (the same attention, 32
experts of a quarter of the Llama's MLP width, two per token); its decode step
with routing confined to the first ``n`` experts, divided by the step where
tokens may use all of them. Experts no token chose cost nothing, so the ratio
follows the experts a step uses.

Both run in-process on random weights (``ModelRunner.from_config``); no
checkpoint is written. Times are medians of steps: on one torch thread the CPU
time the step's thread spent (what another process's load does not change),
otherwise the runner's ``forward_s``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import torch

from ..workers.config import ModelConfig
from ..workers.runner import ModelRunner
from .forward import RANDOM_LLAMA, cache_blocks, measure

# Each architecture's keys beyond the Llama's, as its checkpoints set them.
SAME_SHAPE: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": 4096},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 64},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "head_dim": 64, "sliding_window": 4096,
               "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
               "tie_word_embeddings": False},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 64, "sliding_window": 512,
               "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
               "tie_word_embeddings": False},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "sliding_window": 2047,
             "partial_rotary_factor": 0.75},
}  # fmt: skip
MOE = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 32, "intermediate_size": 352,
       "num_experts_per_tok": 2, "num_hidden_layers": 4}  # fmt: skip


def config_of(overrides: dict[str, Any], base: dict[str, Any] = RANDOM_LLAMA) -> ModelConfig:
    """``base``'s shape with an architecture's keys."""
    raw = {k: v for k, v in base.items() if k not in ("architectures", "hidden_act")}
    if "hidden_activation" not in overrides:
        raw["hidden_act"] = "silu"
    return ModelConfig.from_dict({**raw, **overrides})


def _one_thread() -> bool:
    return torch.get_num_threads() == 1


def _runner(config: ModelConfig, device: str, num_blocks: int, block_size: int) -> ModelRunner:
    return ModelRunner.from_config(config, dtype=torch.float32, device=device,
                                   num_kv_blocks=num_blocks, block_size=block_size)  # fmt: skip


def compare_architectures(
    names=tuple(SAME_SHAPE), *, device: str = "cpu", batch_size: int = 32, context: int = 128,
    prefill_len: int = 512, steps: int = 5, block_size: int = 16, base=RANDOM_LLAMA,
    rounds: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """Per architecture: decode and prefill tokens/s (medians over the rounds), and
    each divided by the Llama's (the median of the rounds' ratios)."""
    num_blocks = cache_blocks((batch_size,), context, prefill_len, steps, block_size)
    order = ("llama", *[n for n in names if n != "llama"])
    runners = {n: _runner(config_of(SAME_SHAPE[n], base), device, num_blocks, block_size)
               for n in order}  # fmt: skip
    figures: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    for _ in range(rounds):
        for name in order:
            figures[name].append(measure(runners[name], (batch_size,), context, prefill_len,
                                         steps, cpu_clock=_one_thread()))  # fmt: skip
    out: dict[str, Any] = {"shape": "random-llama", "batch_size": batch_size, "context": context,
                           "rounds": rounds, "clock": "cpu" if _one_thread() else "wall"}  # fmt: skip
    keys = [f"decode_tok_s_{batch_size}", f"prefill_tok_s_{prefill_len}"]
    for name, runs in figures.items():
        out[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        for k in keys:
            ratios = [r[k] / llama[k] for r, llama in zip(runs, figures["llama"], strict=True)]
            out[name][f"{k}_vs_llama"] = round(statistics.median(ratios), 3)
    return out


@contextlib.contextmanager
def experts_confined_to(n: int) -> Iterator[None]:
    """Routing as the model computes it, each choice then folded into the first
    ``n`` experts (``id mod n``): what the step computes, not which tokens go where."""
    from ..workers import moe

    real = moe.route

    def confined(logits, top_k, renormalize):
        weights, ids = real(logits, top_k, renormalize)
        return weights, ids % n

    moe.route = confined
    try:
        yield
    finally:
        moe.route = real


def moe_experts_used(
    used=(2, 8, 32), *, device: str = "cpu", batch_size: int = 32, context: int = 128,
    steps: int = 5, block_size: int = 16, base=RANDOM_LLAMA, moe=MOE,
) -> dict[str, Any]:  # fmt: skip
    """The MoE decode step's time with routing confined to each count in ``used``,
    and divided by the time with all experts open."""
    config = config_of(moe, base)
    num_blocks = cache_blocks((batch_size,), context, 16, steps, block_size)
    ms = {}
    experts = config.experts
    assert experts is not None, "moe must name a mixture-of-experts architecture"
    for n in sorted(set(used) | {experts.num_experts}):
        # A fresh runner (the same weights) for each count: the same steps and contexts.
        runner = _runner(config, device, num_blocks, block_size)
        with experts_confined_to(n):
            got = measure(runner, (batch_size,), context, 16, steps, cpu_clock=_one_thread())
        ms[n] = 1000 * batch_size / got[f"decode_tok_s_{batch_size}"]
        del runner
    full = ms[experts.num_experts]
    out: dict[str, Any] = {"num_experts": experts.num_experts, "top_k": experts.top_k,
                           "batch_size": batch_size}  # fmt: skip
    for n, t in ms.items():
        out[f"decode_ms_experts_{n}"] = round(t, 2)
        out[f"ratio_experts_{n}_vs_{experts.num_experts}"] = round(t / full, 3)
    return out
