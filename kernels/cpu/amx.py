"""Prefill attention in AMX tiles, for bf16 on CPUs with AMX-BF16.

Torch's CPU flash attention runs a bf16 prefill piece at 80-190 GFLOP/s on one
core (64 to 512 tokens, 16/4 heads of 64): ~100 µs for a 64-token piece, ~2.8
ms for 512, a fifth of a 512-token step's time outside the products. AMX
multiplies 16x32 by 32x16 bf16 tiles into 16x16 fp32 in one ``tdpbf16ps``; this
kernel attends a whole piece in them (:func:`attend_piece`):

- K and V are read from the paged cache through the piece's block table once a
  KV head and packed as AMX's right-hand operand wants them (``vnni`` layout:
  each 32-bit element holds two consecutive values of the reduced dimension):
  K with its rows and 32-bit pairs of values swapped (a tile is 16 positions x
  32 values of a head), V with each two consecutive positions' values
  interleaved (a tile is 32 positions x 16 values). Positions past the
  sequence's end are zeros in the packed copies.
- For each query head and block of 16 query rows: the scores of the block
  against every position its last row sees, 16 at a time (Q is read from the
  query tensor in place, the head's values in chunks of 32); then each row's
  softmax in fp32 over the positions it sees (the scores it does not see are
  left out, their weights zero), its weights rounded to bf16 as torch's flash
  attention rounds them; then the weights times V, 32 positions at a time, into
  up to four 16x16 fp32 tiles of the output, which is divided by the row's sum
  of weights (unrounded) and rounded to bf16.

The scores are exact bf16 products summed in fp32, as torch's. Heads of a
multiple of 32 values (64 and 128 in the models served). The tiles are set up
with ``ldtilecfg`` at the start of each call and released at its end; Linux
hands a process AMX's register state only once it asks (``arch_prctl``,
:func:`available` asks).
"""

from __future__ import annotations

import functools

import numpy as np

from . import isa
from .jit import jit, numba
from .tiles import divide_rows_tile, softmax_tile

if numba is not None:
    from llvmlite import binding, ir
    from numba.core import types
    from numba.extending import intrinsic

# A tile's rows, and the bytes of each (16 fp32, or 16 pairs of bf16).
ROWS = 16
ROW_BYTES = 64
# The output's tiles a pass of the weights-times-V product keeps (tmm4..tmm7).
OUT_TILES = 4


def available() -> bool:
    """Whether the kernels may use AMX-BF16 tiles: :func:`.isa.level` is ``amx``
    (the CPU has them and Linux granted this process their state)."""
    return numba is not None and isa.level() == "amx"


def tile_config() -> np.ndarray:
    """The 64 bytes ``ldtilecfg`` reads: palette 1, eight tiles of 16 rows x 64
    bytes."""
    config = np.zeros(64, dtype=np.uint8)
    config[0] = 1
    config[16:32].view(np.uint16)[:] = ROW_BYTES
    config[48:56] = ROWS
    return config


