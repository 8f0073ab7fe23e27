"""A roofline cost model of one forward step of a Llama-style dense model.

A step computes a set of *pieces*: a piece is ``num_tokens`` consecutive
positions of one sequence starting at ``start_pos`` (a decode is one token, a
prefill piece many, padding tokens are positions like any other). Per GPU of a
``tp``-way tensor-parallel group (everything below is divided by ``tp``):

=================  ===========================================================
quantity           formula (summed over the step's pieces)
=================  ===========================================================
weight bytes       (layer params + LM head params) x dtype bytes, read once
KV bytes read      (start_pos + num_tokens) x KV bytes per token  (the context)
KV bytes written   num_tokens x KV bytes per token
linear FLOPs       2 x layer params x num_tokens + 2 x LM head params x rows
attention FLOPs    4 x layers x hidden x sum of causal contexts of the piece
=================  ===========================================================

``rows`` is the number of positions whose logits are computed (one per sampled
sequence and per padding slot). The causal context of a piece is
``sum(start_pos + i + 1 for i in range(num_tokens))``.

    step time = max(bytes / (HBM bw x BW_EFF), flops / (peak x FLOPS_EFF))
                + STEP_OVERHEAD_S
                + [tp > 1] 2 x layers x (AR_LATENCY_S + ring bytes / NVLink bw)

Assumptions (constants below, each a stated assumption, not a measurement):

- BW_EFF = 0.8: streaming reads reach ~80-90% of spec HBM bandwidth on
  Hopper; GEMV-shaped decode kernels sit near the low end.
- FLOPS_EFF = 0.6: large bf16 GEMMs reach ~60-75% of the dense spec peak;
  whole-model prefill (with norms, rotary, attention) nearer 50-60%.
- STEP_OVERHEAD_S = 1 ms: scheduling, input preparation, sampling and kernel
  launches per step, with CUDA graphs for decode.
- Tensor parallelism all-reduces the hidden state twice per layer (after
  attention and after the MLP); a ring moves 2 (tp - 1) / tp of the message per
  GPU at NVLINK_EFF of the unidirectional NVLink bandwidth, plus AR_LATENCY_S.
- Memory and compute overlap perfectly within a step (a step-level roofline):
  optimistic for mixed steps, whose decode attention is memory-bound while
  their GEMMs are compute-bound.
- Activations, the embedding gather and norm weights are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

BW_EFF = 0.8
FLOPS_EFF = 0.6
NVLINK_EFF = 0.7
STEP_OVERHEAD_S = 1.0e-3
AR_LATENCY_S = 8.0e-6
# Share of GPU memory given to weights + KV cache (the rest: activations, CUDA context).
MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class GPU:
    """Spec-sheet figures (decimal units)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16, no sparsity
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2  # bf16

    @property
    def layer_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * kv  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return self.layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        """The LM head (untied from the embedding in Llama 3)."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layer_params + 2 * self.head_params  # + the embedding table

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS = {
    # H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 80 GB, NVLink 4 900 GB/s (both ways).
    "h100": GPU("h100", 3.35e12, 989e12, 80e9, 450e9),
    # H200 SXM: 4.8 TB/s HBM3e, same compute as H100, 141 GB.
    "h200": GPU("h200", 4.8e12, 989e12, 141e9, 450e9),
}

MODELS = {
    "8b": Model("8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                intermediate=14336, vocab=128256),
    "70b": Model("70b", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                 intermediate=28672, vocab=128256),
}  # fmt: skip

# 8B fits one GPU; 70B is served on a whole 8-GPU node.
DEFAULT_TP = {"8b": 1, "70b": 8}


@dataclass(frozen=True)
class StepCost:
    time_s: float
    bytes: float  # per GPU
    flops: float  # per GPU
    compute_bound: bool


class CostModel:
    def __init__(self, gpu: str | GPU, model: str | Model, tp: int | None = None):
        self.gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
        self.model = MODELS[model] if isinstance(model, str) else model
        self.tp = DEFAULT_TP.get(self.model.name, 1) if tp is None else tp
        if self.tp < 1 or self.model.kv_heads % self.tp:
            # Each GPU holds whole KV heads: no replication to account for.
            raise ValueError(f"tp={self.tp} must divide the {self.model.kv_heads} KV heads")
        m = self.model
        self._weight_read = (m.layer_params + m.head_params) * m.dtype_bytes / self.tp
        self._kv_tok = m.kv_bytes_per_token / self.tp
        self._bw = self.gpu.hbm_bytes_per_s * BW_EFF
        self._fl = self.gpu.peak_flops * FLOPS_EFF

    def num_kv_blocks(self, block_size: int = 16) -> int:
        """KV blocks that fit in the group's memory once the weights are loaded."""
        m = self.model
        free = self.tp * self.gpu.memory_bytes * MEMORY_FRACTION - m.weight_bytes
        blocks = int(free // (m.kv_bytes_per_token * block_size))
        if blocks <= 0:
            raise ValueError(f"{m.name} does not fit on {self.tp} x {self.gpu.name}")
        return blocks

    def step(self, pieces: list[tuple[int, int]], logit_rows: int) -> StepCost:
        """Cost of one step computing ``pieces`` of ``(start_pos, num_tokens)``."""
        tokens = context = causal = 0
        for start, n in pieces:
            tokens += n
            context += start + n
            causal += n * start + n * (n + 1) // 2
        return self.totals(tokens, context, causal, logit_rows)

    def totals(self, tokens: int, context: int, causal: int, logit_rows: int) -> StepCost:
        """As :meth:`step`, from the sums over pieces (the simulator's hot path)."""
        m, tp = self.model, self.tp
        nbytes = self._weight_read + self._kv_tok * (context + tokens)
        flops = (
            2 * m.layer_params * tokens
            + 2 * m.head_params * logit_rows
            + 4 * m.layers * m.hidden * causal
        ) / tp
        t_mem, t_flop = nbytes / self._bw, flops / self._fl
        time_s = max(t_mem, t_flop) + STEP_OVERHEAD_S
        if tp > 1:
            ring = 2 * (tp - 1) / tp * tokens * m.hidden * m.dtype_bytes
            nvlink = self.gpu.nvlink_bytes_per_s * NVLINK_EFF
            time_s += 2 * m.layers * (AR_LATENCY_S + ring / nvlink)
        return StepCost(time_s, nbytes, flops, t_flop > t_mem)
