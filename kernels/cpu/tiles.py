"""Register tiles for the bf16 decode attention on CPUs with AVX-512 BF16.

The row kernel of :mod:`.cpu_attention` writes its dot products as loops that
LLVM vectorizes over one head's 64 values: each score then ends in a horizontal
sum of a vector, and each position's V row is widened to fp32 again for every
query head that reads it, with the head's accumulator going to memory and back.
At 32 decode rows over 160 positions that costs ~1.1 ms a layer on one core,
against ~0.3 ms for the same reads in vLLM's AMX kernel. The tiles here keep
the work in vector registers, written directly as LLVM IR:

- :func:`qk_tile`: the scores of one query head against 16 consecutive
  positions of one KV head. ``vdpbf16ps`` multiplies bf16 pairs and adds them
  into fp32 lanes, 32 values an instruction, one accumulator a position; the
  16 accumulators are then summed lane-wise in one transposing tree (each
  level adds two halves of two vectors), so that lane ``o`` of the result is
  position ``o``'s score. Also returns the largest of the lanes a row reads.
- :func:`pv_tile`: ``acc[g] += Σ_o w[g, o] · v[o]`` over a run of positions,
  for up to 8 query heads and 32 of the head's values: every V row is read
  and widened once for all the heads, whose accumulators stay in registers
  across the run (2 vectors a head, 16 at most).

- :func:`rows16_tile`: the same tile for 16 values. Both take bf16 or fp32
  operands and add into fp32 sums or into bf16 rows read once and rounded once:
  a LoRA product's shrink and expand (:mod:`.cpu_lora`).

- :func:`rotate_tile`: one bf16 head rotated by a position's cos/sin rows,
  16 pairs a vector, each result rounded to bf16 as torch rounds (to nearest
  even, NaN kept NaN). The loop it replaces in :mod:`.cpu_ops` ran one head of
  32 pairs at a time through strided 3-D indexing, ~1.5 ns an element at 512
  tokens.

- :func:`silu_mul_tile`, :func:`gelu_tanh_mul_tile`: a gated MLP's bf16
  activation·mul, 16 values a vector, the exponential as
  :func:`.fastmath.exp_f32`'s polynomial; SiLU's ~1.6x torch's two passes at 32
  to 512 rows of 2816 values (0.53 against 0.83 ns a value).

- :func:`square_sum_tile`, :func:`add_square_sum_tile` and
  :func:`scale_tile`: RMSNorm's two passes over a bf16 row, 16 values a
  vector, rounding where :func:`.cpu_ops.rms_norm` rounds (the residual sum,
  the normalised row, the weighted output). The numba loops ran at ~0.6 ns an
  element at 512 rows.

The tiles after :func:`pv_tile` need no bf16 instruction: any vector CPU runs
them. They round with ``vcvtneps2bf16`` where the CPU has it, else in integer
lanes, to nearest even either way (:func:`_rounded_bits`).

The products of :func:`qk_tile` are exact in fp32 (bf16 has an 8-bit
significand) and are summed in fp32, in another order than a loop would; the
weights of :func:`pv_tile` stay fp32. Both read bf16 tensors as their
``uint16`` bits (:func:`.cpu_math.as_array`), indices counted in elements over
the arrays' memory. :func:`available` tells whether the CPU runs them; numba
compiles them into the kernels that call them.
"""

from __future__ import annotations

from . import isa
from .fastmath import EXP_LN2, EXP_POLY, EXP_RANGE, LOG2_E
from .jit import numba

if numba is not None:
    from llvmlite import binding, ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

# The gated activations the MLP tiles compute, and GELU's tanh form's constants:
# z = sqrt(2 / pi) (x + 0.044715 x**3).
GATES = ("silu", "gelu_tanh")
GELU_KAPPA = 0.044715
GELU_BETA = 0.7978845608028654
# Cephes' tanhf below |z| = 0.625 (fastmath.tanh_f32's): z + z**3 P(z**2), P's
# coefficients from the highest power down.
TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
             -3.33332819422e-1)  # fmt: skip

# A score tile's positions; a PV tile's head values (two vectors of 16 lanes).
POSITIONS = 16
VALUES = 32
# The most query heads one PV tile carries (16 of a CPU's 32 vector registers).
HEADS = 8
# The most rows one :func:`rows16_tile` carries (as many as a PV tile's heads).
ROWS = HEADS


def available() -> bool:
    """Whether the kernels may use the AVX-512 BF16 instructions :func:`qk_tile` is
    made of (and the other tiles round with): :func:`.isa.level` has them."""
    return numba is not None and isa.at_least(isa.level(), "avx512_bf16")


