"""Adding an architecture whose features the decoder has is one declaration and
one registry line (docs/model-runtime.md, "Adding an architecture"): shown on
transformers' Ministral, which is not registered (Mistral's keys, each layer
sliding or full as ``layer_types`` says), equal to its greedy output."""

from __future__ import annotations

import pytest
import torch
from plan_driver import PlanDriver
from test_runner_greedy import make_runner, prompts
from tiny_checkpoints import BASE, HFReference, save

from iterserve.workers import CheckpointError, ModelConfig
from iterserve.workers.architectures import ARCHITECTURES
from iterserve.workers.architectures.base import Architecture
from iterserve.workers.architectures.keys import (
    FULL,
    SLIDING,
    Fields,
    Raw,
    activation,
    layer_types,
    rope,
    slide,
    window,
)
from iterserve.workers.config import LayerSpec


def parse_ministral(raw: Raw, f: Fields) -> Fields:
    """The declaration the docs' steps write: Mistral's layer, slid per layer type."""
    size = window(raw)
    types = layer_types(raw, f["num_layers"], lambda i: SLIDING if size is not None else FULL)
    return {"layers": slide(LayerSpec(activation=activation(raw)), types, size), **rope(raw)}


def test_a_registered_declaration_serves_transformers_ministral(monkeypatch, tmp_path):
    import transformers

    raw = {"architectures": ["MinistralForCausalLM"], "vocab_size": 8, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    with pytest.raises(CheckpointError, match="unsupported architecture 'MinistralForCausalLM'"):
        ModelConfig.from_dict(raw)
    monkeypatch.setitem(ARCHITECTURES, "MinistralForCausalLM", Architecture(parse_ministral))

    config = transformers.MinistralConfig(**{**BASE, "head_dim": 16, "sliding_window": 20,
                                             "layer_types": [SLIDING, FULL]})  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MinistralForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # peaked logits, as tiny_checkpoints makes them
    path = save(model, tmp_path / "ministral")

    runner = make_runner(path, kernel_backend="cpu")
    assert [layer.window for layer in runner.config.layers] == [20, None]
    driver = PlanDriver(runner)
    ps = prompts()
    for i, p in enumerate(ps):
        driver.add(f"r{i}", p)
    hf = HFReference(model)
    assert driver.run(chunk=7) == {f"r{i}": hf.greedy(p) for i, p in enumerate(ps)}
