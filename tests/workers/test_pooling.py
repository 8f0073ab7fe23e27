"""A pooling runner's vectors against transformers' hidden states (fp32), whole
prompts and prompts in pieces, several in one step; and what the step hands back.

Tolerance: every element within ``TOLERANCE`` times the reference vector's
largest magnitude (the same fp32 products, summed in other orders; measured at
most 6e-7 on both CPU backends).
"""

from __future__ import annotations

import pytest
import torch
from plan_driver import PlanDriver

from iterserve.scheduler.sampling import SamplingParams
from iterserve.workers import ModelRunner
from iterserve.workers.pooling import Pooler
from tests.workers.tiny_checkpoints import build_hf_model, save

PROMPT_ONLY = SamplingParams(max_tokens=0)  # a pooling request: its prompt, no token
TOLERANCE = 1e-5
PROMPTS = {
    "long": [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41],
    "short": [1, 30],
    "mid": list(range(3, 17)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_hf_model("llama")
    return model, save(model, tmp_path_factory.mktemp("pooling") / "llama")


def reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm), pooled."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [len(ids), hidden]
    return hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)


def pooled_run(path, pooling: str, chunk: int, backend: str) -> tuple[dict, PlanDriver]:
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=64, block_size=4,
                         kernel_backend=backend, pooling=pooling)  # fmt: skip
    driver = PlanDriver(runner)
    for request_id, ids in PROMPTS.items():
        driver.add(request_id, ids, PROMPT_ONLY)
    vectors = {}
    while driver.active:
        result = driver.step(chunk=chunk)
        assert not result.sampled  # no token is ever sampled
        for pooled in result.pooled:
            assert pooled.seq_id not in vectors  # once, with the step that ends it
            vectors[pooled.seq_id] = pooled.data
    return vectors, driver


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
@pytest.mark.parametrize("chunk", [1 << 30, 3], ids=["whole", "pieces"])
def test_pooled_vectors_are_transformers_hidden_states(checkpoint, pooling, chunk, backend):
    model, path = checkpoint
    vectors, driver = pooled_run(path, pooling, chunk, backend)
    assert set(vectors) == {seq.slot for seq in driver.done.values()}
    for seq in driver.done.values():
        assert seq.finish_reason == "length" and seq.output == []
        want = reference(model, PROMPTS[seq.request_id], pooling)
        got = torch.tensor(vectors[seq.slot])
        assert got.shape == want.shape == (model.config.hidden_size,)
        assert (got - want).abs().max() <= TOLERANCE * want.abs().max(), seq.request_id


def test_a_mean_sums_every_piece_and_forgets_it_when_the_prompt_is_in(checkpoint):
    _, path = checkpoint
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=64, block_size=4,
                         kernel_backend="torch", pooling="MEAN")  # fmt: skip
    driver = PlanDriver(runner)
    seq = driver.add("long", PROMPTS["long"], PROMPT_ONLY)
    driver.step(chunk=4)
    state = runner.table.get(seq.slot)
    assert state.pooled is not None and state.pooled.dtype == torch.float32  # the running sum
    while driver.active:
        driver.step(chunk=4)
    assert len(driver.results[-1].pooled) == 1


def test_the_rows_pooled_are_the_last_of_each_completed_prompt_or_all():
    from iterserve.scheduler.messages import ScheduledSeq

    entries = [ScheduledSeq(0, 0, 3, sample=True), ScheduledSeq(1, 5, 2),
               ScheduledSeq(2, 0, 4, sample=True)]  # fmt: skip
    assert Pooler("LAST").rows(entries).tolist() == [2, 8]
    assert Pooler("MEAN").rows(entries).tolist() == list(range(9))
    with pytest.raises(ValueError, match="LAST, MEAN"):
        Pooler("CLS")


def test_a_request_for_tokens_ends_in_error_on_a_pooling_runner(checkpoint):
    _, path = checkpoint
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=64, block_size=4,
                         kernel_backend="torch", pooling="LAST")  # fmt: skip
    driver = PlanDriver(runner)
    driver.add("tokens", PROMPTS["short"], SamplingParams(max_tokens=4))
    driver.add("prompt", PROMPTS["mid"], PROMPT_ONLY)
    driver.run()
    assert driver.done["tokens"].finish_reason == "error" and driver.done["tokens"].output == []
    assert driver.done["prompt"].finish_reason == "length"
