"""Pure-torch implementations of the serving kernels.

These are the definition of correct behaviour for the Triton kernels and also
what CPU inference runs, so they favour whole-tensor operations over Python
loops: paged attention serves every one-row (decode) sequence of a batch in one
gather and one pair of matmuls, and loops only over multi-row prefill pieces,
of which a step carries few. Everything is computed in fp32 and returned in the
input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler.blocks import blocks_before_window, blocks_for
from . import checks

# Paged attention materialises [num_heads, rows, kv_len] fp32 scores; longer
# prefill pieces are processed this many query rows at a time to bound memory.
_ATTN_QUERY_CHUNK = 512
# Decode rows attended together are padded to their group's longest sequence; a
# group's longest is at most this many times its shortest (plus one block).
_DECODE_GROUP_GROWTH = 1.5


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; negative slots are skipped."""
    checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    check_largest_slot(int(slots.max()), k_cache)
    # [num_blocks * block_size, num_kv_heads, head_dim] views share storage with the caches.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def check_largest_slot(largest: int, k_cache: torch.Tensor) -> None:
    """Refuses a slot mapping whose largest slot lies past the cache, before
    anything is written (a value check, so not in :mod:`.checks`)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if largest >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {largest}, but the cache has only {num_slots} slots"
        )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened mixed batch over a paged KV cache.

    Query row ``i`` of sequence ``s`` sits at absolute position
    ``p = seq_lens[s] - q_len + i`` and attends to KV positions ``0..p``, or with a
    sliding ``window`` to ``p - window + 1..p`` only; the blocks wholly before
    that are never read (the scheduler may have handed them on). ``soft_cap``
    caps each scaled score as ``soft_cap * tanh(score / soft_cap)`` before the
    softmax (Gemma 2). ``max_query_len`` / ``max_seq_len`` are the Triton
    backend's kernel-choice hints; this one reads the lengths themselves.
    """
    checks.check_paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, soft_cap
    )
    pieces = split_pieces(query.shape[0], k_cache.shape[1], block_tables, seq_lens,
                          query_start_loc)  # fmt: skip
    out = attend_long_pieces(query, k_cache, v_cache, block_tables, pieces, scale,
                             window, soft_cap)  # fmt: skip
    if pieces.together:
        _attend_decodes(query, k_cache, v_cache, block_tables, pieces, scale, out,
                        window, soft_cap)  # fmt: skip
    return out


