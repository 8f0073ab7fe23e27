"""Forward-pass throughput of the model runtime, in tokens per second.

Decode is measured at several batch sizes, each sequence holding about
``context`` cached tokens; prefill as one ``prefill_len``-token piece. Times are
the runner's ``forward_s`` (the model forward, logits included; batch building
and sampling excluded), median over ``steps`` measured steps after one warm-up.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..scheduler.blocks import blocks_for
from ..scheduler.messages import NewSequence, ScheduledSeq, StepPlan
from ..scheduler.sampling import SamplingParams
from ..workers.host_memory import keep_freed_memory
from ..workers.runner import ModelRunner

# Used when no demo checkpoint is installed: small enough for a laptop CPU,
# shaped like a real Llama (GQA, SwiGLU MLP of ~2.7x hidden).
RANDOM_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def write_random_llama(path: Path, config: dict[str, Any] = RANDOM_LLAMA, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``config`` in Hugging Face layout."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {
        "model.embed_tokens.weight": rand(config["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(config["vocab_size"], h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class _Plans:
    """Just enough scheduling for the benchmark: fresh blocks from a counter. ``run``
    returns the step's ``forward_s``, or with ``cpu_clock`` the CPU time this thread
    spent in the whole step (on one torch thread every kernel runs on it, and a
    shared machine's other load does not count)."""

    def __init__(self, runner: ModelRunner, cpu_clock: bool = False):
        self.runner, self.bs = runner, runner.block_size
        self.cpu_clock = cpu_clock
        self.step = 0
        self.next_block = 0
        self.blocks: dict[int, int] = {}
        self.computed: dict[int, int] = {}

    def entry(self, slot: int, n: int, sample: bool) -> ScheduledSeq:
        start = self.computed.get(slot, 0)
        need = blocks_for(start + n, self.bs) - self.blocks.get(slot, 0)
        new = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        self.blocks[slot] = self.blocks.get(slot, 0) + need
        self.computed[slot] = start + n
        return ScheduledSeq(slot, start, n, new, sample=sample)

    def run(self, new: list[NewSequence], scheduled: list[ScheduledSeq]) -> float:
        start = time.thread_time()
        result = self.runner.execute(StepPlan(self.step, new_seqs=new, scheduled=scheduled))
        self.step += 1
        return time.thread_time() - start if self.cpu_clock else result.forward_s


def bench_forward(
    model_path: str | Path | None = None,
    *,
    device: str = "cpu",
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64),
    context: int = 128,
    prefill_len: int = 512,
    steps: int = 5,
    block_size: int = 16,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Forward tokens/s at each decode batch size and for one prefill piece.

    ``num_threads`` sets torch's intra-op threads for the run (restored after);
    on a CPU shared with other work, 1 avoids threads spinning at barriers.
    """
    keep_freed_memory()  # as a rank does
    saved_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _bench(model_path, device, batch_sizes, context, prefill_len, steps, block_size)
    finally:
        torch.set_num_threads(saved_threads)


def _bench(model_path, device, batch_sizes, context, prefill_len, steps, block_size):
    with tempfile.TemporaryDirectory() as tmp:
        if model_path is None:
            from ..models import DEMO_MODEL_PATH

            if (DEMO_MODEL_PATH / "config.json").exists():
                model_path, model_name = DEMO_MODEL_PATH, "demo"
            else:
                model_path, model_name = write_random_llama(Path(tmp) / "random"), "random-llama"
        else:
            model_name = str(model_path)
        return _measure(
            Path(model_path),
            model_name,
            device,
            batch_sizes,
            context,
            prefill_len,
            steps,
            block_size,
        )


def cache_blocks(batch_sizes, context: int, prefill_len: int, steps: int, block_size: int) -> int:
    """KV blocks :func:`measure` uses: every decode sequence, and each prefill piece."""
    decode_len = context + 1 + (steps + 1) * len(batch_sizes)
    return max(batch_sizes) * blocks_for(decode_len, block_size) + (steps + 1) * blocks_for(
        prefill_len, block_size
    )


def _measure(path, model_name, device, batch_sizes, context, prefill_len, steps, block_size):
    num_blocks = cache_blocks(batch_sizes, context, prefill_len, steps, block_size)
    runner = ModelRunner(path, num_kv_blocks=num_blocks, block_size=block_size, device=device)
    out: dict[str, Any] = {"model": model_name, "device": device, "dtype": str(runner.dtype)}
    out |= measure(runner, batch_sizes, context, prefill_len, steps)
    if device == "cpu":  # the decode steps' distance from this core's two bounds
        from . import roofline

        bandwidth, peak = roofline.stream_bandwidth(), roofline.peak_flops(runner.dtype)
        out["stream_gb_s"] = round(bandwidth / 1e9, 1)
        out["peak_gflop_s"] = round(peak / 1e9)
        for b in (32, 64):
            if f"decode_tok_s_{b}" in out:
                step_s = b / out[f"decode_tok_s_{b}"]
                out[f"roofline_{b}"] = roofline.shares(runner.config, b, context, runner.dtype,
                                                       step_s, bandwidth, peak)  # fmt: skip
    return out


def measure(runner: ModelRunner, batch_sizes, context: int, prefill_len: int, steps: int,
            cpu_clock: bool = False):  # fmt: skip
    """Decode tokens/s at each batch size over ``context`` cached tokens, and one
    ``prefill_len`` piece's, on a runner with :func:`cache_blocks` blocks and no
    sequence (it has none again after); timed by ``forward_s``, or with
    ``cpu_clock`` by the thread's CPU time per step (see :class:`_Plans`)."""
    batch = max(batch_sizes)
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    plans = _Plans(runner, cpu_clock)
    # Fill the cache: every sequence holds `context` tokens, its next one is pending.
    per_step = max(1, 2048 // context)
    for first in range(0, batch, per_step):
        slots = range(first, min(first + per_step, batch))
        new = [NewSequence(s, f"d{s}", s, prompt(context + 1), context + 1, params) for s in slots]
        plans.run(new, [plans.entry(s, context, sample=False) for s in slots])

    out: dict[str, Any] = {"num_threads": torch.get_num_threads()}
    out["kernel_backend"] = runner.ops.name
    for b in sorted(batch_sizes):
        times = [
            plans.run([], [plans.entry(s, 1, sample=True) for s in range(b)])
            for _ in range(steps + 1)
        ]
        out[f"decode_tok_s_{b}"] = round(b / statistics.median(times[1:]), 1)

    times = []
    for i in range(steps + 1):
        slot = batch + 1 + i
        new = [NewSequence(1000 + i, f"p{i}", slot, prompt(prefill_len), prefill_len, params)]
        times.append(plans.run(new, [plans.entry(slot, prefill_len, sample=True)]))
        release = StepPlan(plans.step, released_slots=[slot])
        runner.execute(release)
        plans.step += 1
    out[f"prefill_tok_s_{prefill_len}"] = round(prefill_len / statistics.median(times[1:]), 1)
    runner.execute(StepPlan(plans.step, released_slots=list(range(batch))))  # measurable again
    return out


if __name__ == "__main__":
    import sys

    threads = int(sys.argv[1]) if len(sys.argv) > 1 else None
    print(json.dumps(bench_forward(num_threads=threads), indent=2))
