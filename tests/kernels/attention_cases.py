"""Batches for the attention tests: random K/V in shuffled paged-cache blocks,
and the dense fp64 attention every backend is checked against."""

from dataclasses import dataclass

import torch

from iterserve.kernels import reference as ref
from iterserve.scheduler.blocks import blocks_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-2)}

# (cached prefix, query rows) per sequence. Covers: a decode row whose context
# crosses block boundaries, a prefill chunk starting mid-block and crossing a
# boundary, a sequence with no rows this step, a fresh prefill, a short decode.
MIXED = [(37, 1), (21, 12), (9, 0), (0, 19), (5, 1)]
DECODE = [(40, 1), (3, 1), (16, 1), (31, 1)]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks], int32
    seq_lens: torch.Tensor  # [num_seqs], int32
    query_start_loc: torch.Tensor  # [num_seqs + 1], int32
    keys: list  # per sequence [seq_len, num_kv_heads, head_dim], dense
    values: list
    q_lens: list
    scale: float

    def args(self):
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(shape, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
               consecutive=False) -> Batch:  # fmt: skip
    """Random K/V written through store_kv into shuffled cache blocks (``consecutive``:
    each sequence's blocks one run, as the allocator mostly hands them out)."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in shape]
    seq_lens = [c + q for c, q in shape]
    blocks_needed = [blocks_for(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # a few spare blocks that nobody owns
    order = torch.randperm(num_blocks, generator=g).tolist()
    if consecutive:
        order = list(range(num_blocks))
    max_blocks = max(blocks_needed) + 1  # one unused column, left as 0
    block_tables = torch.zeros(len(shape), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    k_cache, v_cache = k_cache.to(dtype), torch.randn(k_cache.shape, generator=g).to(dtype)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        table = order[: blocks_needed[s]]
        order = order[blocks_needed[s] :]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size
        ref.store_kv(k, v, k_cache, v_cache, slots + pos % block_size)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return Batch(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        keys=keys,
        values=values,
        q_lens=q_lens,
        scale=head_dim**-0.5,
    )


def dense_attention(b: Batch, window: int | None = None, soft_cap: float | None = None):
    """Row by row, fp64, on contiguous K/V: softmax(q k[:p+1]^T * scale) v[:p+1];
    with a window only positions p - window + 1..p, with a soft cap the scores
    through cap * tanh(score / cap)."""
    num_heads = b.query.shape[1]
    out = torch.zeros(b.query.shape, dtype=torch.float64)
    row = 0
    for k, v, q_len in zip(b.keys, b.values, b.q_lens, strict=True):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
        v = v.double().repeat_interleave(group, dim=1)
        context = k.shape[0] - q_len
        for i in range(q_len):
            p = context + i
            q = b.query[row].cpu().double()  # [num_heads, D]
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,nhd->hn", q, k[lo : p + 1]) * b.scale
            if soft_cap is not None:
                scores = torch.tanh(scores / soft_cap) * soft_cap
            out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[lo : p + 1])
            row += 1
    return out


def poison_past_ends(b: Batch, block_size: int) -> None:
    """NaN in the K slots and infinities in the V slots past each sequence's end
    in its last block: what a kernel reads there must never reach an output."""
    for s, n in enumerate(b.seq_lens.tolist()):
        last, used = b.block_tables[s, (n - 1) // block_size], (n - 1) % block_size + 1
        b.k_cache[last, used:] = float("nan")
        b.v_cache[last, used:] = float("inf")
