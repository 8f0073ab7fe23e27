"""Scalar helpers for the numba kernels, each a few machine instructions.

- :func:`exp_f32`: e**x in fp32 that LLVM vectorizes inside a loop. numba's
  ``math.exp`` is a call into libm per element (no vector math library ships
  with it), which a softmax over every position of a decode row pays 33 000
  times a layer at 64 rows of the demo model. This one is Cephes' ``expf``: the
  exponent split off as ``2**n`` (written straight into the float's exponent
  bits) and a degree-6 polynomial on the remainder; on [-87, 88] it agrees with
  the correctly rounded value to 6e-8 relative, as libm's does.
- :func:`tanh_f32`: tanh in fp32, vectorizable the same way (Gemma 2's soft
  cap of attention scores, :mod:`.cpu_attention`).
- :func:`prefetch_l2`: asks the core to start loading the cache line holding
  ``array.flat[index]`` into its L2, without waiting for it. A decode row reads
  its KV as 8-KiB blocks scattered over the cache; the hardware prefetcher
  starts over at every block, and one core then streams them at ~9 GB/s
  against ~28 GB/s for one contiguous run. Named a block or two ahead, the
  loads overlap (~16 GB/s measured for the same reads).

- :func:`load_f32` / :func:`round_to` / :func:`store_f32`: one kernel source for
  fp32 and bf16 tensors. numba has no bf16 type, so a bf16 tensor reaches a
  kernel as its ``uint16`` bit patterns (:func:`as_array`); these read an
  element as fp32 (the 16 bits become the top half of an fp32's, exact), round
  an fp32 to the array's precision (to nearest, ties to even, NaN kept NaN, as
  torch's ``.to(torch.bfloat16)`` does) and write it back. On an fp32 array
  they are plain reads and writes. Which one a kernel gets is decided when numba
  compiles it for the array's type, so the loops stay branch-free and vectorize
  (widening is a shift, rounding an add and a shift).

A host-side helper hands tensors to the kernels: :func:`as_array` (a bf16
tensor as its bits).

Without numba they are plain Python (``math.exp`` and a no-op), which nothing
calls: the kernels that use them run only where numba imports.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .jit import numba

if numba is not None:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload


# Cephes' ``expf`` (:func:`exp_f32`): the inputs it takes; ln 2 as ``a - b``, ``a``
# with few enough bits that its multiples are exact; the polynomial's coefficients
# from the highest power down.
EXP_RANGE = (-87.33654, 88.0)
LOG2_E = 1.4426950408889634
EXP_LN2 = (0.693359375, 2.12194440e-4)
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
            1.6666665459e-1, 5.0000001201e-1)  # fmt: skip


if numba is not None:
    _I8_PTR = ir.IntType(8).as_pointer()
    _I32 = ir.IntType(32)

    @intrinsic
    def _f32_from_bits(typingctx, bits):
        """The fp32 whose bit pattern is the int32 ``bits``."""
        signature = types.float32(types.int32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return signature, codegen

    @intrinsic
    def _bits_from_f32(typingctx, value):
        """The int32 bit pattern of the fp32 ``value``."""
        signature = types.int32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return signature, codegen

    @intrinsic
    def prefetch_l2(typingctx, array, index):
        """Starts loading the line of ``array``'s element ``index`` (counted over
        its data as laid out) into L2; no effect on results, never faults."""
        signature = types.void(array, index)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), _I8_PTR)
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_I8_PTR, _I32, _I32, _I32]),
                "llvm.prefetch.p0i8",
            )
            # read, locality 1 (prefetcht2: kept in L2, where it does not crowd
            # L1's few miss buffers), data cache
            builder.call(fn, [address, _I32(0), _I32(1), _I32(1)])
            return context.get_dummy_value()

        return signature, codegen

    @numba.njit(inline="always", fastmath=True)
    def exp_f32(x):
        """e**x for an fp32 ``x`` in [-87.3, 88] (2**-126 to 1.7e38, fp32's normal
        range); ``x`` outside it is taken as the nearer end. The constants are
        :data:`EXP_RANGE`, :data:`EXP_LN2` and :data:`EXP_POLY` (a vector tile's
        exponential reads the same, :mod:`.cpu_tiles`)."""
        x = min(max(x, np.float32(EXP_RANGE[0])), np.float32(EXP_RANGE[1]))
        n = math.floor(x * np.float32(LOG2_E) + np.float32(0.5))  # round(x/ln 2)
        # x - n ln 2, with ln 2 split in two so the product is exact
        r = x - n * np.float32(EXP_LN2[0]) + n * np.float32(EXP_LN2[1])
        p = np.float32(EXP_POLY[0])
        p = p * r + np.float32(EXP_POLY[1])
        p = p * r + np.float32(EXP_POLY[2])
        p = p * r + np.float32(EXP_POLY[3])
        p = p * r + np.float32(EXP_POLY[4])
        p = p * r + np.float32(EXP_POLY[5])
        p = p * r * r + r + np.float32(1.0)
        return p * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)

    @numba.njit(inline="always", fastmath=True)
    def tanh_f32(x):
        """tanh of an fp32 ``x``, branch-free (both halves computed, one kept), so
        that a loop of it vectorizes. Cephes' ``tanhf``: an odd polynomial below
        |x| = 0.625, where ``1 - 2 / (e**2x + 1)`` would lose digits to the
        subtraction, that formula (through :func:`exp_f32`) from there on; within
        a few fp32 steps of the correctly rounded value, ±1 where it saturates."""
        z = x * x
        small = (
            (((np.float32(-5.70498872745e-3) * z + np.float32(2.06390887954e-2)) * z
              - np.float32(5.37397155531e-2)) * z + np.float32(1.33314422036e-1)) * z
            - np.float32(3.33332819422e-1)
        ) * z * x + x  # fmt: skip
        large = np.float32(1.0) - np.float32(2.0) / (exp_f32(np.float32(2.0) * x) + np.float32(1.0))
        return small if z < np.float32(0.390625) else large  # 0.390625 = 0.625**2

else:  # pragma: no cover

    def prefetch_l2(array, index):
        return None

    exp_f32 = math.exp
    tanh_f32 = math.tanh


def as_array(tensor: torch.Tensor):
    """``tensor``'s memory as a numpy array for the kernels: fp32 as itself, bf16
    as its ``uint16`` bit patterns (which :func:`load_f32` and :func:`store_f32`
    read and write as numbers)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