if numba is not None:
    binding.initialize_native_asmparser()  # the inline AMX instructions are assembled in process
    _I64 = ir.IntType(64)
    _BYTES = ir.IntType(8).as_pointer()
    _VOID = ir.VoidType()

    def _asm(builder, text, operands=()):
        """``text`` as inline assembly with side effects that touch memory (the
        compiler must neither drop nor move it past loads and stores)."""
        constraints = ",".join(["r"] * len(operands) + ["~{memory}"])
        kind = ir.FunctionType(_VOID, [op.type for op in operands])
        builder.call(ir.InlineAsm(kind, text, constraints, side_effect=True), list(operands))

    def _address(context, builder, array_type, array, index):
        data = context.make_array(array_type)(context, builder, array).data
        if index.type.width < 64:
            index = builder.sext(index, _I64)
        return builder.bitcast(builder.gep(data, [index]), _BYTES)

    def _stride(builder, value):
        return builder.sext(value, _I64) if value.type.width < 64 else value

    @intrinsic
    def configure_tiles(typingctx, config):
        """``ldtilecfg`` from the 64 bytes of ``config`` (:func:`tile_config`)."""

        def codegen(context, builder, sig, args):
            zero = ir.Constant(_I64, 0)
            _asm(
                builder, "ldtilecfg ($0)", [_address(context, builder, sig.args[0], args[0], zero)]
            )
            return context.get_dummy_value()

        return types.void(config), codegen

    @intrinsic
    def release_tiles(typingctx):
        """``tilerelease``: the tiles back to their initial state."""

        def codegen(context, builder, sig, args):
            _asm(builder, "tilerelease")
            return context.get_dummy_value()

        return types.void(), codegen

    def _tile_memory(text: str, what: str):
        """Intrinsics, one per tile number, of ``text`` (an instruction moving a
        tile to or from memory, ``{tile}`` its tile) at ``array``'s element
        ``index``, rows ``stride`` bytes apart."""

        @functools.cache
        def make(tile: int):
            @intrinsic
            def access(typingctx, array, index, stride):
                def codegen(context, builder, sig, args):
                    address = _address(context, builder, sig.args[0], args[0], args[1])
                    _asm(builder, text.format(tile=tile), [address, _stride(builder, args[2])])
                    return context.get_dummy_value()

                return types.void(array, index, stride), codegen

            access.__doc__ = what
            return access

        return make

    _load = _tile_memory("tileloadd ($0,$1,1), %tmm{tile}", "A tile loaded from memory.")
    _store = _tile_memory("tilestored %tmm{tile}, ($0,$1,1)", "A tile stored to memory.")

    @functools.cache
    def _zero(tile: int):
        @intrinsic
        def zero(typingctx):
            """Tile ``tile`` set to zeros."""

            def codegen(context, builder, sig, args):
                _asm(builder, f"tilezero %tmm{tile}")
                return context.get_dummy_value()

            return types.void(), codegen

        return zero

    @functools.cache
    def _product(out: int, left: int, right: int):
        @intrinsic
        def product(typingctx):
            """Tile ``out`` += tile ``left`` (16 rows x 32 bf16) times tile ``right``
            (32 x 16 bf16, pairs of rows interleaved), in fp32."""

            def codegen(context, builder, sig, args):
                _asm(builder, f"tdpbf16ps %tmm{right}, %tmm{left}, %tmm{out}")
                return context.get_dummy_value()

            return types.void(), codegen

        return product

    @functools.cache
    def _int8_product(out: int, left: int, right: int):
        @intrinsic
        def product(typingctx):
            """Tile ``out`` += tile ``left`` (16 rows x 64 int8) times tile ``right``
            (16 rows x 16 outputs x 4 int8), summed in int32."""

            def codegen(context, builder, sig, args):
                _asm(builder, f"tdpbssd %tmm{right}, %tmm{left}, %tmm{out}")
                return context.get_dummy_value()

            return types.void(), codegen

        return product

    # The tiles of the kernel below: scores (0, 4), K (1, 5), Q chunk (2); then the
    # weights (0), V (1) and the output's four (4 to 7).
    _zero_s0, _zero_s1 = _zero(0), _zero(4)
    _load_q, _load_k0, _load_k1 = _load(2), _load(1), _load(5)
    _qk0, _qk1 = _product(0, 2, 1), _product(4, 2, 5)
    _store_s0, _store_s1 = _store(0), _store(4)
    _load_w, _load_v = _load(0), _load(1)
    _zero_o0, _zero_o1, _zero_o2, _zero_o3 = _zero(4), _zero(5), _zero(6), _zero(7)
    _pv0, _pv1, _pv2, _pv3 = _product(4, 0, 1), _product(5, 0, 1), _product(6, 0, 1), _product(7, 0, 1)  # fmt: skip
    _store_o0, _store_o1, _store_o2, _store_o3 = _store(4), _store(5), _store(6), _store(7)


_jit = jit()


