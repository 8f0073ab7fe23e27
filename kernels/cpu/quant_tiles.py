"""Vector tiles of the quantized products (:mod:`.amx_quant`), written as LLVM IR.

numba's loops left these passes scalar: its ``max`` reduction does not vectorize
(a row's largest magnitude took ~1 ns an element), and loops over slices of the
packed weights' panels did not either. Each tile here handles 16 lanes a step:

- :func:`absmax_tile`: the largest ``|x|`` of a row (bf16 bits or fp32);
- :func:`quantize_tile`: ``rint(x / scale) + zero`` saturated to int8 (a row's
  per-token quantization);
- :func:`int8_outputs_tile`: a panel row's int32 sums as outputs,
  ``(sum - zero * colsum) * scale * col_scale + bias``, rounded to the output's dtype;
- :func:`f32_outputs_tile`: fp32 sums plus bias, rounded (the widened products');
- :func:`widen4_tile`, :func:`widen8_tile`: 64 bytes of packed weight values as bf16
  bits, ``(value - zero) * scale`` a lane, rounded to nearest even. 8-bit values are
  integers or fp8 (``e4m3``, ``e5m2``), which widen exactly with integer
  operations and one multiply by a power of two (no table): an e4m3 byte's
  seven low bits moved to an fp32's exponent and fraction (``<< 20``) are its
  magnitude times 2^-120, subnormals included; e5m2's (``<< 21``) times 2^-112.

Indices are counted in elements of each array's memory, as in :mod:`.tiles`.
"""

from __future__ import annotations

import functools

from .jit import numba

