"""bf16 on the CPU against transformers: each layer's output and the logits stay as
close to the fp32 truth as transformers' own bf16 forward does.

Why a ratio and not an absolute tolerance: a correct bf16 forward is not close
to the fp32 one by any fixed amount; its error is set by where it rounds (every
product's output, every norm's, the residual sums) and grows with depth. Both
this runtime and transformers round at the same points (Hugging Face's order:
products in bf16 with fp32 sums, norms in fp32 cast back, residual adds in
bf16), so the error of ours against fp32 is the same size as transformers'
against fp32, give or take the order of sums: ``RATIO`` allows 1.5x, ``FLOOR``
absorbs the case where transformers' error happens to be tiny. A bug that
skips a rounding step, reads a cache line wrong or mixes heads shows as
errors of order 1, far outside.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_logits import forward_all_rows
from tiny_checkpoints import BASE, save

from iterserve.kernels.cpu import attention as cpu_attention
from iterserve.workers import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="numba is not installed")

RATIO = 1.5
FLOOR = 2e-3
# Wider and deeper than the other tests' tiny models, so rounding errors have room
# to accumulate as they do in a real model; GQA 8/2 heads of 32.
SHAPE = dict(BASE, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=512,
             initializer_range=0.02)  # fmt: skip
PROMPT_LENGTHS = [1, 9, 40, 75]


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    got, truth = got.double(), truth.double()
    return float((got - truth).norm() / truth.norm())


@pytest.fixture(scope="module")
def bf16_case(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(**SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = save(model, tmp_path_factory.mktemp("bf16-llama"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return model, path, prompts


@torch.no_grad()
def hf_layers(model, prompt: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every decoder layer's output (the residual stream after it) and the logits."""
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out: outputs.append((out[0] if isinstance(out, tuple) else out)[0])
        )
        for layer in model.model.layers
    ]
    try:
        logits = model(torch.tensor([prompt])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


def our_layers(runner: ModelRunner, prompts: list[list[int]]):
    """The same from our model, every prompt in one step: per prompt, the residual
    stream after each layer (what the next fused add-norm sums; the post-attention
    norms sum the one after attention) and the logits."""
    sums: list[torch.Tensor] = []
    ops = runner.model.ops

    def rms_norm(x, weight, eps, residual=None):
        out = ops.rms_norm(x, weight, eps, residual)
        if residual is not None:
            sums.append(out[1])
        return out

    runner.model.set_ops(dataclasses.replace(ops, rms_norm=rms_norm), runner.kv_cache)
    try:
        logits = forward_all_rows(runner, [[(0, len(p))] for p in prompts], prompts)
    finally:
        runner.model.set_ops(ops, runner.kv_cache)
    layers = sums[1::2]  # after attention 0, after layer 0, after attention 1, ...
    rows = [len(p) for p in prompts]
    per_prompt = [list(parts) for parts in zip(*(t.split(rows) for t in layers), strict=True)]
    return list(zip(per_prompt, logits, strict=True))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_layers_and_logits_stay_as_close_to_fp32_as_transformers_bf16(bf16_case, backend):
    model, path, prompts = bf16_case
    hf_bf16 = type(model)(model.config).eval()
    hf_bf16.load_state_dict(model.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    ours = ModelRunner(path, dtype="bfloat16", num_kv_blocks=64, block_size=16,
                       kernel_backend=backend)  # fmt: skip
    for prompt, (got_layers, got_logits) in zip(prompts, our_layers(ours, prompts), strict=True):
        truth_layers, truth_logits = hf_layers(model, prompt)
        theirs_layers, theirs_logits = hf_layers(hf_bf16, prompt)
        assert got_logits.dtype == torch.bfloat16
        assert len(got_layers) == len(truth_layers) == SHAPE["num_hidden_layers"]
        pairs = [*zip(got_layers, theirs_layers, truth_layers, strict=True),
                 (got_logits, theirs_logits, truth_logits)]  # fmt: skip
        for depth, (got, theirs, truth) in enumerate(pairs):
            ours_err, theirs_err = relative_error(got, truth), relative_error(theirs, truth)
            assert ours_err <= RATIO * theirs_err + FLOOR, (
                f"prompt of {len(prompt)}, {'logits' if depth == len(pairs) - 1 else depth}: "
                f"ours {ours_err:.2e} against transformers' {theirs_err:.2e}"
            )


def test_fp32_and_bf16_runners_load_the_same_weights(bf16_case):
    """The bf16 runner's first products equal the fp32 weights rounded once."""
    _, path, prompts = bf16_case
    fp32 = ModelRunner(path, dtype="float32", num_kv_blocks=64, block_size=16)
    bf16 = ModelRunner(path, dtype="bfloat16", num_kv_blocks=64, block_size=16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.model.embed, fp32.model.embed.bfloat16())
    want = forward_all_rows(fp32, [[(0, len(prompts[2]))]], [prompts[2]])[0]
    got = forward_all_rows(bf16, [[(0, len(prompts[2]))]], [prompts[2]])[0]
    assert relative_error(got, want) < 0.05
