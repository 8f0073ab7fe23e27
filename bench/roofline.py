"""A decode step's share of this core's roofline.

A decode step reads every weight once and each sequence's KV, and multiplies
each weight by the step's rows: its floor is the larger of (bytes read ÷ the
bandwidth one core streams memory at) and (FLOPs ÷ the rate one core multiplies
at). Both rates are measured here, on this core, in this process: the bandwidth
as a vector sum over more memory than the caches hold, the rate as the dtype's
product (the kernel a step runs, :func:`iterserve.kernels.cpu.linear.linear`)
on weights that stay in cache at a prefill's row count. A step's shares
(floor ÷ its time) say how far from either bound it runs.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..workers.config import MOE, ModelConfig

STREAM_BYTES = 512 << 20


def stream_bandwidth(nbytes: int = STREAM_BYTES, rounds: int = 5) -> float:
    """Bytes a second one core reads from memory (a vectorised sum, CPU time)."""
    data = np.ones(nbytes // 4, dtype=np.float32)
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        data.sum()
        times.append(time.thread_time() - start)
    return nbytes / min(times)


def peak_flops(dtype: torch.dtype, rows: int = 256, size: int = 1024, rounds: int = 20) -> float:
    """FLOPs a second one core multiplies at in ``dtype`` (the packed product of a
    weight that stays in cache, at a prefill's row count)."""
    from ..kernels.cpu.linear import linear, pack

    gen = torch.Generator().manual_seed(0)
    w = (torch.rand(size, size, generator=gen) - 0.5).to(dtype)
    packed = pack(w)
    x = torch.rand(rows, size, generator=gen).to(dtype)
    for _ in range(3):
        linear(x, w, None, packed)
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        linear(x, w, None, packed)
        times.append(time.thread_time() - start)
    return 2 * rows * size * size / statistics.median(times)


def decode_step_cost(config: ModelConfig, rows: int, context: int, dtype: torch.dtype,
                     tp_size: int = 1) -> tuple[float, float]:  # fmt: skip
    """``(bytes, flops)`` of a decode step of ``rows`` sequences holding ``context``
    tokens each: every weight read once (an MoE layer's experts as the rows route
    them at most), each sequence's K and V read once a layer."""
    c, hd, elem = config, config.head_dim, dtype.itemsize
    heads, kv_heads = c.num_heads // tp_size, c.num_kv_heads // tp_size
    attn = (heads + 2 * kv_heads) * hd * c.hidden_size + c.hidden_size * heads * hd
    params = 0
    for spec in c.layers:
        if spec.mlp == MOE and c.experts is not None:
            used = min(c.experts.num_experts, rows * c.experts.top_k)
            mlp = used * 3 * c.hidden_size * c.experts.intermediate_size // tp_size
        else:
            mlp = 3 * c.hidden_size * c.intermediate_size // tp_size
        params += attn + mlp
    params += c.vocab_size * c.hidden_size  # the LM head, rows logits only
    kv = 2 * c.num_layers * rows * context * kv_heads * hd * elem
    flops = 2 * params * rows + 4 * c.num_layers * rows * context * heads * hd
    return params * elem + kv, flops


def shares(config: ModelConfig, rows: int, context: int, dtype: torch.dtype, step_s: float,
           bandwidth: float, peak: float) -> dict[str, float]:  # fmt: skip
    """The step's floor by each bound, as shares of its measured time."""
    nbytes, flops = decode_step_cost(config, rows, context, dtype)
    return {
        "step_ms": round(step_s * 1e3, 2),
        "bytes_mb": round(nbytes / 1e6, 1),
        "memory_share": round(nbytes / bandwidth / step_s, 3),
        "compute_share": round(flops / peak / step_s, 3),
    }
