"""Which CPU kernel runs for an op: one table, read at one place per op.

Each row of :data:`TABLE` names an op, a kernel, the dtypes it computes, the least
instruction-set level it needs (:mod:`.isa`) and the traits a call must have for
it (a *shape class*: heads of whole 32-value chunks, a batch of at most 64 rows,
...). The first row that fits a call is the kernel that runs; every op's last
row fits any call of its dtypes, so a call always finds one. What earns a row
its place over the rows below it is a figure in docs/kernels.md, named in
``why``.

:class:`Dispatch` reads the table for one level; tests build one for any level
(a faked instruction set), and ``/version`` shows what it picked for the model
(:meth:`Dispatch.describe`). The ops' wrappers compute a call's traits and ask
:meth:`Dispatch.kernel`; nothing else chooses between kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import isa

FP32, BF16 = "float32", "bfloat16"
BOTH = (FP32, BF16)


@dataclass(frozen=True)
class Rule:
    op: str
    kernel: str
    dtypes: tuple[str, ...]
    level: str  # the least instruction-set level it needs
    traits: frozenset[str] = frozenset()  # what a call must have for it
    why: str = ""


def _rule(op: str, kernel: str, dtypes, level: str, traits: str = "", why: str = "") -> Rule:
    return Rule(op, kernel, tuple(dtypes), level, frozenset(traits.split()), why)


# The traits the wrappers compute (a call has the ones that hold for it):
#   tiled      blocks of a multiple of 16 slots, heads of a multiple of 32 values
#   group      1, 2, 4, 8 or 16 query heads a KV head
#   uncut      no soft cap, and no window shorter than the longest sequence
#   small      at most 64 rows, one thread, no bias, a weight the AMX kernel reads
#   few        fewer than 16 rows
#   rows16     contiguous rows of a multiple of 16 values
#   invariant  an engine that computes each row apart from its batch (batch_invariant)
#   tileable   one thread, no bias, a weight the AMX kernel reads (any number of rows)
# fmt: off
TABLE: tuple[Rule, ...] = (
    # decode rows and short prefill pieces (kernels/cpu/attention_rows.py)
    _rule("attention.rows", "amx_tiles", [BF16], "amx", "tiled group",
          "AMX decode scores: 32 rows over 160 positions 0.434 -> 0.379 ms a layer"),
    _rule("attention.rows", "tiles", [BF16], "avx512_bf16", "tiled",
          "bf16 tiles: 32 rows over ~160 positions 1.13 -> 0.52 ms a layer"),
    _rule("attention.rows", "loops", BOTH, "generic"),
    # prefill pieces too long for the row kernels (kernels/cpu/attention.py)
    _rule("attention.long", "amx", [BF16], "amx", "tiled uncut",
          "AMX prefill: a 512-token piece 1.35 against flash's 2.77 ms"),
    _rule("attention.long", "flash", BOTH, "generic", "uncut",
          "torch's flash attention: a 128-token bf16 piece 1.9 against 12.7 ms on the rows"),
    _rule("attention.long", "reference", BOTH, "generic"),
    # matrix products (kernels/cpu/linear.py; batch-invariant: kernels/cpu/fixed_rows.py)
    _rule("linear", "amx_blocks", [BF16], "amx", "invariant tileable",
          "one order of sums a row whatever the batch; 64 rows: the amx_rows kernel"),
    _rule("linear", "onednn_blocks", BOTH, "generic", "invariant",
          "oneDNN asked for 32 rows every call runs one kernel: a row's sums do not move"),
    _rule("linear", "amx_rows", [BF16], "amx", "small",
          "a 144M Llama's 32-row decode step 0.86x oneDNN's time, 64 rows 0.92x"),
    _rule("linear", "plain", [FP32], "generic", "few",
          "F.linear's dispatch is ~20 us cheaper than oneDNN's below 16 rows"),
    _rule("linear", "onednn", BOTH, "generic",
          why="packed weights: 5-20% faster at 128 rows (fp32), 1.5-2x (bf16)"),
    # quantized checkpoints' products (kernels/cpu/quant_linear.py), read once a weight
    _rule("linear.w8a8", "amx_int8", BOTH, "amx", "",
          "int8 tiles: the 144M Llama's layer products at 32 rows 0.55x bf16's time, 64 rows 0.62x"),
    _rule("linear.w8a8", "onednn_int8", BOTH, "generic", "",
          "oneDNN's int8 matmul (VNNI where present), per-row scales applied after it"),
    _rule("linear.w8a8", "reference", BOTH, "generic"),
    _rule("linear.wx", "amx_widen", [BF16], "amx", "",
          "4-bit weights widened in the product: the 144M Llama's layer at 32 rows 0.68x bf16's"),
    _rule("linear.wx", "reference", BOTH, "generic"),
    # the elementwise ops between products (kernels/cpu/norm.py, rotary.py, activation.py)
    _rule("rms_norm", "tiles", [BF16], "avx512", "rows16",
          "a 512-token prefill step's RMSNorm 14.3 -> 9.9 ms"),
    _rule("rms_norm", "loops", BOTH, "generic"),
    _rule("rotary", "tiles", [BF16], "avx512", "tiled",
          "a 512-token prefill step's rotary and KV store 13.7 -> 5.4 ms"),
    _rule("rotary", "loops", BOTH, "generic"),
    _rule("silu_mul", "tiles", [BF16], "avx512", "rows16",
          "1.6x torch's two passes at 32 to 512 rows of 2816 values"),
    _rule("silu_mul", "torch", BOTH, "generic"),
    _rule("gelu_tanh_mul", "tiles", [BF16], "avx512", "rows16",
          "2.5x torch's in-dtype ops: 32 rows of 2816 values 80 against 202 us"),
    _rule("gelu_tanh_mul", "torch", BOTH, "generic"),
)
# fmt: on

OPS = tuple(dict.fromkeys(rule.op for rule in TABLE))
# Ops a model has only when its checkpoint is quantized: described where its traits name them.
QUANTIZED_OPS = ("linear.w8a8", "linear.wx")
GROUPS = (1, 2, 4, 8, 16)  # query heads a KV head that AMX scores in one product
POSITIONS, VALUES = 16, 32  # a score tile's positions; a head's values a tile reads


def row_traits(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> frozenset:
    """The row kernels' shape class: ``tiled`` for blocks of whole score tiles and
    heads of whole 32-value chunks, ``group`` for 1, 2, 4, 8 or 16 query heads a
    KV head."""
    traits = set()
    if block_size % POSITIONS == 0 and head_dim % VALUES == 0:
        traits.add("tiled")
    if num_kv_heads and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads in GROUPS:
        traits.add("group")
    return frozenset(traits)


def long_traits(head_dim: int, window_cuts: bool, soft_cap) -> frozenset:
    """The long-piece kernels' shape class: ``tiled`` for heads of whole 32-value
    chunks, ``uncut`` without a soft cap or a window that cuts."""
    traits = set()
    if head_dim % VALUES == 0:
        traits.add("tiled")
    if not window_cuts and soft_cap is None:
        traits.add("uncut")
    return frozenset(traits)


def model_traits(num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                 block_size: int = 16, invariant: bool = False) -> dict[str, frozenset]:  # fmt: skip
    """Each op's traits for a model's typical call (a decode step on one thread,
    a layer without a window or cap), for :meth:`Dispatch.describe`; ``invariant``:
    a batch-invariant engine's."""
    return {
        "attention.rows": row_traits(num_heads, num_kv_heads, head_dim, block_size),
        "attention.long": long_traits(head_dim, False, None),
        "linear": frozenset({"small", "tileable"} | ({"invariant"} if invariant else set())),
        "rms_norm": frozenset({"rows16"} if hidden_size % 16 == 0 else ()),
        "rotary": frozenset({"tiled"} if head_dim % VALUES == 0 else ()),
        "silu_mul": frozenset({"rows16"}),
        "gelu_tanh_mul": frozenset({"rows16"}),
    }


