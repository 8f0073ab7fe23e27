"""Sampling and stop rules end to end through ModelRunner."""

from __future__ import annotations

import json
import shutil

import torch
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers import ModelRunner


def test_seeded_request_same_tokens_alone_or_batched(checkpoint_dir):
    path = checkpoint_dir("llama")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    ps = prompts(6)

    alone = PlanDriver(make_runner(path))
    alone.add("s", ps[3], seeded)
    alone_out = alone.run()["s"]

    batched = PlanDriver(make_runner(path))
    other = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(ps):
        batched.add("s" if i == 3 else f"o{i}", p, seeded if i == 3 else other)
    assert batched.run(chunk=11)["s"] == alone_out

    reseeded = PlanDriver(make_runner(path))
    reseeded.add("s", ps[3], SamplingParams(**{**_fields(seeded), "seed": 8}))
    assert reseeded.run()["s"] != alone_out


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_logprobs_match_transformers(checkpoint_dir, hf_reference):
    prompt = prompts()[5]
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    driver.add("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    result = driver.step()
    (tok,) = result.sampled
    ref = torch.log_softmax(hf_reference("llama").logits(prompt)[-1], -1)
    assert tok.token_id == int(ref.argmax())
    assert abs(tok.logprob - ref.max().item()) < 1e-4
    assert [t for t, _ in tok.top_logprobs] == ref.topk(5).indices.tolist()
    for t, lp in tok.top_logprobs:
        assert abs(lp - ref[t].item()) < 1e-4


def test_length_and_stop_token_finish_reasons(checkpoint_dir, hf_reference):
    prompt = prompts()[2]
    greedy = hf_reference("llama").greedy(prompt)
    stop_at = next(i for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2)
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    driver.add("len", prompt, SamplingParams(temperature=0.0, max_tokens=5))
    driver.add("stop", prompt, SamplingParams(temperature=0.0, stop_token_ids=(greedy[stop_at],)))
    out = driver.run()
    assert out["len"] == greedy[:5]
    assert driver.done["len"].finish_reason == "length"
    assert out["stop"] == greedy[: stop_at + 1]
    assert driver.done["stop"].finish_reason == "stop_token"


def test_eos_from_generation_config_and_min_tokens(checkpoint_dir, hf_reference, tmp_path):
    prompt = prompts()[2]
    greedy = hf_reference("llama").greedy(prompt)
    eos_at = next(i for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2)
    path = tmp_path / "eos"
    shutil.copytree(checkpoint_dir("llama"), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[eos_at]]}))
    runner = make_runner(path)
    assert greedy[eos_at] in runner.eos_token_ids

    driver = PlanDriver(runner)
    driver.add("eos", prompt, SamplingParams(temperature=0.0, max_tokens=32))
    driver.add("min", prompt, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=eos_at + 3))
    driver.add("ign", prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    out = driver.run()
    assert out["eos"] == greedy[: eos_at + 1]
    assert driver.done["eos"].finish_reason == "eos"
    assert greedy[eos_at] not in out["min"][: eos_at + 2]
    assert len(out["min"]) >= eos_at + 3
    assert out["ign"] == greedy


def test_runner_reports_token_outside_vocab(checkpoint_dir):
    import pytest

    from iterserve.scheduler.seq_table import PlanMismatchError

    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    driver.add("bad", [1, 2, 999])
    with pytest.raises(PlanMismatchError, match="999"):
        driver.step()


def test_dtype_bf16_runs_close_to_fp32(checkpoint_dir):
    path = checkpoint_dir("qwen2")
    fp32 = ModelRunner(path, num_kv_blocks=16, block_size=8, kernel_backend="torch")
    bf16 = ModelRunner(
        path, dtype="bfloat16", num_kv_blocks=16, block_size=8, kernel_backend="torch"
    )
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.kv_cache.keys[0].dtype == torch.bfloat16
    prompt = prompts()[3]
    outs = []
    for runner in (fp32, bf16):
        driver = PlanDriver(runner)
        driver.add("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        outs.append(driver.run()["r"])
    # bf16 rounding may flip a late token, but the first comes from well-separated logits.
    assert outs[0][0] == outs[1][0]


def _serve(path, requests: dict, num_kv_blocks: int, restart_at_step: int | None = None):
    """Runs ``requests`` (id -> (prompt, params)) through the real scheduler and a
    runner; ``restart_at_step``: the runner is replaced there, as after a worker
    failure (every running sequence is recomputed on the fresh one)."""
    from iterserve.scheduler import Request, Scheduler, SchedulerConfig

    sched = Scheduler(
        SchedulerConfig(
            policy="chunked", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
            block_size=8, num_kv_blocks=num_kv_blocks,
        )
    )  # fmt: skip
    runner = make_runner(path, num_kv_blocks=num_kv_blocks)
    for request_id, (prompt, params) in requests.items():
        sched.add_request(Request(request_id, list(prompt), params))
    outputs = {request_id: [] for request_id in requests}
    while sched.has_work:
        if sched.step == restart_at_step:
            sched.requeue_running()
            runner = make_runner(path, num_kv_blocks=num_kv_blocks)
        step = sched.schedule(0.0)
        for out in sched.update(runner.execute(step.plan)).outputs:
            outputs[out.request_id] += out.new_token_ids
    return outputs, sched.num_preemptions


def test_seeded_requests_draw_the_same_tokens_under_preemption_and_restart(checkpoint_dir):
    """The same seed gives the same text whatever happens to the request: shared
    batches, preemption for want of KV blocks, a worker restart. Each seeded
    request's draws continue where they stopped when it is recomputed."""
    path = checkpoint_dir("llama")
    ps = prompts(6)
    requests = {
        f"s{i}": (ps[i], SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True))
        for i in range(4)
    }  # fmt: skip
    alone = {rid: _serve(path, {rid: request}, num_kv_blocks=64)[0][rid] for rid, request in requests.items()}  # fmt: skip
    scarce, num_preemptions = _serve(path, requests, num_kv_blocks=13)
    assert num_preemptions > 0
    assert scarce == alone
    restarted, _ = _serve(path, requests, num_kv_blocks=64, restart_at_step=6)
    assert restarted == alone
