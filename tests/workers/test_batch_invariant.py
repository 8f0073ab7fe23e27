"""``batch_invariant``: a row's logits are the same bits whether its request runs
alone or among 1-64 other rows of decodes and prefill pieces, whatever pieces its
prompt is cut into, and after a preemption and recompute; so greedy and seeded
tokens are too. The demo model on the cpu backend, fp32 and bf16, one thread and
two; hypothesis draws the batches. The default mode is shown to differ, so the
checks can tell."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariance import Scenario, alone, differing, prompt_pool, run

from iterserve.models import DEMO_MODEL_PATH
from iterserve.workers import ModelRunner
from iterserve.workers.dtype import DtypeError, RuntimeChoices

DTYPES = ["float32", "bfloat16"]
# Every request at once, arriving over the first steps so that decode rows meet
# prefill pieces; pieces of every kind of size; a preemption every few steps.
CROWD = [(1.0, [1, 3, 16, 1 << 30], 0.15), (0.7, [2, 17, 64], 0.15), (1.0, [1 << 30], 0.0)]


def make_runner(dtype: str, invariant: bool = True, path=DEMO_MODEL_PATH) -> ModelRunner:
    return ModelRunner(path, dtype=dtype, num_kv_blocks=2048, block_size=16,
                       kernel_backend="cpu", batch_invariant=invariant)  # fmt: skip


class Model:
    """A runner, the prompt pool, and each request's logits and tokens alone."""

    def __init__(self, dtype: str, invariant: bool = True, path=DEMO_MODEL_PATH, count=64):
        self.runner = make_runner(dtype, invariant, path)
        self.prompts = prompt_pool(self.runner.vocab_size, count)
        self.logits, self.tokens = alone(self.runner, self.prompts)

    def run(self, scenario: Scenario) -> tuple[list, list, dict]:
        """The scenario run: the rows whose logits are not their request's alone
        (:func:`differing`), the requests whose tokens are not, and the run's stats."""
        logits, tokens, stats = run(self.runner, self.prompts, scenario)
        wrong_tokens = [label for label in tokens if tokens[label] != self.tokens[label]]
        return differing(self.logits, logits), wrong_tokens, stats


@pytest.fixture(scope="module", params=DTYPES)
def model(request):
    return Model(request.param)


def crowd(labels, seed=0) -> Scenario:
    return Scenario({label: i // 8 for i, label in enumerate(labels)}, CROWD, seed)


def test_64_requests_at_once_compute_every_row_as_alone(model):
    rows, tokens, stats = model.run(crowd(model.prompts))
    assert rows == [] and tokens == []
    assert stats["widest_step"] >= 64 and stats["mixed_steps"] and stats["preemptions"]


def test_a_prompt_cut_at_every_size_computes_as_in_one_piece(model):
    long = [label for label in model.prompts if label.endswith(("-100", "-257"))]
    for size in (1, 2, 3, 5, 15, 16, 17, 31, 33, 64, 100):
        rows, tokens, _ = model.run(Scenario(dict.fromkeys(long, 0), [(1.0, [size], 0.0)]))
        assert rows == [] and tokens == [], size


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_batches_compute_every_row_as_alone(model, data):
    labels = data.draw(st.lists(st.sampled_from(sorted(model.prompts)), min_size=1, max_size=12,
                                unique=True))  # fmt: skip
    arrivals = {label: data.draw(st.integers(0, 6)) for label in labels}
    steps = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.3, 0.6, 1.0]),
                st.lists(
                    st.sampled_from([1, 2, 3, 5, 8, 16, 17, 31, 64, 100, 1 << 30]),
                    min_size=1,
                    max_size=3,
                ),  # fmt: skip
                st.sampled_from([0.0, 0.0, 0.25]),
            ),
            min_size=1,
            max_size=6,
        )
    )
    rows, tokens, _ = model.run(Scenario(arrivals, steps, data.draw(st.integers(0, 1000))))
    assert rows == [] and tokens == []


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_threads_keep_rows_apart(dtype, two_threads):
    """The rows' parallel driver, and oneDNN's threads, whatever the batch."""
    model = Model(dtype)
    rows, tokens, _ = model.run(crowd(list(model.prompts)[:24], seed=1))
    assert rows == [] and tokens == []


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma2", "mistral"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_windows_and_soft_caps_compute_every_row_as_alone(name, dtype, checkpoint_dir):
    """Beyond the demo Llama: routed experts beside a dense layer (Qwen3-MoE, two of
    eight a token), sliding windows shorter than the prompts, capped scores and
    logits (Gemma 2), a window on every layer (Mistral)."""
    model = Model(dtype, path=checkpoint_dir(name), count=24)
    rows, tokens, stats = model.run(crowd(model.prompts, seed=2))
    assert rows == [] and tokens == []
    assert stats["mixed_steps"] and stats["preemptions"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_mode_computes_a_row_by_its_batch(dtype):
    """What the mode is for: without it the same scenario changes some rows' bits."""
    model = Model(dtype, invariant=False)
    logits, _, _ = run(model.runner, model.prompts, crowd(model.prompts))
    assert differing(model.logits, logits) != []


def test_the_choice_travels_with_the_engines_runtime_choices():
    choices = RuntimeChoices("bfloat16", "configured", "amx", batch_invariant=True)
    assert RuntimeChoices.from_dict(json.loads(json.dumps(choices.to_dict()))) == choices
    assert RuntimeChoices.from_dict({"dtype": "float32", "dtype_reason": "x", "isa": "amx"}) == (
        RuntimeChoices("float32", "x", "amx")
    )


def test_the_torch_backend_and_fp16_on_a_cpu_refuse_the_mode_by_name():
    with pytest.raises(ValueError, match="batch_invariant: the torch kernel backend"):
        ModelRunner(DEMO_MODEL_PATH, dtype="float32", num_kv_blocks=16, kernel_backend="torch",
                    batch_invariant=True)  # fmt: skip
    with pytest.raises(DtypeError, match="batch_invariant on a CPU computes in float32 or"):
        ModelRunner(DEMO_MODEL_PATH, dtype="float16", num_kv_blocks=16, kernel_backend="cpu",
                    batch_invariant=True)  # fmt: skip


def test_the_runner_packs_every_product_for_the_fixed_row_kernels():
    runner = make_runner("float32")
    assert runner.ops.invariant and runner.choices.batch_invariant
    layer = runner.model.layers[0]
    packed = [layer.attn.qkv_packed, layer.attn.o_packed, layer.mlp.gate_up_packed,
              layer.mlp.down_packed, runner.model.lm_head_packed]  # fmt: skip
    assert all(p is not None and p.invariant and not p.pad_cliff for p in packed)


@pytest.mark.slow
def test_two_ranks_keep_rows_apart_and_agree(tmp_path):
    """TP=2: each rank's rows are the same bits alone as in a crowd, and the ranks
    sample alike. (Against TP=1 the bits differ: each rank sums half of a product's
    inputs and the all-reduce adds the halves; docs/model-runtime.md says so.)"""
    import socket

    import torch.multiprocessing as mp
    from invariance import tp_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank")
    mp.spawn(tp_rank, args=(2, port, "bfloat16", 16, out), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    for report in ranks:
        assert report["differing"] == 0 and report["preemptions"]
        assert report["crowd_tokens"] == {k: report["tokens"][k] for k in report["crowd_tokens"]}
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
