"""bench forward runs end to end and reports every figure (small settings)."""

from __future__ import annotations

from iterserve.bench.forward import RANDOM_LLAMA, bench_forward, write_random_llama


def test_bench_forward_reports_throughputs(checkpoint_dir):
    out = bench_forward(
        checkpoint_dir("llama"), batch_sizes=(1, 3), context=20, prefill_len=24, steps=2
    )
    for key in ("decode_tok_s_1", "decode_tok_s_3", "prefill_tok_s_24"):
        assert out[key] > 0
    assert out["kernel_backend"] == "cpu"  # the default off CUDA


def test_random_llama_checkpoint_is_loadable(tmp_path):
    small = {**RANDOM_LLAMA, "num_hidden_layers": 1, "vocab_size": 64, "hidden_size": 32}
    small |= {"intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}
    path = write_random_llama(tmp_path / "random", small)
    out = bench_forward(path, batch_sizes=(2,), context=8, prefill_len=16, steps=1)
    assert out["decode_tok_s_2"] > 0 and out["model"] == str(path)


def test_architectures_and_experts_are_reported_as_ratios():
    from iterserve.bench import architectures

    small = {**RANDOM_LLAMA, "num_hidden_layers": 1, "vocab_size": 64, "hidden_size": 64}
    small |= {"intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
    shape = dict(batch_size=2, context=8, steps=1, base=small)
    out = architectures.compare_architectures(prefill_len=16, rounds=2, **shape)
    assert set(architectures.SAME_SHAPE) <= set(out)
    assert out["llama"]["decode_tok_s_2_vs_llama"] == 1.0
    assert all(out[name]["prefill_tok_s_16_vs_llama"] > 0 for name in architectures.SAME_SHAPE)
    moe = {**architectures.MOE, "num_local_experts": 4, "intermediate_size": 32}
    out = architectures.moe_experts_used(used=(1, 2), moe=moe, **shape)
    assert out["ratio_experts_4_vs_4"] == 1.0
    assert {"decode_ms_experts_1", "ratio_experts_2_vs_4"} <= set(out)
