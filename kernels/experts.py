"""Mixture of experts: routing, and the experts' torch implementation.

:func:`route` picks each token's experts the way Mixtral and Qwen3-MoE do:
softmax over every expert's router logit (in fp32), the ``top_k`` best, their
weights renormalised to sum to one when the checkpoint says so (Mixtral always,
Qwen3-MoE by ``norm_topk_prob``). Renormalised, this is the same as top-k of
the logits followed by a softmax over the chosen ones.

:func:`fused_experts` is what the CPU runs and the definition the Triton
grouped kernel (:mod:`.triton_experts`) is checked against. The batch's
``(token, k)`` pairs are sorted by expert; each expert that any token chose
computes its gated MLP on exactly the rows routed to it, one matrix product per
projection, so a step's cost follows the experts its tokens use, not how many
the model has::

    topk_ids [[2, 0], [2, 1], [0, 2]]  ->  expert 0: tokens 0, 2
                                           expert 1: token 1
                                           expert 2: tokens 0, 1, 2
                                           (experts 3..E-1: nothing computed)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import checks, reference
from .cpu.linear import linear
from .quant import QuantizedWeight

# In the tensors' dtype, as Hugging Face's expert MLPs compute them (fp32 tensors:
# the fp32 references' values); a 512-token bf16 prefill step of the 144M-shaped
# Mixtral took 366 ms with the references' fp32 round trip, 347 ms with these.
ACTIVATIONS = {"silu": reference.silu_mul_in_dtype, "gelu_tanh": reference.gelu_tanh_mul_in_dtype}


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, each ``[num_tokens, top_k]``: fp32 weights, int64 expert ids."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [num_tokens, num_experts]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_fused_experts(x, w13, w2, topk_ids, topk_weights, activation) -> None:
    x = checks.check_tensor("x", x, ndim=2, dtypes=checks.FLOAT_DTYPES, last_dim_contiguous=True)
    dev = x.device
    w13 = checks.check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), device=dev, contiguous=True)
    w2 = checks.check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), device=dev, contiguous=True)
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=checks.INDEX_DTYPES, device=dev)
    checks.check_tensor("topk_weights", topk_weights, ndim=2, device=dev)
    num_experts, two_inter, hidden = w13.shape
    checks.check_dim("w13", w13, 2, x.shape[1], "hidden size of x")
    if two_inter % 2:
        raise ValueError(f"w13 must stack gate and up rows (an even dimension 1), got {two_inter}")
    checks.check_dim("w2", w2, 0, num_experts, "num_experts, as in w13")
    checks.check_dim("w2", w2, 1, hidden, "hidden size of x")
    checks.check_dim("w2", w2, 2, two_inter // 2, "intermediate size, half of w13's rows")
    checks.check_dim("topk_ids", topk_ids, 0, x.shape[0], "num_tokens of x")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, "
                         f"expected {tuple(topk_ids.shape)} (same as topk_ids)")  # fmt: skip
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    activation: str = "silu",
    packed: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token;
    an expert is ``w2 @ act(gate) * up`` with ``[gate; up] = w13 @ x``. ``packed``:
    each expert's two weights in oneDNN's layout (:func:`cpu_linear.pack`), used
    where given (the Triton kernel has no use for them), or a quantized checkpoint's
    (:class:`~iterserve.kernels.quant.QuantizedWeight`), whose dense ``w13`` and
    ``w2`` are empty."""
    quantized = packed is not None and isinstance(packed[0][0], QuantizedWeight)
    if quantized:
        w13 = w2 = None  # only the packed weights are read
    else:
        check_fused_experts(x, w13, w2, topk_ids, topk_weights, activation)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    # (token, k) pairs sorted by expert: each expert's rows are one contiguous run
    # of the gathered rows. Only the products go expert by expert; the gather, the
    # activation and the weighted sum run once over every pair (a step's cost on a
    # CPU is as much the number of calls as their arithmetic).
    order = torch.argsort(flat_ids, stable=True)
    num_experts = len(packed) if quantized else w13.shape[0]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)  # [num_pairs, hidden]
    runs = [(e, n) for e, n in enumerate(counts) if n]  # experts no token chose: nothing read
    if not runs:
        return torch.zeros_like(x)
    bounds = [0]
    for _, n in runs:
        bounds.append(bounds[-1] + n)

    def each_expert(inputs, weights, which):
        parts = []
        for (expert, _), start, end in zip(runs, bounds, bounds[1:]):
            w_packed = packed[expert][which] if packed is not None else None
            weight = weights[expert] if weights is not None else None
            parts.append(linear(inputs[start:end], weight, None, w_packed))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    h = ACTIVATIONS[activation](each_expert(rows, w13, 0))  # [num_pairs, inter]
    y = each_expert(h, w2, 1)  # [num_pairs, hidden]
    pair_weights = topk_weights.reshape(-1).float().index_select(0, order)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float().mul_(pair_weights[:, None]))
    return out.to(x.dtype)