def load_f32(array, index):
    """``array[index]`` as fp32 (the overloads below are what kernels run)."""
    return np.float32(array[index])


def round_to(array, x):
    """``x`` rounded to the precision of ``array``'s elements, as fp32."""
    return np.float32(x)


def store_f32(array, index, x):
    """``array[index] = x``, rounded to the array's precision."""
    array[index] = x


if numba is not None:
    _16 = np.int32(16)

    @numba.njit(inline="always", fastmath=True)
    def _bf16_bits(x):
        """The bf16 nearest to the fp32 ``x`` (ties to even), as its 16 bits in an
        int32. A NaN is told by its bits (a fastmath kernel may assume ``x == x``)
        and keeps its top half with the quiet bit set: the rounding add could
        carry its payload into infinity. Branch-free and int32 throughout (an
        untyped literal would widen the lanes to int64), so loops vectorize."""
        i32 = np.int32  # numba widens int32 arithmetic to int64 unless told each time
        bits = _bits_from_f32(np.float32(x))
        lsb = i32(i32(bits >> _16) & i32(1))
        rounded = i32(i32(i32(bits + i32(0x7FFF)) + lsb) >> _16)
        is_nan = i32(i32(bits & i32(0x7FFFFFFF)) > i32(0x7F800000))
        quiet = i32(i32(bits >> _16) | i32(0x40))
        return i32(i32(rounded + i32(is_nan * i32(quiet - rounded))) & i32(0xFFFF))

    def _is_bf16(array) -> bool:
        return isinstance(array, types.Array) and array.dtype == types.uint16

    @overload(load_f32, inline="always")
    def _load_f32(array, index):
        if _is_bf16(array):
            return lambda array, index: _f32_from_bits(np.int32(np.int32(array[index]) << _16))
        return lambda array, index: np.float32(array[index])

    @overload(round_to, inline="always")
    def _round_to(array, x):
        if _is_bf16(array):
            return lambda array, x: _f32_from_bits(np.int32(_bf16_bits(x) << _16))
        return lambda array, x: np.float32(x)

    @overload(store_f32, inline="always")
    def _store_f32(array, index, x):
        if _is_bf16(array):

            def store(array, index, x):
                array[index] = np.uint16(_bf16_bits(x))

            return store

        def store_plain(array, index, x):
            array[index] = x

        return store_plain