if numba is not None:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from .tiles import _V16F, _V16H, _V16I, _i64, _load, _rounded_bits, _splat, _store, _widen

    _I8 = ir.IntType(8)
    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _V16B = ir.VectorType(_I8, 16)
    _F32 = ir.FloatType()

    def _call(builder, name, *values):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16F, [_V16F] * len(values)), f"{name}.v16f32"
        )
        return builder.call(fn, list(values))

    def _fconst(value):
        return ir.Constant(_V16F, [value] * 16)

    def _iconst(value):
        return ir.Constant(_V16I, [value] * 16)

    def _is_bf16(array_type) -> bool:
        return array_type.dtype == types.uint16

    def _load_f32(builder, array_type, data, index):
        """16 lanes of a bf16 (bits) or fp32 array as fp32."""
        if _is_bf16(array_type):
            return _widen(builder, _load(builder, data, index, _V16H))
        return _load(builder, data, index, _V16F)

    def _store_rounded(builder, array_type, data, index, value):
        """16 fp32 lanes stored into a bf16 (rounded) or fp32 array."""
        if _is_bf16(array_type):
            value = _rounded_bits(builder, value)
        _store(builder, data, index, value)

    def _data(context, builder, sig, args, i):
        return context.make_array(sig.args[i])(context, builder, args[i]).data

    @intrinsic
    def absmax_tile(typingctx, x, index, chunks):
        """The largest ``|x.flat[index + i]|`` for ``i`` < 16 * ``chunks`` (at least 0)."""

        def codegen(context, builder, sig, args):
            data = _data(context, builder, sig, args, 0)
            index, chunks = _i64(builder, args[1]), _i64(builder, args[2])
            top = cgutils.alloca_once_value(builder, _fconst(0.0))
            with cgutils.for_range(builder, chunks) as loop:
                at = builder.add(index, builder.mul(loop.index, _I64(16)))
                v = _call(builder, "llvm.fabs", _load_f32(builder, sig.args[0], data, at))
                builder.store(_call(builder, "llvm.maxnum", builder.load(top), v), top)
            vector = builder.load(top)
            for width in (8, 4, 2, 1):
                other = builder.shuffle_vector(
                    vector, vector, ir.Constant(_V16I, [i ^ width for i in range(16)])
                )
                vector = _call(builder, "llvm.maxnum", vector, other)
            return builder.extract_element(vector, _I32(0))

        return types.float32(x, index, chunks), codegen

    @intrinsic
    def quantize_tile(typingctx, x, index, chunks, scale, zero, out, out_index):
        """``out.flat[out_index + i]`` (int8) = ``rint(x.flat[index + i] / scale) + zero``
        saturated to [-128, 127], for ``i`` < 16 * ``chunks``: divided, not multiplied
        by a reciprocal, as the reference divides (a row's largest negative value sits
        at exactly -127.5 steps, a tie that a reciprocal's last bit would break the
        other way)."""

        def codegen(context, builder, sig, args):
            data, out = _data(context, builder, sig, args, 0), _data(context, builder, sig, args, 5)
            index, chunks, out_index = (_i64(builder, args[i]) for i in (1, 2, 6))
            scale = _splat(builder, args[3])
            zero = _splat(builder, builder.sitofp(args[4], _F32))
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                v = _load_f32(builder, sig.args[0], data, builder.add(index, j))
                q = builder.fadd(_call(builder, "llvm.rint", builder.fdiv(v, scale)), zero)
                q = _call(builder, "llvm.maxnum", q, _fconst(-128.0))
                q = _call(builder, "llvm.minnum", q, _fconst(127.0))
                _store(builder, out, builder.add(out_index, j), builder.fptosi(q, _V16B))
            return context.get_dummy_value()

        return types.void(x, index, chunks, scale, zero, out, out_index), codegen

    @intrinsic
    def int8_outputs_tile(typingctx, sums, s_index, zero, scale, col_scale, colsum, bias,
                          c_index, out, out_index, chunks):  # fmt: skip
        """``out.flat[out_index + i]`` = ``(sums[s_index + i] - zero * colsum[c_index + i])
        * scale * col_scale[c_index + i] + bias[c_index + i]``, rounded to ``out``'s
        dtype, for ``i`` < 16 * ``chunks`` (int32 sums and column sums, fp32 scales
        and bias)."""
        if (sums.dtype, colsum.dtype, col_scale.dtype, bias.dtype) != (
            types.int32,
            types.int32,
            types.float32,
            types.float32,
        ):
            return None  # the lanes are read as these types: anything else is a typing error
        signature = types.void(sums, s_index, zero, scale, col_scale, colsum, bias, c_index, out,
                               out_index, chunks)  # fmt: skip

        def codegen(context, builder, sig, args):
            s_data, cs_data, sum_data, b_data, out_data = (
                _data(context, builder, sig, args, i) for i in (0, 4, 5, 6, 8)
            )
            s_index, c_index, out_index, chunks = (_i64(builder, args[i]) for i in (1, 7, 9, 10))
            zero = builder.insert_element(ir.Constant(_V16I, None), args[2], _I32(0))
            zero = builder.shuffle_vector(zero, zero, ir.Constant(_V16I, [0] * 16))
            scale = _splat(builder, args[3])
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                c = builder.add(c_index, j)
                total = _load(builder, s_data, builder.add(s_index, j), _V16I)
                total = builder.sub(total, builder.mul(zero, _load(builder, sum_data, c, _V16I)))
                factor = builder.fmul(scale, _load(builder, cs_data, c, _V16F))
                v = builder.fmul(builder.sitofp(total, _V16F), factor)
                v = builder.fadd(v, _load(builder, b_data, c, _V16F))
                _store_rounded(builder, sig.args[8], out_data, builder.add(out_index, j), v)
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def f32_outputs_tile(typingctx, sums, s_index, bias, b_index, out, out_index, chunks):
        """``out.flat[out_index + i]`` = ``sums[s_index + i] + bias[b_index + i]``,
        rounded to ``out``'s dtype, for ``i`` < 16 * ``chunks``."""

        def codegen(context, builder, sig, args):
            s_data, b_data, out_data = (_data(context, builder, sig, args, i) for i in (0, 2, 4))
            s_index, b_index, out_index, chunks = (_i64(builder, args[i]) for i in (1, 3, 5, 6))
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                v = _load(builder, s_data, builder.add(s_index, j), _V16F)
                v = builder.fadd(v, _load(builder, b_data, builder.add(b_index, j), _V16F))
                _store_rounded(builder, sig.args[4], out_data, builder.add(out_index, j), v)
            return context.get_dummy_value()

        return types.void(sums, s_index, bias, b_index, out, out_index, chunks), codegen

    def _lanes(builder, data, lane_index):
        return _load(builder, data, lane_index, _V16F)

    def _dequant(builder, value, zero, scale):
        return _rounded_bits(builder, builder.fmul(builder.fsub(value, zero), scale))

    @intrinsic
    def widen4_tile(typingctx, values, v_index, lane_scale, lane_zero, out, out_index, rows):
        """For ``r`` < ``rows``, lane ``l`` < 64: byte ``b = values[v_index + 64 r + l]``;
        ``out[out_index + 64 r + l]`` = bf16 bits of ``((b & 15) - lane_zero[l]) *
        lane_scale[l]``, ``out[out_index + 512 + 64 r + l]`` likewise of ``b >> 4``."""

        def codegen(context, builder, sig, args):
            v_data, s_data, z_data, out_data = (
                _data(context, builder, sig, args, i) for i in (0, 2, 3, 4)
            )
            v_index, out_index, rows = (_i64(builder, args[i]) for i in (1, 5, 6))
            scales = [_lanes(builder, s_data, _I64(16 * q)) for q in range(4)]
            zeros = [_lanes(builder, z_data, _I64(16 * q)) for q in range(4)]
            with cgutils.for_range(builder, rows) as loop:
                row = builder.mul(loop.index, _I64(64))
                for q in range(4):
                    at = builder.add(row, _I64(16 * q))
                    raw = _load(builder, v_data, builder.add(v_index, at), _V16B)
                    wide = builder.zext(raw, _V16I)
                    low = builder.uitofp(builder.and_(wide, _iconst(15)), _V16F)
                    high = builder.uitofp(builder.lshr(wide, _iconst(4)), _V16F)
                    dst = builder.add(out_index, at)
                    _store(builder, out_data, dst, _dequant(builder, low, zeros[q], scales[q]))
                    _store(builder, out_data, builder.add(dst, _I64(512)),
                           _dequant(builder, high, zeros[q], scales[q]))  # fmt: skip
            return context.get_dummy_value()

        return types.void(values, v_index, lane_scale, lane_zero, out, out_index, rows), codegen

    # fp8 bytes: the shift that moves their seven low bits into an fp32's exponent
    # and fraction, and the power of two that rebiases the exponent.
    _FP8 = {"int": None, "e4m3": (20, 2.0**120), "e5m2": (21, 2.0**112)}

    @functools.cache
    def widen8(kind: str):
        """:func:`widen4_tile`'s 8-bit twin: 16 rows of 64 bytes, each byte an
        unsigned integer (``kind`` "int") or an fp8 number ("e4m3", "e5m2")."""
        fp8 = _FP8[kind]

        @intrinsic
        def widen8_tile(typingctx, values, v_index, lane_scale, lane_zero, out, out_index):
            def codegen(context, builder, sig, args):
                v_data, s_data, z_data, out_data = (
                    _data(context, builder, sig, args, i) for i in (0, 2, 3, 4)
                )
                v_index, out_index = _i64(builder, args[1]), _i64(builder, args[5])
                scales = [_lanes(builder, s_data, _I64(16 * q)) for q in range(4)]
                zeros = [_lanes(builder, z_data, _I64(16 * q)) for q in range(4)]
                with cgutils.for_range(builder, _I64(16)) as loop:
                    row = builder.mul(loop.index, _I64(64))
                    for q in range(4):
                        at = builder.add(row, _I64(16 * q))
                        wide = builder.zext(
                            _load(builder, v_data, builder.add(v_index, at), _V16B), _V16I
                        )
                        if fp8 is None:
                            value = builder.uitofp(wide, _V16F)
                        else:
                            shift, rebias = fp8
                            bits = builder.shl(builder.and_(wide, _iconst(0x7F)), _iconst(shift))
                            sign = builder.shl(builder.and_(wide, _iconst(0x80)), _iconst(24))
                            magnitude = builder.fmul(builder.bitcast(bits, _V16F),
                                                     _fconst(rebias))  # fmt: skip
                            value = builder.bitcast(
                                builder.or_(builder.bitcast(magnitude, _V16I), sign), _V16F
                            )
                        dst = builder.add(out_index, at)
                        _store(
                            builder, out_data, dst, _dequant(builder, value, zeros[q], scales[q])
                        )
                return context.get_dummy_value()

            return types.void(values, v_index, lane_scale, lane_zero, out, out_index), codegen

        return widen8_tile
