"""Paged attention memory-bandwidth benchmark (needs CUDA).

Decode attention is memory bound: every step reads each sequence's whole K/V
cache once. The figure of merit is therefore the bytes of K/V the batch needs
divided by the kernel time, to be compared with the GPU's peak HBM bandwidth.

Run directly with ``python -m iterserve.kernels.bench [--num-seqs N ...]``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..scheduler.blocks import blocks_for
from .registry import get_ops


@dataclass(frozen=True)
class AttentionBandwidth:
    num_seqs: int
    context_len: int
    query_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    backend: str
    time_ms: float  # mean per call
    kv_bytes: int  # distinct K/V bytes the batch reads
    gbytes_per_s: float  # kv_bytes / time, in 1e9 bytes per second

    def __str__(self) -> str:
        return (
            f"paged_attention[{self.backend}] seqs={self.num_seqs} ctx={self.context_len} "
            f"q_len={self.query_len} heads={self.num_heads}/{self.num_kv_heads} "
            f"head_dim={self.head_dim} block={self.block_size} {self.dtype}: "
            f"{self.time_ms:.3f} ms, {self.kv_bytes / 1e6:.1f} MB K/V, "
            f"{self.gbytes_per_s:.0f} GB/s"
        )


def bench_attention_bandwidth(
    num_seqs: int = 64,
    context_len: int = 2048,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    query_len: int = 1,
    warmup: int = 10,
    iters: int = 50,
    backend: str = "triton",
    device: torch.device | str = "cuda",
    seed: int = 0,
) -> AttentionBandwidth:
    """Time ``paged_attention`` on a uniform batch and report achieved K/V bandwidth.

    Every sequence has ``context_len`` cached positions, of which the last
    ``query_len`` are this step's query rows (1 = pure decode). Cache blocks are
    assigned in a shuffled order so reads are scattered as in a live server.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if not 1 <= query_len <= context_len:
        raise ValueError(f"query_len must be in 1..context_len, got {query_len}")
    ops = get_ops(backend, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = blocks_for(context_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(
        0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device
    )
    query = torch.randn(
        (num_seqs * query_len, num_heads, head_dim), generator=gen, device=device
    ).to(dtype)
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5)

    for _ in range(warmup):
        ops.paged_attention(*args)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        ops.paged_attention(*args)
    end.record()
    torch.cuda.synchronize(device)
    time_ms = start.elapsed_time(end) / iters

    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * k_cache.element_size()
    return AttentionBandwidth(
        num_seqs=num_seqs,
        context_len=context_len,
        query_len=query_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        backend=ops.name,
        time_ms=time_ms,
        kv_bytes=kv_bytes,
        gbytes_per_s=kv_bytes / (time_ms * 1e-3) / 1e9,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--backend", choices=["triton", "torch"], default="triton")
    a = parser.parse_args(argv)
    result = bench_attention_bandwidth(
        num_seqs=a.num_seqs,
        context_len=a.context_len,
        query_len=a.query_len,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        block_size=a.block_size,
        dtype=getattr(torch, a.dtype),
        backend=a.backend,
    )
    print(result)


if __name__ == "__main__":
    main()