class Dispatch:
    """The table read for one instruction-set ``level`` (default: this process's)."""

    def __init__(self, level: str | None = None):
        self.level = isa.check_level(level, "level") if level is not None else isa.level()

    @functools.cache  # noqa: B019 - a handful of (op, dtype, traits) per process
    def kernel(self, op: str, dtype: str, traits: frozenset[str] = frozenset()) -> str:
        """The kernel of ``op`` for a call in ``dtype`` ("float32" or "bfloat16") with
        ``traits``."""
        for rule in TABLE:
            if (
                rule.op == op
                and dtype in rule.dtypes
                and isa.at_least(self.level, rule.level)
                and rule.traits <= traits
            ):
                return rule.kernel
        raise KeyError(f"no CPU kernel computes {op} in {dtype}")

    def describe(self, dtype: str, traits: dict[str, frozenset[str]]) -> dict[str, str]:
        """What runs for each op in ``dtype``, given each op's typical call's traits
        (:func:`model_traits`; ops not named: none), as ``/version`` shows it; the
        quantized products only where ``traits`` names them. fp16 (which the kernels
        do not compute) shows the references."""
        if dtype not in BOTH:
            return {op: "reference" for op in OPS if op not in QUANTIZED_OPS or op in traits}
        return {op: self.kernel(op, dtype, traits.get(op, frozenset())) for op in OPS
                if op not in QUANTIZED_OPS or op in traits}  # fmt: skip


def current() -> Dispatch:
    """The table for this process's level (after any engine cap, :func:`.isa.cap`)."""
    return _for(isa.level())


@functools.cache
def _for(level: str) -> Dispatch:
    return Dispatch(level)
