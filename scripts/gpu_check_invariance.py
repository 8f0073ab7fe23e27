"""The device check's ``invariance`` section: a batch-invariant engine on the GPU
gives every row the same logits, to the bit, alone as among others.

A small Llama (the 144M shape; a tiny one in smoke mode) with random weights runs
``batch_invariant`` on the Triton kernels, decode steps replayed from CUDA graphs:
each prompt alone (its prompt in one piece, then one decode row a step), then all
of them at once, prompts cut into pieces, decode rows beside prefill pieces, two
sequences preempted and recomputed, greedy and seeded requests alike
(``tests/workers/invariance.py``, which the CPU tests run the same way). Reported
per dtype: the rows compared, how many differ (any is a failure), whether the
tokens agree, and each run's seconds. bf16 and fp16 on a GPU; fp32 and fp16 in
smoke mode (the interpreter gets bf16 dots wrong).

The mode's products replace cuBLAS's for the whole process
(:func:`iterserve.kernels.triton_matmul.enable`), so the section runs after every
other one that times or checks a product.
"""

from __future__ import annotations

import sys
import time

from gpu_check_support import LLAMA_144M, ROOT, SMOKE_LLAMA, Budget, Report, llama_config

SECTION = "invariance"
BLOCK_SIZE = 16


def model_config(smoke: bool):
    """The 144M Llama's shape, or a tiny one in smoke mode."""
    return llama_config(SMOKE_LLAMA if smoke else LLAMA_144M)


def check_invariance(r: Report, dev, smoke: bool, budget: Budget) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "workers"))  # the scenarios the CPU tests run
    from invariance import Scenario, alone, differing, prompt_pool, run

    from iterserve.kernels import triton_matmul
    from iterserve.workers.runner import ModelRunner

    if smoke:  # products of CPU tensors: the interpreted kernel, as a rank's on CUDA
        triton_matmul.enable("CPU")
    config = model_config(smoke)
    count = 4 if smoke else 24
    steps = [(1.0, [1, 5, 16, 1 << 30], 0.3), (0.7, [3, 64], 0.3), (1.0, [1 << 30], 0.0)]
    for name in ("float32", "float16") if smoke else ("bfloat16", "float16"):
        if not budget.allows(0 if smoke else 10):
            r.skip(f"{SECTION}_{name}", f"budget: {max(0.0, budget.left()):.0f} s left")
            continue
        start = time.perf_counter()
        runner = ModelRunner.from_config(
            config, dtype=getattr(torch, name), device=dev, num_kv_blocks=4096,
            block_size=BLOCK_SIZE, kernel_backend="triton", graph_batch_sizes=(1, 2, 4, 8, 16),
            cuda_graphs=None if dev.type == "cuda" else False, batch_invariant=True,
        )  # fmt: skip
        prompts = prompt_pool(config.vocab_size, count=count)
        if smoke:  # the interpreter's time goes with the rows
            prompts = {k: v[:24] for k, v in list(prompts.items())[:count]}
        expected, tokens = alone(runner, prompts)
        alone_s = time.perf_counter() - start
        labels = list(prompts)
        scenario = Scenario({label: i // 4 for i, label in enumerate(labels)}, steps, seed=7)
        got, got_tokens, stats = run(runner, prompts, scenario)
        rows = sum(len(each) for per in got.values() for each in per.values())
        wrong = differing(expected, got)
        report = {
            "rows_compared": rows, "rows_differing": len(wrong),
            "tokens_equal": got_tokens == tokens, "preemptions": stats["preemptions"],
            "widest_step": stats["widest_step"], "mixed_steps": stats["mixed_steps"],
            "graph_replays": getattr(runner.graphs, "num_replays", None),
            "alone_s": round(alone_s, 3), "batch_s": round(time.perf_counter() - start - alone_s, 3),
        }  # fmt: skip
        r.put(SECTION, name, report)
        if wrong or got_tokens != tokens:
            r.fail(f"{SECTION}: {len(wrong)} of {rows} {name} rows differ from the row alone "
                   f"(first: {wrong[:3]})")  # fmt: skip
        del runner
