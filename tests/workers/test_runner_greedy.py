"""Greedy generation through ModelRunner is token-identical to transformers' generate."""

from __future__ import annotations

import pytest
import torch
from plan_driver import PlanDriver
from tiny_checkpoints import short_context

from iterserve.workers import ModelRunner

LENGTHS = [1, 3, 9, 16, 17, 33, 70, 100]


def prompts(n: int = len(LENGTHS), seed: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for length in LENGTHS[:n]]


def make_runner(path, **kwargs) -> ModelRunner:
    # fp32 whatever the CPU: transformers' greedy output here is fp32's.
    kwargs = {"num_kv_blocks": 256, "block_size": 8, "kernel_backend": "torch",
              "dtype": "float32", **kwargs}  # fmt: skip
    return ModelRunner(path, **kwargs)


def expected(hf, ps):
    return {f"r{i}": hf.greedy(p) for i, p in enumerate(ps)}


def test_one_sequence_alone(arch, checkpoint_dir, hf_reference):
    prompt = prompts()[4]
    driver = PlanDriver(make_runner(checkpoint_dir(arch), **short_context(arch)))
    driver.add("r0", prompt)
    assert driver.run() == {"r0": hf_reference(arch).greedy(prompt)}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_eight_sequences_batched(name, checkpoint_dir, hf_reference):
    ps = prompts()
    driver = PlanDriver(make_runner(checkpoint_dir(name)))
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    assert driver.run() == expected(hf_reference(name), ps)


def test_cpu_backend_matches_transformers(arch, checkpoint_dir, hf_reference):
    """The default backend off CUDA (decode attention compiled by numba, windowed and
    soft-capped attention on the reference, experts on their rows) keeps greedy
    exact: eight sequences in 7-token pieces, decodes beside prefills."""
    ps = prompts()
    driver = PlanDriver(
        make_runner(checkpoint_dir(arch), kernel_backend="cpu", **short_context(arch))
    )
    assert driver.runner.ops.name == "cpu"
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    assert driver.run(chunk=7) == expected(hf_reference(arch), ps)


@pytest.mark.parametrize("block_size", [1, 8])
def test_a_warmed_up_runner_compiles_first_and_generates_the_same(
    monkeypatch, checkpoint_dir, hf_reference, block_size
):
    """warm_up runs the compiled kernels (both attention cases among them) before any
    request, leaves no sequence behind, and what it wrote does not reach a request."""
    from iterserve.kernels.cpu import attention_rows, layer

    calls = []  # the rows each attention call took: on its own, or after the rotary
    kernel, one_call = attention_rows.attend_rows, layer._one_call_loops
    monkeypatch.setattr(
        attention_rows, "attend_rows", lambda *a: calls.append(a[6].size) or kernel(*a)
    )
    monkeypatch.setattr(
        layer, "_one_call_loops", lambda *a: calls.append(a[14].size) or one_call(*a)
    )
    runner = make_runner(checkpoint_dir("llama"), kernel_backend="cpu", block_size=block_size)
    runner.warm_up()
    layers = runner.config.num_layers  # the prompt piece's two rows, then one decode row
    assert calls == [2] * layers + [1] * layers
    assert not runner.table.by_slot
    ps = prompts(4)
    driver = PlanDriver(runner)
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    assert driver.run(chunk=7) == expected(hf_reference("llama"), ps)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_in_pieces(chunk, checkpoint_dir, hf_reference):
    ps = prompts()
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    assert driver.run(chunk=chunk) == expected(hf_reference("llama"), ps)


def test_decodes_and_prefills_share_steps(checkpoint_dir, hf_reference):
    """Sequences arrive while others decode; prefill pieces of varying size."""
    ps = prompts()
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    waiting = list(enumerate(ps))
    mixed_steps = 0
    while waiting or driver.active:
        if waiting and driver.step_no % 3 == 0:
            i, p = waiting.pop(0)
            driver.add(f"r{i}", p)
        result = driver.step(chunk=lambda seq: 5 + seq.slot * 3)
        mixed_steps += 0 < len(result.sampled) < len(driver.active) + len(result.finished)
    assert mixed_steps > 5
    assert {k: s.output for k, s in driver.done.items()} == expected(hf_reference("llama"), ps)


def test_padding_rows_change_nothing(checkpoint_dir, hf_reference):
    ps = prompts(5)
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    out = driver.run(
        chunk=16,
        pad_tokens=lambda seq: seq.slot % 3 if seq.computed < seq.num_prompt else 0,
        padding_slots=[90, 91],
    )
    assert out == expected(hf_reference("llama"), ps)
    assert sum(r.num_padding_tokens for r in driver.results) > 2 * len(driver.results)


def test_step_result_accounting(checkpoint_dir):
    driver = PlanDriver(make_runner(checkpoint_dir("llama")))
    driver.add("a", list(range(10)))
    driver.add("b", list(range(3)))
    result = driver.step(chunk=4, pad_tokens=lambda seq: 1, padding_slots=[7])
    assert result.num_tokens == 4 + 3
    assert result.num_padding_tokens == 2 + 1
    assert [t.seq_id for t in result.sampled] == [1]  # "b", in slot 1
    assert result.forward_s > 0
    assert result.step == 0
