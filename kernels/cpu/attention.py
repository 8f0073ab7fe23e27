"""Paged attention for CPU ranks.

The torch reference attends a batch's decode rows by gathering every sequence's
KV blocks into one padded tensor and running batched matmuls of one query row
each: the gather copies the whole KV once more than attention reads it. Here a
step's rows split in two (:mod:`.plan`, once a step):

- decode rows and short prefill pieces go to a **row kernel** (:mod:`.attention_rows`):
  each row reads its blocks where they lie in the paged cache, once and in order;
- longer pieces, whose many rows make blocked matrix products efficient, go to a
  **long-piece kernel**: in bf16 on CPUs with AMX the AMX tile kernel (:mod:`.amx`,
  all of a batch's pieces in one call, ~2x torch's), else torch's CPU flash
  attention (:func:`attend_long_pieces`: their blocks read in place where they are
  one run, else gathered once, then ``scaled_dot_product_attention``, which keeps
  K/V shared across each GQA group); under a soft cap or a window that cuts, the
  reference's products.

Which kernel runs is the dispatch table's (:mod:`.dispatch`). fp32 and bf16;
numba has no fp16, which takes the reference path. With more than one torch
thread the rows are split across numba's threads (as many as torch's). In a
batch-invariant engine (``invariant``) every piece is the row kernels' and the
rows take the threads' driver whenever there are threads, even a batch of one
row: the serial and the parallel drivers are compiled apart, and a row must not
move between them with the size of its batch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...scheduler.blocks import blocks_for
from .. import checks, reference
from . import amx as cpu_amx
from . import attention_rows, dispatch, plan
from .fastmath import as_array
from .jit import available, use_threads

# The dtypes the kernels take (a bf16 cache is read as fp32, :mod:`.fastmath`).
DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {torch.float32: dispatch.FP32, torch.bfloat16: dispatch.BF16}


def compiled(query, k_cache, v_cache) -> bool:
    """Whether the compiled kernels take these tensors."""
    return (
        available()
        and query.is_cpu
        and query.dtype == k_cache.dtype == v_cache.dtype
        and query.dtype in DTYPES
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
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
    plan: plan.BatchPlan | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """:func:`reference.paged_attention` on the compiled kernels where they take the
    tensors (fp32 or bf16 on the CPU). ``plan``: the step's (``KernelOps.prepare``),
    whose metadata were checked when it was built; without one it is built here.
    ``invariant``: the batch-invariant plan (the module's docstring)."""
    if not compiled(query, k_cache, v_cache):
        return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window=window, soft_cap=soft_cap)  # fmt: skip
    if plan is None or not plan.matches(query.shape[0], query.shape[1], k_cache.shape[1],
                                        invariant):  # fmt: skip
        checks.check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, window, soft_cap)  # fmt: skip
        plan = _build(query, k_cache, block_tables, seq_lens, query_start_loc, invariant)
    else:
        checks.check_attention_call(query, k_cache, v_cache, scale, window, soft_cap)
    out = torch.empty(query.shape, dtype=query.dtype)  # [num_tokens, num_heads, head_dim]
    attend(query, k_cache, v_cache, plan, scale, window, soft_cap, out)
    return out


def _build(query, k_cache, block_tables, seq_lens, query_start_loc, invariant=False
           ) -> plan.BatchPlan:  # fmt: skip
    return plan.build(query.shape[0], query.shape[1], k_cache.shape[1], block_tables, seq_lens,
                      query_start_loc, invariant=invariant)  # fmt: skip


