"""The speculative decoding benchmark's own parts."""

from __future__ import annotations


def test_a_widened_target_computes_what_its_draft_computes(tmp_path):
    """The draft-model benchmark's target: the demo's layers, widened and followed by
    random layers whose outputs are zero (noise 0), gives the demo's logits."""
    from iterserve.bench.speculative import build_widened_target
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.runner import ModelRunner
    from tests.workers.plan_driver import PlanDriver

    target = build_widened_target(DEMO_MODEL_PATH, tmp_path / "t", num_layers=6,
                                  intermediate_size=1024, noise=0.0)  # fmt: skip
    outputs = []
    for path in (DEMO_MODEL_PATH, target):
        runner = ModelRunner(path, dtype="float32", num_kv_blocks=16, block_size=16)
        driver = PlanDriver(runner)
        driver.add("r", list(range(20, 40)))
        outputs.append(driver.run()["r"])
        assert runner.config.num_layers == (4 if path == DEMO_MODEL_PATH else 6)
    assert outputs[0] == outputs[1]


def test_primed_prompts_end_in_the_models_own_greedy_tokens():
    """``--primed N``: each prompt followed by what the model generates for it
    greedily, so a run continues where the model's own output has reached."""
    from iterserve.bench.speculative import _generate, _primed, _runner_options
    from iterserve.models import DEMO_MODEL_PATH
    from iterserve.workers.runner import ModelRunner

    prompts = [list(range(20, 40)), list(range(50, 61))]
    runner = ModelRunner(DEMO_MODEL_PATH, **_runner_options(prompts, 24, "float32"))
    primed = _primed(runner, prompts, 8)
    texts: dict[int, list[int]] = {}
    _generate(runner, prompts, 24, None, texts)
    for i, prompt in enumerate(prompts):
        assert primed[i] == prompt + texts[i][:8]
    assert _primed(runner, prompts, 0) == prompts
