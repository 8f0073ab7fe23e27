"""A longrope model (Phi-3 128k's scaling, shrunk: 32 original positions stretched
to 128) served past its original context takes its long factors for every
position, and within it its short ones (kernels/rope.py): each matches
transformers on the sequences where transformers uses the same set."""

from __future__ import annotations

import pytest
import torch
from plan_driver import PlanDriver
from tiny_checkpoints import HFReference, build_hf_model, save

from iterserve.kernels import build_cos_sin_cache
from iterserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from iterserve.scheduler.seq_table import PlanMismatchError
from iterserve.workers import ModelRunner

ORIGINAL, MAX_POSITIONS = 32, 128
# Longer than the original context from the prompt on: transformers computes the
# whole sequence with the long factors.
LONG_PROMPTS = [[3 + (11 * i + 5 * j) % 250 for j in range(n)] for i, n in enumerate([33, 40, 57])]
SHORT_PROMPTS = [[7 + (13 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate([1, 5, 12])]


@pytest.fixture(scope="module")
def long_phi3(tmp_path_factory):
    """(checkpoint directory, transformers reference): Phi-3 with partial rotary and
    no window (a draft model needs a target without one)."""
    model = build_hf_model("phi3", max_position_embeddings=MAX_POSITIONS,
                           original_max_position_embeddings=ORIGINAL, sliding_window=None)  # fmt: skip
    return save(model, tmp_path_factory.mktemp("phi3-long")), HFReference(model)


def runner(path, **kwargs) -> ModelRunner:
    kwargs = {"num_kv_blocks": 64, "block_size": 8, "kernel_backend": "torch",
              "dtype": "float32", **kwargs}  # fmt: skip
    return ModelRunner(path, **kwargs)


def run(r: ModelRunner, prompts, max_tokens: int, **step) -> dict[str, list[int]]:
    driver = PlanDriver(r)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, params)
    return driver.run(**step)


@pytest.mark.parametrize("max_model_len", [None, ORIGINAL + 1, MAX_POSITIONS])
def test_served_past_the_original_context_it_matches_transformers_long_factors(
    long_phi3, max_model_len
):
    """Served past 32 positions (the checkpoint's 128 when unset), the runner takes the
    long factors: greedy tokens equal transformers' for prompts already past the
    original context, batched and in 7-token prefill pieces, decoding to 81 tokens."""
    path, hf = long_phi3
    r = runner(path, max_model_len=max_model_len)
    assert r.model.cos_sin.shape[0] == MAX_POSITIONS
    c = r.config
    scaling = c.rope_scaling
    assert torch.equal(
        r.model.cos_sin.cpu(),
        build_cos_sin_cache(c.rope_dim, MAX_POSITIONS, c.rope_theta, scaling,
                            max_model_len=MAX_POSITIONS),
    )  # fmt: skip
    out = run(r, LONG_PROMPTS, max_tokens=24, chunk=7)
    assert out == {f"r{i}": hf.greedy(p, max_new_tokens=24) for i, p in enumerate(LONG_PROMPTS)}


def test_served_within_the_original_context_it_takes_the_short_factors(long_phi3):
    """Within 32 positions the runner takes the short factors, transformers' numbers
    for a sequence that stays there; its table ends at the original context, so a
    position past it is refused rather than computed with the wrong factors."""
    path, hf = long_phi3
    r = runner(path, max_model_len=ORIGINAL)
    assert r.model.cos_sin.shape[0] == ORIGINAL
    c = r.config
    assert torch.equal(
        r.model.cos_sin.cpu(),
        build_cos_sin_cache(c.rope_dim, ORIGINAL, c.rope_theta, c.rope_scaling),
    )
    out = run(r, SHORT_PROMPTS, max_tokens=16)
    assert out == {f"r{i}": hf.greedy(p, max_new_tokens=16) for i, p in enumerate(SHORT_PROMPTS)}
    with pytest.raises(PlanMismatchError, match=f"beyond the model's {ORIGINAL} positions"):
        run(r, [LONG_PROMPTS[0]], max_tokens=1)


@pytest.mark.parametrize("max_model_len", [ORIGINAL, MAX_POSITIONS])
def test_a_longrope_draft_takes_the_factors_of_the_context_served(long_phi3, max_model_len):
    """The draft model (here the target itself) takes the same factors as the target
    for the same context: it computes exactly what the target does, so every
    proposal is kept, and the tokens are transformers'."""
    path, hf = long_phi3
    r = runner(path, max_model_len=max_model_len, block_size=4, draft_model=str(path))
    assert r.drafter is not None and torch.equal(r.drafter.model.cos_sin, r.model.cos_sin)
    prompts = LONG_PROMPTS if max_model_len > ORIGINAL else SHORT_PROMPTS
    max_tokens = 20 if max_model_len > ORIGINAL else 16
    config = SchedulerConfig(
        policy="chunked", max_num_seqs=4, max_num_batched_tokens=37, max_model_len=max_model_len,
        block_size=4, num_kv_blocks=64,
        speculative_config={"method": "draft_model", "model": str(path),
                            "num_speculative_tokens": 3},
    )  # fmt: skip
    sched = Scheduler(config, ahead=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, params))
        outputs[f"r{i}"] = []
    steps = 0
    while sched.has_work:
        step = sched.schedule(float(steps))
        assert step is not None
        for out in sched.update(r.execute(step.plan)).outputs:
            outputs[out.request_id] += out.new_token_ids
        steps += 1
    assert outputs == {f"r{i}": hf.greedy(p, max_tokens) for i, p in enumerate(prompts)}
    stats = sched.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