@_jit
def _pack(k_words, v_cache, table, seq_len, head, k_packed, v_packed):
    """One KV head's K and V as the tiles' right-hand operands. ``k_words`` is the
    K cache as 32-bit pairs ``[block, slot, kv_head, head_dim / 2]``, ``v_cache``
    the V cache's bf16 bits ``[block, slot, kv_head, head_dim]``.
    ``k_packed[b, c, r, n]`` (32-bit) is position ``16b + n``'s pair ``16c + r``;
    ``v_packed[b, t, r, 2n + i]`` (bf16) is position ``32b + 2r + i``'s value
    ``16t + n``."""
    block_size, pairs = k_words.shape[1], k_words.shape[3]
    head_dim = v_cache.shape[3]
    for b in range(k_packed.shape[0]):
        for n in range(ROWS):
            position = b * ROWS + n
            if position < seq_len:
                block, slot = table[position // block_size], position % block_size
                for p in range(pairs):
                    k_packed[b, p // ROWS, p % ROWS, n] = k_words[block, slot, head, p]
            else:
                for p in range(pairs):
                    k_packed[b, p // ROWS, p % ROWS, n] = 0
    for b in range(v_packed.shape[0]):
        for r in range(ROWS):
            for i in range(2):
                position = b * 2 * ROWS + 2 * r + i
                if position < seq_len:
                    block, slot = table[position // block_size], position % block_size
                    for d in range(head_dim):
                        v_packed[b, d // ROWS, r, 2 * (d % ROWS) + i] = v_cache[
                            block, slot, head, d
                        ]
                else:
                    for d in range(head_dim):
                        v_packed[b, d // ROWS, r, 2 * (d % ROWS) + i] = 0


@_jit
def _output_tiles(tiles, v_flat, v_at, v_tile):
    """Output tiles ``4..3 + tiles`` += the weights' tile times V's ``tiles``
    consecutive packed tiles from element ``v_at`` on (the tile numbers are
    fixed in each instruction, hence the branches)."""
    _load_v(v_flat, v_at, ROW_BYTES)
    _pv0()
    if tiles > 1:
        _load_v(v_flat, v_at + v_tile, ROW_BYTES)
        _pv1()
    if tiles > 2:
        _load_v(v_flat, v_at + 2 * v_tile, ROW_BYTES)
        _pv2()
    if tiles > 3:
        _load_v(v_flat, v_at + 3 * v_tile, ROW_BYTES)
        _pv3()


@_jit
def _zero_output(tiles):
    _zero_o0()
    if tiles > 1:
        _zero_o1()
    if tiles > 2:
        _zero_o2()
    if tiles > 3:
        _zero_o3()


@_jit
def _store_output(tiles, o_flat, o_at, o_stride):
    _store_o0(o_flat, o_at, o_stride)
    if tiles > 1:
        _store_o1(o_flat, o_at + ROWS, o_stride)
    if tiles > 2:
        _store_o2(o_flat, o_at + 2 * ROWS, o_stride)
    if tiles > 3:
        _store_o3(o_flat, o_at + 3 * ROWS, o_stride)


@_jit
def _softmax_rows(scores, weights, sums, rows, first_seen, scale, width):
    """Row ``i`` < ``rows`` of the block sees positions ``0..first_seen + i``: its
    weights are ``exp(scale * (s - max))`` rounded to bf16 there, zeros up to
    ``width``; ``sums[i]`` is the sum of the unrounded ones."""
    s_stride, w_stride = scores.shape[1], weights.shape[1]
    s_flat, w_flat = scores.reshape(-1), weights.reshape(-1)
    for i in range(ROWS):
        seen = first_seen + i + 1 if i < rows else 0
        sums[i] = softmax_tile(s_flat, i * s_stride, w_flat, i * w_stride, seen, width, scale)


@_jit
def attend_piece(query, q_begin, q_len, k_words, v_cache, table, seq_len, scale, out, config,
                 k_packed, v_packed, scores, weights, sums, q_rows, o_rows):  # fmt: skip
    """Writes ``out[q_begin:q_begin + q_len]``: the piece's query rows attended
    causally over its sequence's ``seq_len`` positions (the piece ends the
    sequence; its row ``i`` sees ``0..seq_len - q_len + i``). ``query`` and
    ``out`` are bf16 bits ``[tokens, heads, head_dim]``; ``k_words`` and
    ``v_cache`` as :func:`_pack` reads them; ``table`` the sequence's block ids.
    Scratch: ``k_packed`` and ``v_packed`` as :func:`_pack` fills them (at least
    ``ceil(seq_len / 16)`` and ``ceil(seq_len / 32)`` blocks), ``scores`` fp32
    ``[16, >= 32 * ceil(seq_len / 32)]``, ``weights`` bf16 bits of the same
    shape, ``sums`` fp32 ``[16]``, ``q_rows`` bf16 bits ``[16, 1, head_dim]`` and
    ``o_rows`` fp32 ``[16, head_dim]``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_words.shape[2]
    group = num_heads // num_kv_heads
    chunks, value_tiles = head_dim // (2 * ROWS), head_dim // ROWS
    context = seq_len - q_len
    key_blocks = (seq_len + ROWS - 1) // ROWS
    pair_blocks = (seq_len + 2 * ROWS - 1) // (2 * ROWS)
    k_tile = ROWS * ROW_BYTES // 4  # a packed K tile's 32-bit elements
    v_tile = ROWS * ROW_BYTES // 2  # a packed V tile's bf16 elements
    s_stride, w_stride = scores.shape[1] * 4, weights.shape[1] * 2
    k_packed, v_packed = k_packed[:key_blocks], v_packed[:pair_blocks]
    k_flat, v_flat = k_packed.reshape(-1), v_packed.reshape(-1)
    s_flat, w_flat, o_flat = scores.reshape(-1), weights.reshape(-1), o_rows.reshape(-1)
    out_flat = out.reshape(-1)
    configure_tiles(config)
    for kv_head in range(num_kv_heads):
        _pack(k_words, v_cache, table, seq_len, kv_head, k_packed, v_packed)
        for g in range(group):
            head = kv_head * group + g
            for first in range(0, q_len, ROWS):
                rows = min(ROWS, q_len - first)
                if rows == ROWS:  # Q read in place, rows a token's stride apart
                    q_array, q_stride = query, query.strides[0]
                    q_at = ((q_begin + first) * query.strides[0] + head * query.strides[1]) // 2
                else:  # the last rows, padded with zeros
                    q_rows[:] = 0
                    for i in range(rows):
                        q_rows[i, 0] = query[q_begin + first + i, head]
                    q_array, q_at, q_stride = q_rows, 0, head_dim * 2
                seen = context + first + rows  # the positions the block's last row sees
                blocks = (seen + ROWS - 1) // ROWS
                for b in range(0, blocks, 2):
                    _zero_s0()
                    _zero_s1()
                    for c in range(chunks):
                        _load_q(q_array, q_at + c * 2 * ROWS, q_stride)
                        _load_k0(k_flat, (b * chunks + c) * k_tile, ROW_BYTES)
                        _qk0()
                        if b + 1 < blocks:
                            _load_k1(k_flat, ((b + 1) * chunks + c) * k_tile, ROW_BYTES)
                            _qk1()
                    _store_s0(s_flat, b * ROWS, s_stride)
                    if b + 1 < blocks:
                        _store_s1(s_flat, (b + 1) * ROWS, s_stride)
                pairs = (seen + 2 * ROWS - 1) // (2 * ROWS)
                _softmax_rows(scores, weights, sums, rows, context + first, scale, pairs * 2 * ROWS)
                for t0 in range(0, value_tiles, OUT_TILES):
                    tiles = min(OUT_TILES, value_tiles - t0)
                    _zero_output(tiles)
                    for b in range(pairs):
                        _load_w(w_flat, b * 2 * ROWS, w_stride)
                        _output_tiles(tiles, v_flat, (b * value_tiles + t0) * v_tile, v_tile)
                    _store_output(tiles, o_flat, t0 * ROWS, head_dim * 4)
                divide_rows_tile(o_flat, 0, head_dim, sums, rows, out_flat,
                                 ((q_begin + first) * num_heads + head) * head_dim,
                                 num_heads * head_dim, value_tiles)  # fmt: skip
    release_tiles()


@_jit
def attend_pieces(query, k_words, v_cache, tables, begins, q_lens, seq_lens, scale, out, config,
                  k_packed, v_packed, scores, weights, sums, q_rows, o_rows):  # fmt: skip
    """:func:`attend_piece` for each piece ``p``: its rows from ``begins[p]`` on,
    ``q_lens[p]`` of them, ending a sequence of ``seq_lens[p]`` positions whose
    block ids are ``tables[p]``. The scratch as :func:`scratch` sizes it."""
    for p in range(begins.shape[0]):
        attend_piece(query, begins[p], q_lens[p], k_words, v_cache, tables[p], seq_lens[p], scale,
                     out, config, k_packed, v_packed, scores, weights, sums, q_rows, o_rows)  # fmt: skip


def scratch(longest: int, head_dim: int) -> tuple:
    """:func:`attend_piece`'s scratch for sequences of up to ``longest``
    positions and heads of ``head_dim`` values: the tile configuration, then
    ``k_packed``, ``v_packed``, ``scores``, ``weights``, ``sums``, ``q_rows``
    and ``o_rows``."""
    key_blocks = -(-longest // ROWS)
    pair_blocks = -(-longest // (2 * ROWS))
    return (
        tile_config(),
        np.empty((key_blocks, head_dim // (2 * ROWS), ROWS, ROWS), dtype=np.uint32),
        np.empty((pair_blocks, head_dim // ROWS, ROWS, 2 * ROWS), dtype=np.uint16),
        np.empty((ROWS, pair_blocks * 2 * ROWS), dtype=np.float32),
        np.empty((ROWS, pair_blocks * 2 * ROWS), dtype=np.uint16),
        np.empty(ROWS, dtype=np.float32),
        np.empty((ROWS, 1, head_dim), dtype=np.uint16),
        np.empty((ROWS, head_dim), dtype=np.float32),
    )


# Decode scores: for one query row and one KV head, the group's query heads against
# 16 positions of a cache block in one product, K read from the cache in place.
# Tiles: K (0, 16 positions x 32 values), the group's query (1, 16 pairs of values x
# the group's heads), the scores (2, 16 positions x the group's heads, fp32). The
# group sizes it takes are dispatch.GROUPS.


@_jit
def configure_group_tiles(config, group):
    """``config`` (64 bytes) set for :func:`group_scores` with ``group`` query
    heads a KV head, and loaded."""
    config[:] = 0
    config[0] = 1
    widths = config[16:32].view(np.uint16)
    widths[0] = ROW_BYTES
    widths[1] = 4 * group
    widths[2] = 4 * group
    config[48] = ROWS
    config[49] = ROWS
    config[50] = ROWS
    configure_tiles(config)


@_jit
def configure_block(config, rows0, rows1):
    """``config`` (64 bytes) set for a product's 2x2 block of tiles, and loaded:
    tiles 0-3 the block's sums, 4 and 5 its two row tiles (``rows0``, ``rows1``
    rows; 0: unused; tiles 0, 1 and 4 hold the first row tile, 2, 3 and 5 the
    second), 6 and 7 the weight's two tiles of 16 rows; every row 64 bytes (16
    fp32 or int32 sums, 16 pairs of bf16, 64 int8)."""
    for i in range(64):
        config[i] = 0
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t] = ROW_BYTES
    for t in range(6):
        rows = rows0 if t in (0, 1, 4) else rows1
        config[48 + t] = rows
        if rows == 0:
            config[16 + 2 * t] = 0
    config[48 + 6] = ROWS
    config[48 + 7] = ROWS
    configure_tiles(config)


@_jit
def pack_group_queries(q_words, row, num_kv_heads, group, packed):
    """``packed`` (32-bit) as :func:`group_scores`'s right-hand tiles for query row
    ``row`` (``q_words``: the query's bf16 pairs, ``[rows, heads, head_dim / 2]``):
    element ``((h * chunks + c) * 16 + r) * group + g`` is head ``h * group + g``'s
    pair ``16c + r``."""
    pairs = q_words.shape[2]
    chunks = pairs // ROWS
    for h in range(num_kv_heads):
        for g in range(group):
            for p in range(pairs):
                c, r = p // ROWS, p % ROWS
                packed[((h * chunks + c) * ROWS + r) * group + g] = q_words[row, h * group + g, p]


if numba is not None:
    _load_k_rows, _load_group_q = _load(0), _load(1)
    _zero_group, _group_product, _store_group = _zero(2), _product(2, 0, 1), _store(2)


@_jit
def group_scores(k_flat, k_at, k_row_bytes, packed, kv_head, chunks, group, tile):
    """``tile[o * group + g]`` = the dot product of position ``o``'s K (16 rows of
    ``k_flat`` from element ``k_at`` on, ``k_row_bytes`` apart, a head of ``32 *
    chunks`` values) with query head ``g`` of KV head ``kv_head``'s group, from
    ``packed`` (:func:`pack_group_queries`). Tiles as :func:`configure_group_tiles`
    sets them."""
    _zero_group()
    for c in range(chunks):
        _load_k_rows(k_flat, k_at + c * 2 * ROWS, k_row_bytes)
        _load_group_q(packed, ((kv_head * chunks + c) * ROWS) * group, 4 * group)
        _group_product()
    _store_group(tile, 0, 4 * group)
