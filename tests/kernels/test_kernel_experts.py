"""Mixture of experts: routing against transformers' routers, the experts' torch
implementation against a token-by-token loop, and the Triton grouped kernel
against it (interpreted on CPU, so shapes stay small)."""

import pytest
import torch

from iterserve.kernels import experts
from tests.kernels.attention_cases import DEVICE

triton_experts = pytest.importorskip("iterserve.kernels.triton_experts")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}


def layer(num_tokens, hidden, inter, num_experts, top_k, dtype=torch.float32, seed=0, used=None):
    """Random weights and routing; ``used`` limits the experts tokens choose."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    choices = used if used is not None else list(range(num_experts))
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:top_k]]
                       for _ in range(num_tokens)])  # fmt: skip
    weights = torch.rand(num_tokens, top_k, generator=g)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)]


def token_by_token(x, w13, w2, ids, weights, activation="silu"):
    act = {
        "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    }[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            y = w2[e].double() @ (act(h[:inter]) * h[inter:])
            out[t] += weights[t, k].double() * y
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_experts_match_a_token_by_token_loop(activation):
    args = layer(9, 32, 24, 6, 2)
    got = experts.fused_experts(*args, activation)
    torch.testing.assert_close(got.double().cpu(), token_by_token(*args, activation),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_a_batch_of_no_tokens_gives_no_rows():
    x, w13, w2, ids, weights = layer(3, 32, 24, 8, 2)
    got = experts.fused_experts(x[:0], w13, w2, ids[:0], weights[:0])
    assert got.shape == (0, 32) and got.dtype == x.dtype


def test_reference_computes_each_expert_on_its_rows_only(monkeypatch):
    """Experts no token chose are never read (NaN weights change nothing), and the
    rows multiplied are the routed pairs, not the batch times every expert."""
    x, w13, w2, ids, weights = layer(7, 32, 24, 8, 2, used=[1, 4, 6])
    w13[[0, 2, 3, 5, 7]] = float("nan")
    w2[[0, 2, 3, 5, 7]] = float("nan")
    rows = []
    real = experts.linear
    monkeypatch.setattr(experts, "linear", lambda a, *r: rows.append(a.shape[0]) or real(a, *r))
    got = experts.fused_experts(x, w13, w2, ids, weights)
    assert not got.isnan().any()
    assert len(rows) == 2 * 3 and sum(rows) == 2 * 7 * 2  # three experts, 14 pairs, 2 products
    torch.testing.assert_close(got.double().cpu(), token_by_token(x, w13, w2, ids, weights),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers_routers(renormalize):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 16, generator=g)
    if renormalize:
        cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
        router = MixtralTopKRouter(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                          norm_topk_prob=False)  # fmt: skip
        router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, generator=g)
    logits, want_weights, want_ids = router(hidden)
    weights, ids = experts.route(logits, cfg.num_experts_per_tok, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=0, rtol=0)


def test_align_by_expert_groups_pairs_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [5, 2]], device=DEVICE)
    sorted_pairs, block_expert = triton_experts.align_by_expert(ids, 6, 4)
    blocks = sorted_pairs.view(-1, 4).tolist()
    owners = block_expert.tolist()
    real = {e: sorted(p for p in range(8) if int(ids.view(-1)[p]) == e) for e in (0, 1, 2, 5)}
    got: dict[int, list[int]] = {}
    for block, owner in zip(blocks, owners, strict=True):
        if owner < 6:
            got.setdefault(owner, []).extend(p for p in block if p < 8)
        else:
            assert all(p == 8 for p in block)  # past the real blocks: padding only
    assert got == real
    assert owners[:4] == [0, 1, 2, 5] and set(owners[4:]) == {6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(5, 32, 48, 4, 2), (19, 40, 24, 8, 3), (1, 64, 16, 3, 1)])
def test_triton_grouped_experts_match_reference(dtype, activation, shape):
    args = layer(*shape, dtype=dtype, seed=2)
    got = triton_experts.fused_experts(*args, activation)
    assert got.dtype == dtype and got.shape == args[0].shape
    torch.testing.assert_close(got, experts.fused_experts(*args, activation), **TOL[dtype])


def test_triton_grouped_experts_leave_unchosen_experts_unread():
    x, w13, w2, ids, weights = layer(6, 32, 32, 8, 2, used=[3, 7])
    w13[[0, 1, 2, 4, 5, 6]] = float("nan")
    got = triton_experts.fused_experts(x, w13, w2, ids, weights)
    assert not got.isnan().any()
    torch.testing.assert_close(got, experts.fused_experts(x, w13, w2, ids, weights),
                               **TOL[torch.float32])  # fmt: skip


def test_experts_refuse_mismatched_shapes():
    x, w13, w2, ids, weights = layer(3, 32, 24, 4, 2)
    with pytest.raises(ValueError, match="w2 has size"):
        experts.fused_experts(x, w13, w2[:, :, :8].contiguous(), ids, weights)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        triton_experts.fused_experts(x, w13, w2, ids, weights[:, :1])
    with pytest.raises(ValueError, match="activation must be one of"):
        experts.fused_experts(x, w13, w2, ids, weights, "relu")
