"""LoRA adapters through the engine on Ray: two tensor-parallel ranks, each holding
its share of every adapter, give transformers + peft's greedy tokens."""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.conftest import (
    GREEDY,
    PROMPTS,
    assert_sound,
    collect,
    model_config,
    start_engine,
)

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("ray_session")


async def test_two_ranks_split_each_adapter_and_keep_peft_tokens(tiny_llama, tmp_path):
    from tests.workers.lora_adapters import build_peft_model, save_adapter
    from tests.workers.tiny_checkpoints import HFReference, build_hf_model

    base = build_hf_model("llama")  # the same weights as tiny_llama's checkpoint
    refs, modules = {None: HFReference(base)}, {}
    for i, name in enumerate(["all16", "qv8"]):
        model = build_peft_model(base, name, seed=30 + i)
        modules[name] = str(save_adapter(model, tmp_path / name))
        refs[name] = HFReference(model)
    config = model_config(tiny_llama, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                          max_lora_rank=64, lora_modules=modules)  # fmt: skip
    engine = await start_engine(config)
    try:
        jobs = [(name, p) for p in PROMPTS[:4] for name in (None, "all16", "qv8")]
        results = await asyncio.gather(
            *(collect(engine, p, GREEDY, lora_name=name) for name, p in jobs)
        )
        for (name, prompt), (tokens, _) in zip(jobs, results):
            assert tokens == refs[name].greedy(prompt, GREEDY.max_tokens), (name, prompt)
        stats = await engine.stats()
        assert stats["lora_evictions"] >= 1  # two adapters through one slot
        await assert_sound(engine)
    finally:
        await engine.shutdown()