def attend(query, k_cache, v_cache, batch: plan.BatchPlan, scale, window, soft_cap, out) -> None:
    """Every row of ``batch`` attended into ``out`` (``[num_tokens, num_heads,
    head_dim]``): the long pieces, then the rows."""
    name = DTYPE_NAMES[query.dtype]
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    starts = batch.row_starts(window)
    if batch.pieces.long:
        cuts = window is not None and any(batch.pieces.lens[s] > window for s in batch.pieces.long)
        kernel = dispatch.current().kernel("attention.long", name,
                                           dispatch.long_traits(head_dim, cuts, soft_cap))  # fmt: skip
        _LONG[kernel](query, k_cache, v_cache, batch, scale, window, soft_cap, out)
    if batch.rows is None:
        return
    kernel = dispatch.current().kernel(
        "attention.rows", name, dispatch.row_traits(num_heads, num_kv_heads, head_dim, block_size)
    )
    tables, table_of, lengths, rows = batch.rows
    parallel = torch.get_num_threads() > 1 and (len(rows) > 1 or batch.invariant)
    if parallel:
        use_threads(torch.get_num_threads())
    arrays = (as_array(query.contiguous()), as_array(k_cache), as_array(v_cache), tables,
              table_of, starts, lengths, rows, np.float32(scale),
              None if soft_cap is None else np.float32(soft_cap), as_array(out))  # fmt: skip
    run = attention_rows.attend_rows_parallel if parallel else attention_rows.attend_rows
    run(*arrays, None if kernel == "loops" else True, True if kernel == "amx_tiles" else None)


def _attend_long_amx(query, k_cache, v_cache, batch, scale, window, soft_cap, out):
    """The long pieces on the AMX kernel (:func:`.amx.attend_pieces`)."""
    tables, begins, q_lens, seq_lens = batch.long
    k_words = as_array(k_cache).view(np.uint32)  # pairs of bf16
    cpu_amx.attend_pieces(as_array(query), k_words, as_array(v_cache), tables, begins, q_lens,
                          seq_lens, np.float32(scale), as_array(out),
                          *cpu_amx.scratch(int(seq_lens.max()), query.shape[2]))  # fmt: skip


def _attend_long_reference(query, k_cache, v_cache, batch, scale, window, soft_cap, out):
    """The long pieces as the reference attends them (torch's flash attention takes
    neither a soft cap nor, without a mask of every row, a window)."""
    done = reference.attend_long_pieces(query, k_cache, v_cache, batch.block_tables, batch.pieces,
                                        scale, window, soft_cap)  # fmt: skip
    for s in batch.pieces.long:
        out[batch.pieces.starts[s] : batch.pieces.starts[s + 1]] = done[
            batch.pieces.starts[s] : batch.pieces.starts[s + 1]
        ]


def attend_long_pieces(query, k_cache, v_cache, batch, scale, window, soft_cap, out) -> None:
    """The rows of ``batch.pieces.long`` attended into ``out`` by torch's CPU flash
    attention. Each piece reads its K and V as ``[seq_len, kv_heads, head_dim]``: a
    view of the cache where its blocks are consecutive (the allocator hands a
    sequence consecutive blocks), else its blocks gathered (one copy of what it
    reads). Its rows see the positions up to their own: causal from the corner
    when the piece starts the sequence, else through a mask (row ``i`` of a piece
    after ``context`` cached positions sees positions ``0..context + i``)."""
    pieces, block_tables = batch.pieces, batch.block_tables
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for s in pieces.long:
        q_begin, q_end, seq_len = pieces.starts[s], pieces.starts[s + 1], pieces.lens[s]
        q_len = q_end - q_begin
        ids = block_tables[s, : blocks_for(seq_len, block_size)].tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            k = k_cache[ids[0] : ids[0] + len(ids)].reshape(-1, num_kv_heads, head_dim)
            v = v_cache[ids[0] : ids[0] + len(ids)].reshape(-1, num_kv_heads, head_dim)
        else:
            blocks = torch.tensor(ids, dtype=torch.int64)
            k = reference._gather_blocks(k_cache, blocks).view(-1, num_kv_heads, head_dim)
            v = reference._gather_blocks(v_cache, blocks).view(-1, num_kv_heads, head_dim)
        # [1, kv_heads, seq_len, head_dim] views
        k, v = k[:seq_len].transpose(0, 1)[None], v[:seq_len].transpose(0, 1)[None]
        q = query[q_begin:q_end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        context = seq_len - q_len
        mask = None
        if context:
            positions = torch.arange(seq_len)
            mask = positions[None, :] <= context + positions[:q_len, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not context, scale=scale, enable_gqa=True
        )  # [1, num_heads, q_len, head_dim]
        out[q_begin:q_end] = o[0].transpose(0, 1)


# The long-piece kernels by their names in the dispatch table.
_LONG = {"amx": _attend_long_amx, "flash": attend_long_pieces, "reference": _attend_long_reference}
