"""LoRA adapters on the runner: greedy tokens equal transformers + peft's, alone and
mixed in one batch with the base model, under chunked prefill; bad adapters are
refused naming the problem."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from lora_adapters import ADAPTERS, build_peft_model, save_adapter
from plan_driver import GREEDY, PlanDriver
from test_runner_greedy import make_runner, prompts
from tiny_checkpoints import HFReference

from iterserve.workers.config import ModelConfig
from iterserve.workers.lora import AdapterError, read_adapter, shard_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, hf_reference, tmp_path_factory):
    """``adapters[name] -> (path, HFReference of base + adapter)`` on the tiny llama."""
    checkpoint_dir("llama")
    base = hf_reference("llama").model
    out = {}
    for i, name in enumerate(ADAPTERS):
        model = build_peft_model(base, name, seed=10 + i)
        out[name] = (save_adapter(model, tmp_path_factory.mktemp(name)), HFReference(model))
    return out


def lora_runner(checkpoint_dir, **kwargs):
    return make_runner(checkpoint_dir("llama"), max_loras=4, max_lora_rank=64, **kwargs)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_one_adapter_alone_matches_peft(name, adapters, checkpoint_dir, hf_reference):
    path, ref = adapters[name]
    prompt = prompts()[5]
    assert ref.greedy(prompt) != hf_reference("llama").greedy(prompt), "the adapter changes nothing"
    driver = PlanDriver(lora_runner(checkpoint_dir))
    driver.load_adapter(1, 7, path)
    driver.add("r0", prompt, lora_slot=1)
    assert driver.run() == {"r0": ref.greedy(prompt)}


@pytest.mark.parametrize(
    "backend, kernel, batched",
    [("torch", False, True), ("cpu", True, True), ("cpu", False, True), ("cpu", False, False)],
)
def test_a_mixed_batch_of_adapters_and_base_matches_each_reference(
    backend, kernel, batched, adapters, checkpoint_dir, hf_reference
):
    """Eight sequences, two per adapter slot and two of the base model, in 7-token
    prefill pieces beside each other's decodes: each gets its own model's tokens,
    with the step's adapters in one compiled call per product (the cpu backend's
    default), batched into one torch product or each on its own rows."""
    names = ["qv8", "all16", "mlp4"]
    runner = lora_runner(checkpoint_dir, kernel_backend=backend)
    assert runner.lora_slots.use_cpu_kernel == (backend == "cpu")
    runner.lora_slots.use_cpu_kernel = kernel
    runner.lora_slots.batch_adapters = batched
    driver = PlanDriver(runner)
    for slot, name in enumerate(names, start=1):
        driver.load_adapter(slot, slot, adapters[name][0])
    expected = {}
    for i, prompt in enumerate(prompts()):
        slot = i % 4  # interleaved: the runner groups the rows by adapter itself
        driver.add(f"r{i}", prompt, lora_slot=slot)
        ref = hf_reference("llama") if slot == 0 else adapters[names[slot - 1]][1]
        expected[f"r{i}"] = ref.greedy(prompt)
    assert driver.run(chunk=7) == expected


def test_the_segmented_triton_kernels_in_the_runner_match_peft(adapters, checkpoint_dir,
                                                              hf_reference):  # fmt: skip
    """The GPU path (one shrink and one expand launch per product for all the
    step's adapters), interpreted on the CPU: base and two adapters mixed."""
    runner = lora_runner(checkpoint_dir)
    runner.lora_slots.use_kernels = True
    driver = PlanDriver(runner)
    driver.load_adapter(1, 1, adapters["all16"][0])
    driver.load_adapter(2, 2, adapters["mlp4"][0])
    ps = prompts()
    refs = [hf_reference("llama"), adapters["all16"][1], adapters["mlp4"][1]]
    expected = {}
    params = dataclasses.replace(GREEDY, max_tokens=6)
    for i in range(3):
        driver.add(f"r{i}", ps[4 + i], params=params, lora_slot=i)
        expected[f"r{i}"] = refs[i].greedy(ps[4 + i], 6)
    assert driver.run(chunk=24) == expected


def test_a_slot_loaded_again_serves_the_new_adapter(adapters, checkpoint_dir):
    """A slot's adapter replaced between sequences (an eviction): the next sequence
    in that slot computes with the new one."""
    prompt = prompts()[3]
    runner = lora_runner(checkpoint_dir)
    driver = PlanDriver(runner)
    driver.load_adapter(1, 1, adapters["qv8"][0])
    driver.add("a", prompt, lora_slot=1)
    driver.run()
    driver.load_adapter(1, 2, adapters["kup64"][0])
    driver.add("b", prompt, lora_slot=1)
    out = driver.run()
    assert out["a"] == adapters["qv8"][1].greedy(prompt)
    assert out["b"] == adapters["kup64"][1].greedy(prompt)


def test_merged_adapter_gives_the_same_tokens(adapters, checkpoint_dir):
    """peft's merged weights and the runner's unmerged deltas agree."""
    path, ref = adapters["all16"]
    merged = HFReference(build_merged(ref.model))
    prompt = prompts()[6]
    driver = PlanDriver(lora_runner(checkpoint_dir))
    driver.load_adapter(2, 1, path)
    driver.add("r0", prompt, lora_slot=2)
    assert driver.run() == {"r0": merged.greedy(prompt)}


def build_merged(peft_model):
    import copy

    return copy.deepcopy(peft_model).merge_and_unload().eval()


def test_tensor_parallel_shards_add_up_to_the_whole_delta(adapters, checkpoint_dir):
    """Each rank's share of an adapter (B's rows where the product splits by
    output, A's columns where it splits by input) sums to the whole delta."""
    config = ModelConfig.from_dict(
        json.loads((checkpoint_dir("llama") / "config.json").read_text())
    )
    adapter = read_adapter(adapters["all16"][0], config, 64)
    whole = shard_adapter(adapter, config, tp_rank=0, tp_size=1, dtype=torch.float32, device="cpu")
    parts = [shard_adapter(adapter, config, tp_rank=r, tp_size=2, dtype=torch.float32,
                           device="cpu") for r in range(2)]  # fmt: skip
    torch.manual_seed(0)
    for group in ("qkv", "gate_up"):  # split by output: the ranks' outputs side by side
        x = torch.randn(5, config.hidden_size)
        full = x @ whole[1][group].at @ whole[1][group].bt
        halves = [x @ p[1][group].at @ p[1][group].bt for p in parts]
        if group == "gate_up":  # each rank holds [gate_r, up_r]
            i = config.intermediate_size // 2
            gate = torch.cat([h[:, :i] for h in halves], 1)
            up = torch.cat([h[:, i:] for h in halves], 1)
            torch.testing.assert_close(torch.cat([gate, up], 1), full)
        else:
            hd = config.head_dim
            q, kv = config.num_heads * hd // 2, config.num_kv_heads * hd // 2
            cols = [torch.cat([h[:, :q] for h in halves], 1),
                    torch.cat([h[:, q : q + kv] for h in halves], 1),
                    torch.cat([h[:, q + kv :] for h in halves], 1)]  # fmt: skip
            torch.testing.assert_close(torch.cat(cols, 1), full)
    inter = config.intermediate_size
    x = torch.randn(5, inter)
    full = x @ whole[0]["down"].at @ whole[0]["down"].bt
    halves = [x[:, r * inter // 2 : (r + 1) * inter // 2] @ p[0]["down"].at @ p[0]["down"].bt
              for r, p in enumerate(parts)]  # fmt: skip
    torch.testing.assert_close(halves[0] + halves[1], full)


# -- refusals -------------------------------------------------------------------------


@pytest.fixture
def config(checkpoint_dir):
    return ModelConfig.from_dict(json.loads((checkpoint_dir("llama") / "config.json").read_text()))


def _copy(adapters, tmp_path, name="qv8"):
    dst = tmp_path / "adapter"
    shutil.copytree(adapters[name][0], dst)
    return dst


def _edit_config(path, **changes):
    file = path / "adapter_config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_a_missing_directory_or_file_is_named(adapters, config, tmp_path):
    with pytest.raises(AdapterError, match="not a directory"):
        read_adapter(tmp_path / "nowhere", config, 64)
    path = _copy(adapters, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter(path, config, 64)
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(path, config, 64)


def test_a_rank_over_the_limit_is_refused(adapters, config):
    with pytest.raises(AdapterError, match="r=64 is over max_lora_rank 16"):
        read_adapter(adapters["kup64"][0], config, 16)


def test_an_unknown_target_module_is_refused(adapters, config, tmp_path):
    path = _copy(adapters, tmp_path)
    _edit_config(path, target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match="unknown target modules \\['lm_head'\\]"):
        read_adapter(path, config, 64)


def test_shapes_of_another_model_are_refused(adapters, config):
    import dataclasses

    other = dataclasses.replace(config, hidden_size=config.hidden_size * 2)
    with pytest.raises(AdapterError, match="do not match the base model's projection"):
        read_adapter(adapters["qv8"][0], other, 64)


def test_a_layer_the_model_lacks_is_refused(adapters, config):
    import dataclasses

    with pytest.raises(AdapterError, match="layer 1 q_proj: the base model has 1 layers"):
        read_adapter(adapters["qv8"][0], dataclasses.replace(config, layers=config.layers[:1]), 64)


def test_dora_and_extra_modules_are_refused(adapters, config, tmp_path):
    path = _copy(adapters, tmp_path)
    _edit_config(path, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(path, config, 64)
    _edit_config(path, use_dora=False, modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_adapter(path, config, 64)


# -- under the real scheduler -----------------------------------------------------------


def test_the_scheduler_and_runner_keep_peft_tokens_through_preemption_and_eviction(
    adapters, checkpoint_dir, hf_reference
):
    """Twelve requests over the base model and three adapters, two adapter slots,
    8-token prefill pieces and too few KV blocks for all of them: sequences are
    preempted and recomputed, adapters evicted and loaded again, and every request
    still gets its own model's greedy tokens; prefix-cache hits stay within a model."""
    from iterserve.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
    from iterserve.scheduler.codec import decode, encode
    from iterserve.scheduler.messages import StepPlan, StepResult

    sched = Scheduler(SchedulerConfig(policy="chunked", max_num_seqs=6, max_num_batched_tokens=24,
                                      max_model_len=160, block_size=8, num_kv_blocks=24,
                                      max_loras=2))  # fmt: skip
    names = [None, "qv8", "all16", "mlp4"]
    for name in names[1:]:
        sched.adapters.register(name, str(adapters[name][0]))
    runner = make_runner(checkpoint_dir("llama"), num_kv_blocks=24, max_loras=2, max_lora_rank=64)
    ps = prompts()
    expected = {}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(12):
        # Three prompts over four models: blocks a request could find cached under
        # another model's hashes, if the cache crossed adapters.
        name, prompt = names[i % 4], ps[5 + i % 3][:40]
        sched.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i), lora_name=name))
        ref = hf_reference("llama") if name is None else adapters[name][1]
        expected[f"r{i}"] = ref.greedy(prompt)
    got: dict[str, list[int]] = {rid: [] for rid in expected}
    for _ in range(2000):
        step = sched.schedule(0.0)
        if step is None:
            break
        plan = decode(encode(step.plan), StepPlan)  # what a rank receives
        result = decode(encode(runner.execute(plan)), StepResult)
        for out in sched.update(result).outputs:
            got[out.request_id] += out.new_token_ids
        sched.check_integrity()
    assert not sched.has_work
    assert sched.num_preemptions > 0 and sched.adapters.num_evictions > 0
    assert sched.num_prefix_hits > 0
    assert got == expected
