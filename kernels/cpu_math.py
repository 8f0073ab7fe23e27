"""Two scalar helpers for the numba kernels, each a few machine instructions.

- :func:`exp_f32`: e**x in fp32 that LLVM vectorizes inside a loop. numba's
  ``math.exp`` is a call into libm per element (no vector math library ships
  with it), which a softmax over every position of a decode row pays 33 000
  times a layer at 64 rows of the demo model. This one is Cephes' ``expf``: the
  exponent split off as ``2**n`` (written straight into the float's exponent
  bits) and a degree-6 polynomial on the remainder; on [-87, 88] it agrees with
  the correctly rounded value to 6e-8 relative, as libm's does.
- :func:`prefetch_l2`: asks the core to start loading the cache line holding
  ``array.flat[index]`` into its L2, without waiting for it. A decode row reads
  its KV as 8-KiB blocks scattered over the cache; the hardware prefetcher
  starts over at every block, and one core then streams them at ~9 GB/s
  against ~28 GB/s for one contiguous run. Named a block or two ahead, the
  loads overlap (~16 GB/s measured for the same reads).

Without numba both are plain Python (``math.exp`` and a no-op), which nothing
calls: the kernels that use them run only where numba imports.
"""

from __future__ import annotations

import math

try:
    import numba
    import numpy as np
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba is a dependency
    numba = None

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
        range); ``x`` outside it is taken as the nearer end."""
        x = min(max(x, np.float32(-87.33654)), np.float32(88.0))
        n = math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # round(x/ln 2)
        # x - n ln 2, with ln 2 split in two so the product is exact
        r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        return p * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)

else:  # pragma: no cover

    def prefetch_l2(array, index):
        return None

    exp_f32 = math.exp
