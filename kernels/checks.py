"""Argument checks shared by the torch references and the Triton wrappers.

Both backends run exactly the same checks, so a call that is accepted on CPU is
accepted on GPU and vice versa. Every failure raises ``ValueError`` naming the
offending argument. The checks only look at metadata (shape, dtype, device,
strides); none of them reads tensor values, so they never synchronise a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it (typed) for convenience."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {t.stride()})")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name} has size {t.shape[dim]} in dimension {dim} ({what}), expected {expected}"
        )


def _check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} (same as {ref_name})"
        )


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {ref.dtype} (same as {ref_name})")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """Compiled Triton kernels need CUDA tensors; the interpreter also takes CPU ones."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name} is on {t.device}; the triton backend needs CUDA tensors "
            "(or TRITON_INTERPRET=1 for CPU tensors)"
        )


# --------------------------------------------------------------------------- ops


def check_store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    key = check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = key.device
    value = check_tensor(
        "value", value, ndim=3, dtypes=FLOAT_DTYPES, device=dev, last_dim_contiguous=True
    )
    k_cache = check_tensor(
        "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev, contiguous=True
    )
    v_cache = check_tensor(
        "v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev, contiguous=True
    )
    slot_mapping = check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev, contiguous=True
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_same_shape("value", value, "key", key)
    check_dim("k_cache", k_cache, 2, num_kv_heads, "num_kv_heads, as in key")
    check_dim("k_cache", k_cache, 3, head_dim, "head_dim, as in key")
    _check_same_shape("v_cache", v_cache, "k_cache", k_cache)
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "num_tokens of key")
    check_same_dtype("value", value, "key", key)
    check_same_dtype("k_cache", k_cache, "key", key)
    check_same_dtype("v_cache", v_cache, "key", key)


def check_paged_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
    window=None, soft_cap=None,
) -> None:  # fmt: skip
    """:func:`check_attention_call`, then the batch's metadata (:func:`check_batch`)."""
    check_attention_call(query, k_cache, v_cache, scale, window, soft_cap)
    check_batch(block_tables, seq_lens, query_start_loc, query.device)


def check_batch(block_tables, seq_lens, query_start_loc, device) -> None:
    """A step's metadata: each sequence's block table, length and first query row."""
    block_tables = check_tensor(
        "block_tables",
        block_tables,
        ndim=2,
        dtypes=INDEX_DTYPES,
        device=device,
        last_dim_contiguous=True,
    )
    seq_lens = check_tensor(
        "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device, contiguous=True
    )
    query_start_loc = check_tensor(
        "query_start_loc",
        query_start_loc,
        ndim=1,
        dtypes=INDEX_DTYPES,
        device=device,
        contiguous=True,
    )
    num_seqs = seq_lens.shape[0]
    check_dim("query_start_loc", query_start_loc, 0, num_seqs + 1, "num_seqs + 1, from seq_lens")
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs, from seq_lens")


def check_attention_call(query, k_cache, v_cache, scale, window=None, soft_cap=None) -> None:
    """What one layer's attention call brings: the query, its caches and its
    scale, window and cap (a step's metadata are checked once, when the step's
    plan is built)."""
    query = check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = query.device
    k_cache = check_tensor(
        "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev, contiguous=True
    )
    v_cache = check_tensor(
        "v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev, contiguous=True
    )
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_dim("k_cache", k_cache, 3, head_dim, "head_dim, as in query")
    _check_same_shape("v_cache", v_cache, "k_cache", k_cache)
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads, which is not a multiple of the "
            f"{num_kv_heads} kv heads of k_cache"
        )
    check_same_dtype("k_cache", k_cache, "query", query)
    check_same_dtype("v_cache", v_cache, "query", query)
    check_attention_options(scale, window, soft_cap)


def check_attention_options(scale, window=None, soft_cap=None) -> None:
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):  # fmt: skip
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive number, got {soft_cap!r}")


def check_rms_norm(x, weight, eps, residual) -> None:
    x = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    weight = check_tensor(
        "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True
    )
    check_dim("weight", weight, 0, x.shape[1], "hidden size of x")
    if residual is not None:
        residual = check_tensor(
            "residual", residual, ndim=2, device=x.device, last_dim_contiguous=True
        )
        _check_same_shape("residual", residual, "x", x)
        check_same_dtype("residual", residual, "x", x)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def check_rotary_embedding(positions, query, key, cos_sin_cache) -> None:
    positions = check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    dev = positions.device
    query = check_tensor(
        "query", query, ndim=3, dtypes=FLOAT_DTYPES, device=dev, last_dim_contiguous=True
    )
    key = check_tensor(
        "key", key, ndim=3, dtypes=FLOAT_DTYPES, device=dev, last_dim_contiguous=True
    )
    cos_sin_cache = check_tensor(
        "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev, contiguous=True
    )
    num_tokens = positions.shape[0]
    check_dim("query", query, 0, num_tokens, "num_tokens of positions")
    check_dim("key", key, 0, num_tokens, "num_tokens of positions")
    head_dim = query.shape[2]
    check_dim("key", key, 2, head_dim, "head_dim, as in query")
    check_same_dtype("key", key, "query", query)
    if head_dim % 2 != 0:
        raise ValueError(f"query head_dim must be even, got {head_dim}")
    check_dim(
        "cos_sin_cache", cos_sin_cache, 1, head_dim, "rot_dim, must equal the head_dim of query"
    )


def check_qkv(qkv, num_heads, num_kv_heads, head_dim) -> None:
    """``qkv``: one product's rows of ``num_heads`` query heads, then
    ``num_kv_heads`` key and as many value heads, of ``head_dim`` values each."""
    qkv = check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    check_dim("qkv", qkv, 1, width, "(num_heads + 2 * num_kv_heads) * head_dim")


def check_silu_mul(x) -> None:
    x = check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x must have an even last dimension (2 * d), got {x.shape[1]}")