def _capped(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """``soft_cap * tanh(scores / soft_cap)``, as Gemma 2 bounds its attention scores;
    in place (the scores are the caller's own fresh tensor): at a 512-row piece they
    are megabytes, and each extra pass over them shows."""
    if soft_cap is None:
        return scores
    return scores.div_(soft_cap).tanh_().mul_(soft_cap)


@dataclass(frozen=True)
class Pieces:
    """How a batch's query rows split into sequences, checked: ``starts`` and
    ``lens`` are ``query_start_loc`` and ``seq_lens`` as lists; ``long`` the
    sequences :func:`attend_long_pieces` attends; ``together`` those a row kernel
    attends at once: every one-row (decode) sequence, and every piece of at most
    ``short_work`` query rows × positions."""

    starts: list[int]
    lens: list[int]
    long: list[int]
    together: list[int]


def split_pieces(
    num_tokens: int,
    block_size: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    short_work: int = 0,
) -> Pieces:
    """Reads the batch's lengths once and checks them against each other."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to num_tokens={num_tokens}, "
            f"got {starts[0]}..{starts[-1]}"
        )
    long, together = [], []
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing (sequence {s})")
        if q_len == 0:
            continue
        if seq_len < q_len:
            raise ValueError(f"seq_lens[{s}]={seq_len} is shorter than its {q_len} query rows")
        num_blocks = blocks_for(seq_len, block_size)
        if num_blocks > block_tables.shape[1]:
            raise ValueError(
                f"seq_lens[{s}]={seq_len} needs {num_blocks} blocks, but block_tables "
                f"has {block_tables.shape[1]} columns"
            )
        (together if q_len == 1 or q_len * seq_len <= short_work else long).append(s)
    return Pieces(starts, lens, long, together)


def attend_long_pieces(query, k_cache, v_cache, block_tables, pieces: Pieces, scale,
                       window=None, soft_cap=None):  # fmt: skip
    """A zeroed output with the rows of ``pieces.long`` attended, each piece by
    matrix products over its gathered blocks, ``_ATTN_QUERY_CHUNK`` rows at a time.
    With a window, a piece's gather starts at the first block its first row reads."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for s in pieces.long:
        q_begin, q_end, seq_len = pieces.starts[s], pieces.starts[s + 1], pieces.lens[s]
        q_len = q_end - q_begin
        context_len = seq_len - q_len
        first = blocks_before_window(context_len, window, block_size)
        blocks = block_tables[s, first : blocks_for(seq_len, block_size)].long()
        kv_begin = first * block_size  # position of the first gathered slot
        kv_len = seq_len - kv_begin
        # Gather the blocks read into contiguous [kv_heads, kv_len, head_dim].
        k = _gather_blocks(k_cache, blocks).view(-1, num_kv_heads, head_dim)[:kv_len]
        v = _gather_blocks(v_cache, blocks).view(-1, num_kv_heads, head_dim)[:kv_len]
        k = k.float().transpose(0, 1)
        v = v.float().transpose(0, 1)
        kv_pos = torch.arange(kv_begin, seq_len, device=query.device)
        for c0 in range(0, q_len, _ATTN_QUERY_CHUNK):
            c1 = min(c0 + _ATTN_QUERY_CHUNK, q_len)
            rows = c1 - c0
            # [rows, num_heads, D] -> [kv_heads, group * rows, D]; row-major over
            # (group member, query row) so each kv head serves its whole group.
            q = query[q_begin + c0 : q_begin + c1].float()
            q = q.view(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            q = q.reshape(num_kv_heads, group * rows, head_dim)
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [kv_heads, group*rows, L]
            scores = _capped(scores, soft_cap)
            q_pos = context_len + torch.arange(c0, c1, device=query.device)
            visible = kv_pos[None, :] <= q_pos[:, None]  # [rows, L]
            if window is not None:
                visible &= kv_pos[None, :] > q_pos[:, None] - window
            scores = scores.view(num_kv_heads, group, rows, kv_len)
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * rows, kv_len)
            o = torch.matmul(probs, v)  # [kv_heads, group * rows, D]
            o = o.view(num_kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
            out[q_begin + c0 : q_begin + c1] = o.reshape(rows, num_heads, head_dim).to(out.dtype)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache blocks ``blocks`` (int64) as one contiguous tensor. Selecting rows of a
    2-D view copies a whole block at a time, several times faster than indexing the
    4-D cache."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def _attend_decodes(query, k_cache, v_cache, block_tables, pieces: Pieces, scale, out,
                    window=None, soft_cap=None):  # fmt: skip
    """One query row per sequence, many sequences per matmul. Each row reads from
    its first block in reach (block 0 without a window); sequences are sorted by
    how much they read and cut into groups whose longest is at most
    ``_DECODE_GROUP_GROWTH`` times their shortest (plus a block), so padding every
    member to its group's longest copies little more KV than the members own."""
    block_size = k_cache.shape[1]
    lens = pieces.lens
    first = {s: blocks_before_window(lens[s] - 1, window, block_size) for s in pieces.together}
    read = {s: lens[s] - first[s] * block_size for s in pieces.together}
    group: list[int] = []
    for s in sorted(pieces.together, key=read.__getitem__):
        if group and read[s] > _DECODE_GROUP_GROWTH * read[group[0]] + block_size:
            _attend_decode_group(query, k_cache, v_cache, block_tables, group, first, pieces,
                                 scale, out, window, soft_cap)  # fmt: skip
            group = []
        group.append(s)
    _attend_decode_group(query, k_cache, v_cache, block_tables, group, first, pieces, scale, out,
                         window, soft_cap)  # fmt: skip


def _attend_decode_group(query, k_cache, v_cache, block_tables, seqs, first, pieces, scale, out,
                         window, soft_cap):  # fmt: skip
    """The blocks every sequence in ``seqs`` reads gathered into one padded
    [seqs, length, kv_heads, head_dim] tensor, sequence ``s``'s from its block
    ``first[s]`` on; slots past each sequence's length, or before its window,
    masked out. Each kv head is one strided batched matmul over the gathered
    layout, with no transposed copy."""
    _, num_heads, head_dim = query.shape
    num_cache_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dev = query.device
    n = len(seqs)
    lens = pieces.lens
    num_blocks = max(blocks_for(lens[s], block_size) - first[s] for s in seqs)
    length = num_blocks * block_size
    firsts = torch.tensor([first[s] for s in seqs], device=dev)
    columns = (firsts[:, None] + torch.arange(num_blocks, device=dev)[None, :]).clamp(
        max=block_tables.shape[1] - 1
    )
    blocks = block_tables[torch.tensor(seqs, device=dev)[:, None], columns].long()
    # Columns past a sequence's own blocks may hold anything; they are masked below
    # and clamped here so the gather stays inside the cache.
    blocks = blocks.clamp(0, num_cache_blocks - 1).reshape(-1)
    shape = (n, length, num_kv_heads, head_dim)
    k = _gather_blocks(k_cache, blocks).view(shape).float()
    v = _gather_blocks(v_cache, blocks).view(shape).float()
    rows = torch.tensor([pieces.starts[s] for s in seqs], device=dev)
    q = query.index_select(0, rows).float().view(n, num_kv_heads, group, head_dim)
    seq_lens = torch.tensor([lens[s] for s in seqs], device=dev)
    # [n, length] absolute position of each gathered slot
    kv_pos = firsts[:, None] * block_size + torch.arange(length, device=dev)[None, :]
    hidden = kv_pos >= seq_lens[:, None]
    if window is not None:
        hidden |= kv_pos <= seq_lens[:, None] - 1 - window
    hidden = hidden[:, None, :]  # [n, 1, length]
    o = torch.empty(n, num_kv_heads, group, head_dim, device=dev)
    for h in range(num_kv_heads):
        scores = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) * scale  # [n, group, L]
        probs = torch.softmax(_capped(scores, soft_cap).masked_fill_(hidden, float("-inf")), -1)
        o[:, h] = torch.bmm(probs, v[:, :, h])  # [n, group, D]
    out[rows] = o.view(n, num_heads, head_dim).to(out.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Llama RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``.

    Numerics follow Hugging Face's LlamaRMSNorm: normalise in fp32, cast to the
    input dtype, then multiply by the weight.
    """
    checks.check_rms_norm(x, weight, eps, residual)
    dtype = x.dtype
    if residual is not None:
        x = x + residual
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    out = (weight * h.to(dtype)).to(dtype)
    if residual is not None:
        return out, x
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate_half) rotary embedding; returns new tensors."""
    checks.check_rotary_embedding(positions, query, key, cos_sin_cache)
    half = query.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half]  # [num_tokens, 1, half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def rotary_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary_embedding` of ``query`` and ``key``, then :func:`store_kv` of
    the rotated key and ``value``: what an attention layer does with a step's new
    rows before it attends. Returns the rotated query (a new tensor)."""
    return rotary_then_store(rotary_embedding, store_kv)(
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def rotary_then_store(rotary, store):
    """A ``rotary_store_kv`` made of a backend's two ops, one after the other."""

    def rotary_store_kv(positions, query, key, value, cos_sin_cache, k_cache, v_cache,
                        slot_mapping):  # fmt: skip
        query, key = rotary(positions, query, key, cos_sin_cache)
        store(key, value, k_cache, v_cache, slot_mapping)
        return query

    return rotary_store_kv


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, k_cache: torch.Tensor):
    """``qkv`` (``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``, one
    product's rows; ``head_dim`` the cache's) as views of its query, key and value
    heads. The shapes are tested first and checked in full only where that fails,
    so that the common call (once a layer) pays a few comparisons."""
    if not (
        isinstance(qkv, torch.Tensor) and isinstance(k_cache, torch.Tensor)
        and qkv.dim() == 2 and k_cache.dim() == 4
        and type(num_heads) is int and type(num_kv_heads) is int
        and num_heads > 0 and num_kv_heads > 0
        and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * k_cache.shape[3]
    ):  # fmt: skip
        checks.check_tensor("k_cache", k_cache, ndim=4)
        checks.check_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[3])
    n, head_dim = qkv.shape[0], k_cache.shape[3]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(n, num_heads, head_dim), k.reshape(n, num_kv_heads, head_dim),
            v.reshape(n, num_kv_heads, head_dim))  # fmt: skip


