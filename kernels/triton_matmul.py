"""Matrix products of a batch-invariant engine on CUDA: one tiling for every call.

cuBLAS chooses its kernel by the product's shape, and with the kernel how each
output's sum over the reduced dimension is blocked; for few rows it splits that
sum across thread blocks (split-K). The same row then gets other low bits in a
batch of 3 than in one of 64. This kernel tiles every call alike: a program
computes a ``BLOCK_M x BLOCK_N`` tile of outputs, summing over the reduced
dimension ``BLOCK_K`` values at a time from the first, in fp32, no split, no
atomics. A tile's rows never meet (a tensor-core product keeps each row's sums
apart) and rows past the batch read zeros, so a row's outputs depend on the row
and the weight alone, wherever it sits in whatever batch
(``tests/kernels/test_kernel_invariance.py``, interpreted, fp32 and fp16).

:func:`enable` makes it the product behind ``aten::mm`` and ``aten::addmm`` on CUDA
for the whole process (what ``F.linear`` and ``torch.matmul`` of 2-D operands
run), as vLLM's batch-invariant mode does: a rank of a batch-invariant engine
(``batch_invariant``) calls it at load. :func:`linear` is the same product called
directly. The reference is ``F.linear``.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .triton_ops import device_guard
from .triton_tiles import dot_precision

# One tiling a dtype, never a function of the shape: 16-bit operands on tensor
# cores, fp32 ones in IEEE fp32 (TF32 would lose bits cuBLAS keeps) in smaller
# tiles, whose operands then fit in registers.
TILES = {2: (64, 64, 64), 4: (32, 32, 32)}  # bytes an element -> BLOCK_M, N, K


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    c_ptr,  # [M, N]
    a_ptr,  # [M, K]
    b_ptr,  # [K, N]
    bias_ptr,  # [N] (read only with HAS_BIAS)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (+ ``bias``, ``[N]``) for 2-D ``a`` ``[M, K]`` and ``b`` ``[K, N]`` of
    one floating dtype (any strides), in that dtype, summed in fp32."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"matmul: operands of {a.dtype} and {b.dtype}; one of fp32/fp16/bf16")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ValueError(f"matmul: bias of shape {tuple(bias.shape)}, expected ({b.shape[1]},)")
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = TILES[4 if a.dtype == torch.float32 else 2]
    with device_guard(a):
        _matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            out, a, b, bias if bias is not None else out, m, n, k,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=dot_precision(a.dtype),
        )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)`` for 2-D ``x`` on :func:`matmul`."""
    return matmul(x, weight.t(), bias)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and input.dim() == 1 and input.dtype == mat1.dtype:
        return matmul(mat1, mat2, input)  # F.linear's bias, added in fp32 before rounding
    product = matmul(mat1, mat2)
    return product if beta == 0 else beta * input + alpha * product


_libraries: dict[str, torch.library.Library] = {}


def enable(dispatch_key: str = "CUDA") -> None:
    """Makes :func:`matmul` the process's ``aten::mm`` and ``aten::addmm`` for tensors
    of ``dispatch_key`` (tests use "CPU" with the interpreter); once a process."""
    if dispatch_key in _libraries:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
        warnings.simplefilter("ignore", UserWarning)
        library.impl("mm", lambda a, b: matmul(a, b), dispatch_key)
        library.impl("addmm", _addmm, dispatch_key)
    _libraries[dispatch_key] = library