if numba is not None:
    binding.initialize_native_asmparser()  # the inline ``vdpbf16ps`` is assembled in process
    _F32 = ir.FloatType()
    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _V16F = ir.VectorType(_F32, 16)
    _V16I = ir.VectorType(_I32, 16)
    _V16H = ir.VectorType(ir.IntType(16), 16)
    _FAST = ("fast",)

    def _i64(builder, value):
        return builder.sext(value, _I64) if value.type.width < 64 else value

    def _mask(indices):
        return ir.Constant(_V16I, list(indices))

    def _splat(builder, value):
        vector = builder.insert_element(ir.Constant(_V16F, None), value, _I32(0))
        return builder.shuffle_vector(vector, vector, _mask([0] * 16))

    def _load(builder, base, index, vector):
        """The ``vector``-typed value at element ``index`` of ``base``."""
        return builder.load(
            builder.bitcast(builder.gep(base, [index]), vector.as_pointer()), align=2
        )

    def _store(builder, base, index, value):
        """Stores the vector ``value`` at element ``index`` of ``base`` (aligned to
        one element: 4 bytes for fp32 lanes, 2 for bf16 bits)."""
        align = 4 if isinstance(value.type.element, ir.FloatType) else 2
        target = builder.bitcast(builder.gep(base, [index]), value.type.as_pointer())
        builder.store(value, target, align=align)

    def _widen(builder, bits):
        """16 bf16 (their bits) as 16 fp32: the bits become the top half, exact."""
        wide = builder.shl(builder.zext(bits, _V16I), ir.Constant(_V16I, [16] * 16))
        return builder.bitcast(wide, _V16F)

    _DPBF16 = ir.InlineAsm(
        ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]), "vdpbf16ps $2, $1, $0", "=v,v,v,0"
    )

    _HAS_BF16 = available()
    _CVT_BF16 = ir.InlineAsm(ir.FunctionType(_V16H, [_V16F]), "vcvtneps2bf16 $1, $0", "=v,v")

    def _lane_sums(builder, vectors):
        """One vector whose lane ``o`` is the sum of the lanes of ``vectors[o]`` (16
        vectors): each level pairs the vectors up and adds, for each pair, the
        lower halves of its groups to the upper halves, so that the groups halve
        in width and double in number until each lane is one sum."""
        width = 16
        while len(vectors) > 1:
            half = width // 2
            low, high = [], []
            for start in range(0, 32, width):  # the groups of both vectors of a pair
                low += range(start, start + half)
                high += range(start + half, start + width)
            vectors = [
                builder.fadd(
                    builder.shuffle_vector(a, b, _mask(low)),
                    builder.shuffle_vector(a, b, _mask(high)),
                    flags=_FAST,
                )
                for a, b in zip(vectors[0::2], vectors[1::2])
            ]
            width = half
        return vectors[0]

    def _rounded_bits(builder, vector):
        """16 fp32 as the bits of the nearest bf16: one ``vcvtneps2bf16`` on CPUs
        with AVX-512 BF16, else in integer lanes (:func:`_integer_rounded_bits`).
        The two differ only on inputs below fp32's normal range, which the
        instruction takes as zero; it made the SiLU·mul tile 1.25x and RMSNorm's
        1.3x faster."""
        if _HAS_BF16:
            return builder.call(_CVT_BF16, [vector])
        return _integer_rounded_bits(builder, vector)

    def _integer_rounded_bits(builder, vector):
        """16 fp32 as the bits of the nearest bf16 (ties to even; a NaN keeps its
        top half, quiet bit set), as :func:`.cpu_math.round_to` rounds one."""
        bits = builder.bitcast(vector, _V16I)

        def splat(value):
            return ir.Constant(_V16I, [value] * 16)

        high = builder.lshr(bits, splat(16))
        lsb = builder.and_(high, splat(1))
        rounded = builder.lshr(builder.add(builder.add(bits, splat(0x7FFF)), lsb), splat(16))
        is_nan = builder.icmp_unsigned(
            ">", builder.and_(bits, splat(0x7FFFFFFF)), splat(0x7F800000)
        )
        quiet = builder.or_(high, splat(0x40))
        return builder.trunc(builder.select(is_nan, quiet, rounded), _V16H)

    def _bf16_round_trip(builder, vector):
        """``vector`` rounded to bf16, as fp32, and its bits."""
        bits = _rounded_bits(builder, vector)
        return _widen(builder, bits), bits

    def _lane_total(builder, vector):
        for width in (8, 4, 2, 1):
            other = builder.shuffle_vector(vector, vector, _mask([i ^ width for i in range(16)]))
            vector = builder.fadd(vector, other, flags=_FAST)
        return builder.extract_element(vector, _I32(0))

    def _largest(builder, vector):
        for width in (8, 4, 2, 1):
            other = builder.shuffle_vector(vector, vector, _mask([i ^ width for i in range(16)]))
            vector = builder.select(builder.fcmp_ordered(">", vector, other), vector, other)
        return builder.extract_element(vector, _I32(0))

    @intrinsic
    def qk_tile(typingctx, q, q_index, k, k_index, k_stride, chunks, scale, scores, s_index,
                lowest, valid):  # fmt: skip
        """Writes ``scores.flat[s_index + o]`` for ``o`` < 16: ``scale`` times the
        dot product of ``q.flat[q_index:][:32 * chunks]`` with
        ``k.flat[k_index + o * k_stride:][:32 * chunks]`` (bf16 bits), and
        returns the largest of lanes ``lowest`` to ``valid - 1`` (0 <= lowest <
        valid <= 16). The other lanes are written too, from whatever their rows
        hold."""
        signature = types.float32(q, q_index, k, k_index, k_stride, chunks, scale, scores,
                                  s_index, lowest, valid)  # fmt: skip

        def codegen(context, builder, sig, args):
            q_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            k_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            s_data = context.make_array(sig.args[7])(context, builder, args[7]).data
            q_index, k_index, k_stride, chunks = (_i64(builder, args[i]) for i in (1, 3, 4, 5))
            s_index, lowest, valid = _i64(builder, args[8]), args[9], args[10]
            sums = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16))
                    for _ in range(POSITIONS)]  # fmt: skip
            with cgutils.for_range(builder, chunks) as loop:
                offset = builder.mul(loop.index, _I64(32))
                qv = _load(builder, q_data, builder.add(q_index, offset), _V16F)
                for o in range(POSITIONS):
                    row = builder.add(k_index, builder.mul(k_stride, _I64(o)))
                    kv = _load(builder, k_data, builder.add(row, offset), _V16F)
                    builder.store(builder.call(_DPBF16, [qv, kv, builder.load(sums[o])]), sums[o])
            lanes = _lane_sums(builder, [builder.load(s) for s in sums])
            lanes = builder.fmul(lanes, _splat(builder, args[6]), flags=_FAST)
            _store(builder, s_data, s_index, lanes)
            lanes_64 = ir.Constant(ir.VectorType(_I64, 16), list(range(16)))
            inside = builder.and_(
                builder.icmp_signed(">=", lanes_64, _splat_int(builder, lowest)),
                builder.icmp_signed("<", lanes_64, _splat_int(builder, valid)),
            )
            lowest = ir.Constant(_V16F, [-3.0e38] * 16)
            return _largest(builder, builder.select(inside, lanes, lowest))

        return signature, codegen

    def _splat_i32(builder, value):
        vector = builder.insert_element(ir.Constant(_V16I, None), value, _I32(0))
        return builder.shuffle_vector(vector, vector, _mask([0] * 16))

    def _splat_int(builder, value):
        value = _i64(builder, value)
        vector_type = ir.VectorType(_I64, 16)
        vector = builder.insert_element(ir.Constant(vector_type, None), value, _I32(0))
        return builder.shuffle_vector(vector, vector, _mask([0] * 16))

    def _pv_tile(heads: int, vectors: int = 2):
        @intrinsic
        def tile(typingctx, acc, acc_index, acc_stride, v, v_index, v_stride, w, w_index,
                 w_stride, count):  # fmt: skip
            signature = types.void(acc, acc_index, acc_stride, v, v_index, v_stride, w,
                                   w_index, w_stride, count)  # fmt: skip

            def codegen(context, builder, sig, args):
                acc_data = context.make_array(sig.args[0])(context, builder, args[0]).data
                v_data = context.make_array(sig.args[3])(context, builder, args[3]).data
                w_data = context.make_array(sig.args[6])(context, builder, args[6]).data
                acc_index, acc_stride, v_index, v_stride, w_index, w_stride, count = (
                    _i64(builder, args[i]) for i in (1, 2, 4, 5, 7, 8, 9)
                )
                # bf16 bits (uint16) are widened; fp32 values are read as they are.
                wide = sig.args[3].dtype == types.float32
                # A bf16 ``acc`` (its bits) is widened once and rounded once, at the end.
                acc_bits = sig.args[0].dtype == types.uint16
                places = [
                    builder.add(acc_index, builder.add(builder.mul(acc_stride, _I64(g)), _I64(16 * c)))
                    for g in range(heads)
                    for c in range(vectors)
                ]  # fmt: skip
                sums = [
                    cgutils.alloca_once_value(
                        builder,
                        _widen(builder, _load(builder, acc_data, place, _V16H))
                        if acc_bits
                        else _load(builder, acc_data, place, _V16F),
                    )
                    for place in places
                ]
                with cgutils.for_range(builder, count) as loop:
                    row = builder.add(v_index, builder.mul(loop.index, v_stride))
                    values = [
                        _load(builder, v_data, builder.add(row, _I64(16 * c)), _V16F)
                        if wide
                        else _widen(builder, _load(builder, v_data, builder.add(row, _I64(16 * c)), _V16H))
                        for c in range(vectors)
                    ]  # fmt: skip
                    for g in range(heads):
                        at = builder.add(builder.add(w_index, builder.mul(w_stride, _I64(g))),
                                         loop.index)  # fmt: skip
                        weight = _splat(builder, builder.load(builder.gep(w_data, [at])))
                        for c in range(vectors):
                            total = builder.load(sums[vectors * g + c])
                            product = builder.fmul(weight, values[c], flags=_FAST)
                            builder.store(
                                builder.fadd(total, product, flags=_FAST), sums[vectors * g + c]
                            )
                for place, total in zip(places, sums):
                    total = builder.load(total)
                    _store(builder, acc_data, place,
                           _rounded_bits(builder, total) if acc_bits else total)  # fmt: skip
                return context.get_dummy_value()

            return signature, codegen

        return tile

    @intrinsic
    def rotate_tile(typingctx, x, x_index, cos_sin, cs_index, out, out_index, chunks):
        """``out.flat[out_index:][:32 * chunks]`` = the 32 * chunks bf16 values at
        ``x.flat[x_index:]`` rotated as pairs ``(j, j + half)``, ``half = 16 *
        chunks``: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` with
        ``cos``, ``sin`` the fp32 ``cos_sin.flat[cs_index + j]`` and
        ``[cs_index + half + j]``; products and sums rounded as torch's separate
        fp32 ops round them (not fused), each result then to bf16."""
        signature = types.void(x, x_index, cos_sin, cs_index, out, out_index, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            cs_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            out_data = context.make_array(sig.args[4])(context, builder, args[4]).data
            x_index, cs_index, out_index, chunks = (_i64(builder, args[i]) for i in (1, 3, 5, 6))
            half = builder.mul(chunks, _I64(16))
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                x1 = _widen(builder, _load(builder, x_data, builder.add(x_index, j), _V16H))
                x2 = _widen(builder, _load(builder, x_data,
                                           builder.add(builder.add(x_index, half), j), _V16H))  # fmt: skip
                cos = _load(builder, cs_data, builder.add(cs_index, j), _V16F)
                sin = _load(builder, cs_data, builder.add(builder.add(cs_index, half), j), _V16F)
                first = builder.fsub(builder.fmul(x1, cos), builder.fmul(x2, sin))
                second = builder.fadd(builder.fmul(x2, cos), builder.fmul(x1, sin))
                for value, at in ((first, j), (second, builder.add(half, j))):
                    bits = _rounded_bits(builder, value)
                    _store(builder, out_data, builder.add(out_index, at), bits)
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def square_sum_tile(typingctx, x, x_index, chunks):
        """The fp32 sum of the squares of the 16 * chunks bf16 at ``x.flat[x_index:]``."""
        signature = types.float32(x, x_index, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            x_index, chunks = _i64(builder, args[1]), _i64(builder, args[2])
            total = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16))
            with cgutils.for_range(builder, chunks) as loop:
                at = builder.add(x_index, builder.mul(loop.index, _I64(16)))
                v = _widen(builder, _load(builder, x_data, at, _V16H))
                square = builder.fmul(v, v, flags=_FAST)
                builder.store(builder.fadd(builder.load(total), square, flags=_FAST), total)
            return _lane_total(builder, builder.load(total))

        return signature, codegen

    @intrinsic
    def add_square_sum_tile(typingctx, x, x_index, r, r_index, out, out_index, chunks):
        """``out.flat[out_index:][:16 * chunks]`` = the bf16 sums of ``x`` and ``r``
        there (each rounded), and the fp32 sum of their squares."""
        signature = types.float32(x, x_index, r, r_index, out, out_index, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            r_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            out_data = context.make_array(sig.args[4])(context, builder, args[4]).data
            x_index, r_index, out_index, chunks = (_i64(builder, args[i]) for i in (1, 3, 5, 6))
            total = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16))
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                a = _widen(builder, _load(builder, x_data, builder.add(x_index, j), _V16H))
                b = _widen(builder, _load(builder, r_data, builder.add(r_index, j), _V16H))
                v, bits = _bf16_round_trip(builder, builder.fadd(a, b))
                _store(builder, out_data, builder.add(out_index, j), bits)
                square = builder.fmul(v, v, flags=_FAST)
                builder.store(builder.fadd(builder.load(total), square, flags=_FAST), total)
            return _lane_total(builder, builder.load(total))

        return signature, codegen

    @intrinsic
    def scale_tile(typingctx, x, x_index, weight, inv, out, out_index, chunks):
        """``out.flat[out_index:][:16 * chunks]`` = ``weight * round(x * inv)``,
        rounded: RMSNorm's output (bf16 ``x``, ``weight`` and ``out``, fp32 ``inv``)."""
        signature = types.void(x, x_index, weight, inv, out, out_index, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            w_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            out_data = context.make_array(sig.args[4])(context, builder, args[4]).data
            x_index, out_index, chunks = (_i64(builder, args[i]) for i in (1, 5, 6))
            inv = _splat(builder, args[3])
            with cgutils.for_range(builder, chunks) as loop:
                j = builder.mul(loop.index, _I64(16))
                v = _widen(builder, _load(builder, x_data, builder.add(x_index, j), _V16H))
                normed, _ = _bf16_round_trip(builder, builder.fmul(v, inv))
                w = _widen(builder, _load(builder, w_data, j, _V16H))
                bits = _rounded_bits(builder, builder.fmul(w, normed))
                _store(builder, out_data, builder.add(out_index, j), bits)
            return context.get_dummy_value()

        return signature, codegen

    def _vector_call(builder, name, *values):
        """The LLVM intrinsic ``name`` (e.g. ``llvm.floor``) on 16 fp32 lanes."""
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16F, [_V16F] * len(values)), f"{name}.v16f32"
        )
        return builder.call(fn, list(values))

    def _exp(builder, x):
        """e**x in 16 lanes, as :func:`.cpu_math.exp_f32` computes one (its clamp,
        its split of ln 2, its polynomial), so that a tile and a loop agree."""

        def c(value):
            return ir.Constant(_V16F, [value] * 16)

        x = _vector_call(builder, "llvm.maxnum", x, c(EXP_RANGE[0]))
        x = _vector_call(builder, "llvm.minnum", x, c(EXP_RANGE[1]))
        n = _vector_call(builder, "llvm.floor", builder.fadd(builder.fmul(x, c(LOG2_E)), c(0.5)))
        r = builder.fsub(x, builder.fmul(n, c(EXP_LN2[0])))
        r = builder.fadd(r, builder.fmul(n, c(EXP_LN2[1])))
        p = c(EXP_POLY[0])
        for term in EXP_POLY[1:]:
            p = builder.fadd(builder.fmul(p, r), c(term))
        p = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
        exponent = builder.shl(
            builder.add(builder.fptosi(n, _V16I), ir.Constant(_V16I, [127] * 16)),
            ir.Constant(_V16I, [23] * 16),
        )
        return builder.fmul(p, builder.bitcast(exponent, _V16F))

    def _gelu_tanh(builder, g):
        """``g (1 + tanh(z)) / 2``, ``z = sqrt(2/pi) (g + 0.044715 g**3)``, in 16 lanes
        as torch computes it (its tanh form, so its cancellations too: 0 where
        tanh(z) is -1), tanh as :func:`.fastmath.tanh_f32` takes it (Cephes'
        ``tanhf``: an odd polynomial below |z| = 0.625, ``1 - 2 / (e**2z + 1)``
        above)."""

        def c(value):
            return ir.Constant(_V16F, [value] * 16)

        cube = builder.fmul(builder.fmul(g, g), g)
        z = builder.fmul(builder.fadd(g, builder.fmul(cube, c(GELU_KAPPA))), c(GELU_BETA))
        zz = builder.fmul(z, z)
        p = c(TANH_POLY[0])
        for term in TANH_POLY[1:]:
            p = builder.fadd(builder.fmul(p, zz), c(term))
        small = builder.fadd(builder.fmul(builder.fmul(p, zz), z), z)
        large = builder.fsub(
            c(1.0),
            builder.fdiv(c(2.0), builder.fadd(_exp(builder, builder.fmul(z, c(2.0))), c(1.0))),
        )
        tanh = builder.select(builder.fcmp_ordered("<", zz, c(0.390625)), small, large)
        return builder.fmul(builder.fmul(g, c(0.5)), builder.fadd(c(1.0), tanh))

    def _gated_mul_tile(activation: str):
        """A gated MLP's bf16 ``act(g) * u`` tile, ``act`` one of :data:`GATES`."""

        @intrinsic
        def gated_mul_tile(typingctx, x, x_index, up_index, out, out_index, chunks):
            """``out.flat[out_index:][:16 * chunks]`` = ``round(act(g)) * u``, rounded,
            for the bf16 ``g`` at ``x.flat[x_index:]`` and ``u`` at ``x.flat[up_index:]``:
            a gated MLP's activation as Hugging Face computes it in bf16 (the
            activation in fp32, rounded; the product in fp32, rounded): SiLU as
            ``g / (1 + e**-g)``, GELU's tanh form as torch writes it
            (:func:`_gelu_tanh`)."""
            signature = types.void(x, x_index, up_index, out, out_index, chunks)

            def codegen(context, builder, sig, args):
                x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
                out_data = context.make_array(sig.args[3])(context, builder, args[3]).data
                x_index, up_index, out_index, chunks = (
                    _i64(builder, args[i]) for i in (1, 2, 4, 5)
                )
                one = ir.Constant(_V16F, [1.0] * 16)
                with cgutils.for_range(builder, chunks) as loop:
                    j = builder.mul(loop.index, _I64(16))
                    g = _widen(builder, _load(builder, x_data, builder.add(x_index, j), _V16H))
                    u = _widen(builder, _load(builder, x_data, builder.add(up_index, j), _V16H))
                    if activation == "gelu_tanh":
                        act = _gelu_tanh(builder, g)
                    else:
                        act = builder.fdiv(g, builder.fadd(one, _exp(builder, builder.fneg(g))))
                    act, _ = _bf16_round_trip(builder, act)
                    bits = _rounded_bits(builder, builder.fmul(act, u))
                    _store(builder, out_data, builder.add(out_index, j), bits)
                return context.get_dummy_value()

            return signature, codegen

        return gated_mul_tile

    silu_mul_tile = _gated_mul_tile("silu")
    gelu_tanh_mul_tile = _gated_mul_tile("gelu_tanh")

    # 2**f for |f| <= 1/2: a degree-5 polynomial fitted at Chebyshev nodes (from the
    # highest power down), within 1.1e-7 of the value there (about two fp32 steps).
    _POW2_POLY = (1.3400432166e-3, 9.6760370979e-3, 5.5503272142e-2, 0.24022107356,
                  0.69314720671, 1.0000000755)  # fmt: skip
    # AVX-512F's ``vscalefps``: x * 2**floor(n), to zero below fp32's range.
    _SCALEF = ir.InlineAsm(ir.FunctionType(_V16F, [_V16F, _V16F]), "vscalefps $2, $1, $0", "=v,v,v")

    def _pow2(builder, t):
        """2**t in 16 lanes: ``t`` split into the nearest integer ``n`` and the rest
        ``f``, 2**f by :data:`_POW2_POLY` in fused multiply-adds, then scaled by
        2**n in one ``vscalefps`` (which gives 0 below fp32's range). Cheaper than
        :func:`_exp` (no clamps, no split constant, fused products) for a softmax
        whose weights are rounded to bf16. Needs AVX-512F."""

        def c(value):
            return ir.Constant(_V16F, [value] * 16)

        n = _vector_call(builder, "llvm.rint", t)
        f = builder.fsub(t, n)
        p = c(_POW2_POLY[0])
        for term in _POW2_POLY[1:]:
            p = _vector_call(builder, "llvm.fma", p, f, c(term))
        return builder.call(_SCALEF, [p, n])

    @intrinsic
    def softmax_tile(typingctx, scores, s_index, weights, w_index, seen, width, scale):
        """One attention row's softmax: for ``o`` < ``width`` (a multiple of 16),
        ``weights.flat[w_index + o]`` = ``e**(scale * (s_o - max))`` rounded to bf16
        for ``o`` < ``seen``, else 0, where ``s_o`` = ``scores.flat[s_index + o]``
        (fp32; ``max`` over the ``seen`` ones; ``scale`` > 0). Returns the sum of the
        unrounded weights. The scores past ``seen`` are read, never used."""
        signature = types.float32(scores, s_index, weights, w_index, seen, width, scale)

        def codegen(context, builder, sig, args):
            s_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            w_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            s_index, w_index, seen, width = (_i64(builder, args[i]) for i in (1, 3, 4, 5))
            whole = builder.sdiv(seen, _I64(16))  # chunks of 16 the row sees all of
            part = builder.icmp_signed("!=", builder.srem(seen, _I64(16)), _I64(0))
            lanes = ir.Constant(_V16I, list(range(16)))
            tail = builder.trunc(builder.sub(seen, builder.mul(whole, _I64(16))), _I32)
            seen_in_tail = builder.icmp_signed("<", lanes, _splat_i32(builder, tail))

            def scores_at(chunk):
                return _load(
                    builder, s_data, builder.add(s_index, builder.mul(chunk, _I64(16))), _V16F
                )

            lowest = ir.Constant(_V16F, [-3.0e38] * 16)
            top = cgutils.alloca_once_value(builder, lowest)

            def keep_larger(x):
                t = builder.load(top)
                builder.store(builder.select(builder.fcmp_ordered(">", x, t), x, t), top)

            with cgutils.for_range(builder, whole) as loop:
                keep_larger(scores_at(loop.index))
            with builder.if_then(part):
                keep_larger(builder.select(seen_in_tail, scores_at(whole), lowest))
            # e**(scale * (s - max)) as 2**(s * c - max * c), one fused multiply-add
            c = builder.fmul(args[6], ir.Constant(_F32, LOG2_E))
            scale = _splat(builder, c)
            top = _splat(
                builder, builder.fneg(builder.fmul(_largest(builder, builder.load(top)), c))
            )
            total = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16))
            zero = ir.Constant(_V16F, [0.0] * 16)

            def weigh(chunk, inside=None):
                e = _pow2(builder, _vector_call(builder, "llvm.fma", scores_at(chunk), scale, top))
                if inside is not None:
                    e = builder.select(inside, e, zero)
                builder.store(builder.fadd(builder.load(total), e, flags=_FAST), total)
                at = builder.add(w_index, builder.mul(chunk, _I64(16)))
                _store(builder, w_data, at, _rounded_bits(builder, e))

            with cgutils.for_range(builder, whole) as loop:
                weigh(loop.index)
            with builder.if_then(part):
                weigh(whole, seen_in_tail)
            written = builder.add(whole, builder.zext(part, _I64))
            zeros = ir.Constant(_V16H, [0] * 16)
            with cgutils.for_range(
                builder, builder.sub(builder.sdiv(width, _I64(16)), written)
            ) as loop:
                at = builder.add(w_index, builder.mul(builder.add(written, loop.index), _I64(16)))
                _store(builder, w_data, at, zeros)
            return _lane_total(builder, builder.load(total))

        return signature, codegen

    @intrinsic
    def divide_rows_tile(typingctx, x, x_index, x_stride, sums, rows, out, out_index, out_stride,
                         chunks):  # fmt: skip
        """For ``i`` < ``rows``: the 16 * chunks fp32 at ``x.flat[x_index + i *
        x_stride:]`` times ``1 / sums[i]``, rounded to bf16 into ``out.flat[out_index
        + i * out_stride:]``: attention's output rows divided by their weights'
        sums."""
        signature = types.void(x, x_index, x_stride, sums, rows, out, out_index, out_stride, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            sums_data = context.make_array(sig.args[3])(context, builder, args[3]).data
            out_data = context.make_array(sig.args[5])(context, builder, args[5]).data
            x_index, x_stride, rows, out_index, out_stride, chunks = (
                _i64(builder, args[i]) for i in (1, 2, 4, 6, 7, 8)
            )
            with cgutils.for_range(builder, rows) as row:
                total = builder.load(builder.gep(sums_data, [row.index]))
                inverse = _splat(builder, builder.fdiv(ir.Constant(_F32, 1.0), total))
                x_at = builder.add(x_index, builder.mul(row.index, x_stride))
                out_at = builder.add(out_index, builder.mul(row.index, out_stride))
                with cgutils.for_range(builder, chunks) as loop:
                    j = builder.mul(loop.index, _I64(16))
                    value = builder.fmul(
                        _load(builder, x_data, builder.add(x_at, j), _V16F), inverse
                    )
                    _store(builder, out_data, builder.add(out_at, j), _rounded_bits(builder, value))
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def round_rows_tile(typingctx, x, x_index, x_stride, rows, out, out_index, out_stride, chunks):
        """For ``i`` < ``rows``: the 16 * chunks fp32 at ``x.flat[x_index + i *
        x_stride:]`` rounded to bf16 into ``out.flat[out_index + i * out_stride:]``:
        a product's fp32 sums as its bf16 output."""
        signature = types.void(x, x_index, x_stride, rows, out, out_index, out_stride, chunks)

        def codegen(context, builder, sig, args):
            x_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            out_data = context.make_array(sig.args[4])(context, builder, args[4]).data
            x_index, x_stride, rows, out_index, out_stride, chunks = (
                _i64(builder, args[i]) for i in (1, 2, 3, 5, 6, 7)
            )
            with cgutils.for_range(builder, rows) as row:
                x_at = builder.add(x_index, builder.mul(row.index, x_stride))
                out_at = builder.add(out_index, builder.mul(row.index, out_stride))
                with cgutils.for_range(builder, chunks) as loop:
                    j = builder.mul(loop.index, _I64(16))
                    value = _load(builder, x_data, builder.add(x_at, j), _V16F)
                    _store(builder, out_data, builder.add(out_at, j), _rounded_bits(builder, value))
            return context.get_dummy_value()

        return signature, codegen

    def _spread_scores(group: int):
        @intrinsic
        def spread(typingctx, tile, scale, scores, s_index, width, top, top_index, lowest,
                   valid):  # fmt: skip
            """For ``g`` < ``group``, ``o`` < 16: ``scores.flat[s_index + g * width + o]``
            = ``scale * tile[o * group + g]`` (fp32), and ``top.flat[top_index + g]``
            raised to the largest of head ``g``'s lanes ``lowest..valid - 1``: a
            group's score tile, positions by heads, as rows of heads."""
            signature = types.void(tile, scale, scores, s_index, width, top, top_index, lowest,
                                   valid)  # fmt: skip

            def codegen(context, builder, sig, args):
                t_data = context.make_array(sig.args[0])(context, builder, args[0]).data
                s_data = context.make_array(sig.args[2])(context, builder, args[2]).data
                top_data = context.make_array(sig.args[5])(context, builder, args[5]).data
                s_index, width, top_index = (_i64(builder, args[i]) for i in (3, 4, 6))
                scale = _splat(builder, args[1])
                vectors = [_load(builder, t_data, _I64(16 * v), _V16F) for v in range(group)]
                while len(vectors) > 1:  # one vector of all 16 * group scores
                    size = 16 * (group // len(vectors))
                    vectors = [
                        builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * size),
                                                                 list(range(2 * size))))
                        for a, b in zip(vectors[0::2], vectors[1::2])
                    ]  # fmt: skip
                every = vectors[0]
                lanes_64 = ir.Constant(ir.VectorType(_I64, 16), list(range(16)))
                inside = builder.and_(
                    builder.icmp_signed(">=", lanes_64, _splat_int(builder, args[7])),
                    builder.icmp_signed("<", lanes_64, _splat_int(builder, args[8])),
                )
                lowest = ir.Constant(_V16F, [-3.0e38] * 16)
                for g in range(group):
                    head = every if group == 1 else builder.shuffle_vector(
                        every, every, _mask([o * group + g for o in range(16)])
                    )  # fmt: skip
                    head = builder.fmul(head, scale, flags=_FAST)
                    at = builder.add(s_index, builder.mul(width, _I64(g)))
                    _store(builder, s_data, at, head)
                    largest = _largest(builder, builder.select(inside, head, lowest))
                    place = builder.gep(top_data, [builder.add(top_index, _I64(g))])
                    old = builder.load(place)
                    builder.store(
                        builder.select(builder.fcmp_ordered(">", largest, old), largest, old),
                        place,
                    )
                return context.get_dummy_value()

            return signature, codegen

        return spread

    _s1, _s2, _s4, _s8, _s16 = (_spread_scores(g) for g in (1, 2, 4, 8, 16))

    @numba.njit(inline="always")
    def spread_scores(group, tile, scale, scores, s_index, width, top, top_index, lowest, valid):
        """A group's score tile (positions by heads, ``group`` of 1, 2, 4, 8 or 16
        heads) scaled into rows of ``scores``, ``width`` apart, and each head's
        largest valid score into ``top`` (:func:`_spread_scores`)."""
        args = (tile, scale, scores, s_index, width, top, top_index, lowest, valid)
        if group == 1:
            _s1(*args)
        elif group == 2:
            _s2(*args)
        elif group == 4:
            _s4(*args)
        elif group == 8:
            _s8(*args)
        else:
            _s16(*args)

    def _by_rows(lanes: int, what: str):
        """One entry for the 8 variants of a tile of ``lanes`` values, by its rows:
        the intrinsics are built per row count, and a kernel picks one at run time."""
        t1, t2, t3, t4, t5, t6, t7, t8 = (_pv_tile(h, lanes // 16) for h in range(1, HEADS + 1))

        @numba.njit(inline="always")
        def tile(rows, acc, acc_index, acc_stride, v, v_index, v_stride, w, w_index, w_stride,
                 count):  # fmt: skip
            args = (acc, acc_index, acc_stride, v, v_index, v_stride, w, w_index, w_stride, count)
            if rows == 1:
                t1(*args)
            elif rows == 2:
                t2(*args)
            elif rows == 3:
                t3(*args)
            elif rows == 4:
                t4(*args)
            elif rows == 5:
                t5(*args)
            elif rows == 6:
                t6(*args)
            elif rows == 7:
                t7(*args)
            else:
                t8(*args)

        tile.__doc__ = what
        return tile

    pv_tile = _by_rows(
        VALUES,
        """For ``g`` < ``rows`` (1..8) and ``d`` < 32: ``acc.flat[acc_index + g *
        acc_stride + d] += Σ_{o < count} w.flat[w_index + g * w_stride + o] *
        v.flat[v_index + o * v_stride + d]``. ``v`` as bf16 bits or fp32, ``acc``
        fp32 or bf16 bits (read once, its sums rounded once when written back);
        ``w`` fp32. The attention's PV product, and a LoRA expand (``w`` the
        shrunk rows, ``v`` B^T).""",
    )
    rows16_tile = _by_rows(
        16,
        """:func:`pv_tile` for 16 values rather than 32 (``d`` < 16): a LoRA shrink
        (``w`` the rows, ``v`` A by input). Apart from :func:`pv_tile` because
        each call site inlines every variant of the tile it names.""",
    )