def rotary_store_then_attend(rotary_store, attend):
    """A ``rotary_store_attend`` made of a backend's ``rotary_store_kv`` and
    ``paged_attention``, one after the other."""

    def rotary_store_attend(positions, qkv, num_heads, num_kv_heads, cos_sin_cache, k_cache,
                            v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                            *, max_query_len=None, max_seq_len=None, window=None,
                            soft_cap=None):  # fmt: skip
        """What an attention layer does between its two products: ``qkv`` split
        into heads (:func:`split_qkv`), ``rotary_store_kv``, then
        ``paged_attention`` (its keyword arguments as there). Returns
        ``[num_tokens, num_heads * head_dim]``, the output projection's input."""
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache)
        q = rotary_store(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
        out = attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                     max_query_len=max_query_len, max_seq_len=max_seq_len, window=window,
                     soft_cap=soft_cap)  # fmt: skip
        return out.reshape(q.shape[0], -1)

    return rotary_store_attend


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` computed in fp32, returned in x's dtype."""
    checks.check_silu_mul(x)
    d = x.shape[1] // 2
    xf = x.float()
    # In place on silu's own output: one tensor fewer per call, the same values.
    return torch.nn.functional.silu(xf[:, :d]).mul_(xf[:, d:]).to(x.dtype)


def silu_mul_in_dtype(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` in the tensor's dtype, as Hugging Face's MLPs compute it
    there: the SiLU rounded, then the product rounded (fp32: the same values)."""
    checks.check_silu_mul(x)
    d = x.shape[1] // 2
    return torch.nn.functional.silu(x[:, :d]).mul_(x[:, d:])


def gelu_tanh_mul_in_dtype(x: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_tanh_mul` in the tensor's dtype, as Hugging Face's Gemma MLP
    computes it there (fp32: the same values)."""
    checks.check_silu_mul(x)
    d = x.shape[1] // 2
    return torch.nn.functional.gelu(x[:, :d], approximate="tanh").mul_(x[:, d:])


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :d]) * x[:, d:]`` with GELU's tanh approximation (Gemma's
    ``gelu_pytorch_tanh``), computed in fp32, returned in x's dtype."""
    checks.check_silu_mul(x)
    d = x.shape[1] // 2
    xf = x.float()
    return torch.nn.functional.gelu(xf[:, :d], approximate="tanh").mul_(xf[:, d:]).to(x.dtype)


# The reference's own: its rotary_store_kv, then its paged_attention.
rotary_store_attend = rotary_store_then_attend(rotary_store_kv, paged_attention)
