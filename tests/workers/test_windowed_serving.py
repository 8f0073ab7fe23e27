"""A windowed model under the real scheduler: blocks behind the window handed on
while sequences run, cached prefixes reused across the window, transformers'
tokens throughout."""

from __future__ import annotations

import pytest

from iterserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.blocks import blocks_for
from iterserve.workers import ModelRunner

BS = 4


@pytest.mark.parametrize("policy,budget", [("chunked", 37), ("continuous", 160)])
def test_window_blocks_handed_on_and_prefixes_reused_with_exact_tokens(
    policy, budget, checkpoint_dir, hf_reference
):
    """Mistral's window is 24: a 70-token system prompt is longer than it. The first
    wave computes it and hands its early blocks on (keeping their hashes); the
    second wave starts on them from the cache. Every output is transformers'."""
    path = checkpoint_dir("mistral")
    runner = ModelRunner(path, num_kv_blocks=96, block_size=BS, kernel_backend="cpu")
    window = runner.config.kv_window
    assert window == 24
    config = SchedulerConfig(policy=policy, max_num_seqs=4, max_num_batched_tokens=budget,
                             max_model_len=160, block_size=BS, num_kv_blocks=96)  # fmt: skip
    sched = Scheduler(config, kv_window=window)
    system = [(13 * i) % 250 + 1 for i in range(70)]
    waves = [[system + [200 + i] * (i + 1) for i in range(3)],
             [system + [100 + i] * (i + 2) for i in range(3)]]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    hf = hf_reference("mistral")
    most_held = 0
    for w, prompts in enumerate(waves):
        outputs = {f"w{w}r{i}": [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            sched.add_request(Request(f"w{w}r{i}", prompt, params))
        while sched.has_work:
            step = sched.schedule(0.0)
            for out in sched.update(runner.execute(step.plan)).outputs:
                outputs[out.request_id].extend(out.new_token_ids)
            sched.check_integrity()
            decoding = [r for r in sched.running.values() if r.num_output_tokens > 1]
            most_held = max([most_held] + [len(sched.blocks.held(r.request_id)) for r in decoding])
        assert outputs == {f"w{w}r{i}": hf.greedy(p, 30) for i, p in enumerate(prompts)}
    assert sched.num_prefix_hits >= 3 * 68  # the second wave found the system prompt
    # A sequence of ~105 positions would hold 27 blocks; decoding, it holds those its
    # next token's window spans, and the one that token goes to.
    assert 0 < most_held <= blocks_for(window, BS) + 2
