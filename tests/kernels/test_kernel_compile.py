"""The Triton kernels compile for a real GPU target, even on a machine without one.

The interpreter runs kernels as Python, so it cannot catch what only the
compiler rejects (loop-carried type changes, unsupported control flow,
dot shapes). Triton compiles to a cubin without a driver, so each kernel is
compiled for sm_90 here, in a subprocess with the interpreter switched off.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from iterserve.kernels import triton_attention as A
    from iterserve.kernels import triton_cache as C
    from iterserve.kernels import triton_ops as T

    TARGET = GPUTarget("cuda", 90, 32)

    def compile_kernel(fn, types, constexprs):
        sig = {}
        for name in fn.arg_names:
            sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        kernel = triton.compile(src, target=TARGET)
        assert kernel.asm["cubin"], fn.__name__

    for dt in ("fp16", "fp32"):
        ptrs = {n: "*" + dt for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32")
        ptrs.update(scale="fp32")
        for group, block_m in ((1, 16), (8, 64)):
            compile_kernel(
                A._paged_attention_kernel,
                ptrs,
                dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, GROUP=group, BLOCK_M=block_m,
                     BLOCK_Q=block_m // group, BLOCK_N=64,
                     DOT_PRECISION="ieee" if dt == "fp32" else "tf32"),
            )
    # int64 metadata (block tables, lengths, offsets) is accepted as well
    ptrs = {n: "*fp16" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    ptrs.update(block_tables_ptr="*i64", seq_lens_ptr="*i64", query_start_loc_ptr="*i64")
    ptrs.update(scale="fp32")
    compile_kernel(
        A._paged_attention_kernel,
        ptrs,
        dict(HEAD_DIM=96, BLOCK_D=128, BLOCK_SIZE=32, GROUP=4, BLOCK_M=16, BLOCK_Q=4,
             BLOCK_N=64, DOT_PRECISION="tf32"),
    )
    f16 = "*fp16"
    compile_kernel(
        C._store_kv_kernel,
        dict(key_ptr=f16, value_ptr=f16, k_cache_ptr=f16, v_cache_ptr=f16, slot_mapping_ptr="*i64"),
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128),
    )
    for has_residual in (False, True):
        compile_kernel(
            T._rms_norm_kernel,
            dict(out_ptr=f16, residual_out_ptr=f16, x_ptr=f16, residual_ptr=f16,
                 weight_ptr=f16, eps="fp32"),
            dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=has_residual),
        )
    compile_kernel(
        T._rotary_kernel,
        dict(q_out_ptr=f16, k_out_ptr=f16, q_ptr=f16, k_ptr=f16, positions_ptr="*i64",
             cos_sin_ptr="*fp32"),
        dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64),
    )
    compile_kernel(T._silu_mul_kernel, dict(out_ptr=f16, x_ptr=f16), dict(D=11008, BLOCK=1024))
    print("compiled")
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas available to finish compilation")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled" in proc.stdout
