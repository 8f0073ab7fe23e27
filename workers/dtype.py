"""What a rank computes in, and the other choices that change its numerics.

A configured dtype is honoured everywhere. ``auto`` picks, once at load:

- on CUDA, the checkpoint's own dtype (fp32 when it names none);
- on a CPU, by the instruction-set level (:mod:`iterserve.kernels.cpu.isa`),
  where a rule decides:

  - ``amx``: bf16. AMX multiplies bf16 tiles; a 144M-parameter Llama's decode
    products take ~0.3x their fp32 time (:func:`measure_products` here: 2.8
    against 9.0 ms a layer at 32 rows), and vLLM's CPU backend picks bf16 too;
  - ``avx512`` and below: fp32. Without a bf16 dot product oneDNN emulates bf16
    products, slower than fp32 ones (vLLM's bf16 ~2.5x slower than its fp32 on an
    AVX2 CPU), and the references convert every tensor to fp32 and back;
  - ``avx512_bf16`` without AMX: no rule holds. On an Intel Xeon of that kind our
    bf16 served 0.68x our fp32's tokens (oneDNN's bf16 products of 64 and more
    rows were the slower); on an AMD EPYC with avx512_bf16, vLLM's bf16 was 1.8x
    its fp32. So the model's own products are timed in both dtypes
    (:func:`measure_products`, a few hundred ms) and bf16 is taken only where it
    is clearly the faster (:data:`BF16_MARGIN`), so that the choice does not flip
    between restarts of the same machine;
- with the torch references or without numba: fp32.

Choices that change a rank's numerics (the dtype, which products run padded,
whether every row is computed batch-invariantly) are made once per engine by its
first rank and handed to every rank at load (:class:`RuntimeChoices`), never by
each rank's own timing: two ranks of one engine sample the same token from the
same logits only if they computed them alike. ``/version`` and the start-up line
show the level, the dtype and why.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.cpu import isa
from .config import MOE, CheckpointError, ModelConfig

if TYPE_CHECKING:
    from .quant import QuantConfig

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# bf16 is taken on a measurement only where its products take at most this share of
# fp32's time: fp32 is the exacter, so a near tie goes to it, and a tie measured on
# either side of 1.0 cannot flip the choice between restarts.
BF16_MARGIN = 0.85
# The rows the measurement multiplies: decode steps of 32 and 64 sequences, and a
# prefill step's piece.
MEASURED_ROWS = (32, 64, 128)
# Copies of the layer's weights the measurement cycles through: at least this many
# bytes of them, so that each product reads its weight from memory as in a step.
MEASURED_BYTES = 96 << 20


class DtypeError(CheckpointError):
    """A dtype this runtime does not compute in."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why: "configured", or what ``auto`` saw

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def product_shapes(config: ModelConfig, tp_size: int = 1) -> list[tuple[int, int]]:
    """The ``[out, in]`` shapes of one layer's products on one rank of ``tp_size``,
    and the LM head's: what a decode step multiplies its rows by."""
    c, hd = config, config.head_dim
    heads, kv_heads = c.num_heads // tp_size, c.num_kv_heads // tp_size
    moe = c.layers[0].mlp == MOE and c.experts is not None
    inter = (c.experts.intermediate_size if moe else c.intermediate_size) // tp_size
    return [
        ((heads + 2 * kv_heads) * hd, c.hidden_size),
        (c.hidden_size, heads * hd),
        (2 * inter, c.hidden_size),
        (c.hidden_size, inter),
        (c.vocab_size, c.hidden_size),
    ]


def measure_products(shapes: Sequence[tuple[int, int]], rows: Sequence[int] = MEASURED_ROWS,
                     rounds: int = 3) -> float:  # fmt: skip
    """How long the products of weights of ``shapes`` take in bf16 against fp32, on
    this process's kernels (``kernels.cpu.linear``: packed as the runner packs them,
    dispatched as a step dispatches them): the sum over ``rows`` of each dtype's
    median of ``rounds`` passes, each pass every copy of the weights (at least
    :data:`MEASURED_BYTES` of them) at every row count, timed by this thread's CPU
    time (other processes on the machine do not count). The ratio bf16 ÷ fp32."""
    from ..kernels.cpu.linear import linear, pack

    gen = torch.Generator().manual_seed(0)
    totals = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer_bytes = sum(o * i for o, i in shapes) * dtype.itemsize
        copies = max(1, -(-MEASURED_BYTES // layer_bytes))
        weights = []
        for _ in range(copies):
            for out_features, in_features in shapes:
                w = (torch.rand(out_features, in_features, generator=gen) - 0.5).to(dtype)
                weights.append((w, pack(w)))
        inputs = {
            (n, i): torch.rand(n, i, generator=gen).to(dtype) for n in rows for _, i in shapes
        }
        total = 0.0
        for n in rows:
            times = []
            for _ in range(rounds):
                start = time.thread_time()
                for w, packed in weights:
                    linear(inputs[n, w.shape[1]], w, None, packed)
                times.append(time.thread_time() - start)
            total += statistics.median(times)
        totals[dtype] = total
    return totals[torch.bfloat16] / totals[torch.float32]


def choose_dtype(
    dtype: str | torch.dtype,
    checkpoint_dtype: str | None,
    device: str | torch.device,
    kernel_backend: str = "auto",
    *,
    level: str | None = None,
    measure: Callable[[], float] | None = None,
) -> DtypeChoice:
    """The dtype for ``dtype`` (a name, a torch dtype or ``"auto"``) on ``device``,
    for a checkpoint saved in ``checkpoint_dtype``; see the module's docstring.
    ``level``: the engine's instruction-set level (default: this process's);
    ``measure``: the bf16 ÷ fp32 time of the model's products, asked only where no
    rule decides (:func:`measure_products` of the model's shapes)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DtypeError(f"unsupported dtype {dtype}")
        return DtypeChoice(dtype, "configured")
    if dtype != "auto":
        try:
            return DtypeChoice(DTYPES[dtype], "configured")
        except KeyError:
            raise DtypeError(
                f"unsupported dtype {dtype!r}; use auto, float32, float16 or bfloat16"
            ) from None
    if torch.device(device).type != "cpu":
        saved = DTYPES.get(str(checkpoint_dtype).removeprefix("torch."))
        if saved is None:
            return DtypeChoice(torch.float32, "auto: the checkpoint names no dtype")
        return DtypeChoice(saved, "auto: the checkpoint's dtype on an accelerator")
    if kernel_backend not in ("auto", "cpu") or not _compiled_kernels():
        return DtypeChoice(
            torch.float32, "auto: the CPU's compiled kernels are not in use (fp32 is faster)"
        )
    level = isa.level() if level is None else level
    if level == "amx":
        return DtypeChoice(torch.bfloat16, "auto: AMX multiplies bf16 tiles")
    if not isa.at_least(level, "avx512_bf16"):
        return DtypeChoice(torch.float32, f"auto: no bf16 dot product at {level}")
    if measure is None:
        return DtypeChoice(torch.float32, "auto: avx512_bf16 without AMX, nothing measured")
    ratio = measure()
    verdict = torch.bfloat16 if ratio <= BF16_MARGIN else torch.float32
    return DtypeChoice(
        verdict,
        f"auto: measured at load, this model's bf16 products take {ratio:.2f}x fp32's "
        f"(bf16 at {BF16_MARGIN} or less)",
    )


def _compiled_kernels() -> bool:
    from ..kernels.registry import numba_available

    return numba_available()


@dataclass(frozen=True)
class RuntimeChoices:
    """What changes an engine's numerics, decided once by its first rank
    (:func:`decide`) and handed to every rank at load, as a plain dict through Ray."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    dtype_reason: str
    isa: str  # the engine's instruction-set level: the lowest of its ranks'
    # ``[out, in]`` of the weights whose bf16 batches of 17-32 rows run as 33 rows
    pad_cliff: tuple[tuple[int, int], ...] = ()
    # every row computed in an order that no other row of the step changes
    # (docs/model-runtime.md, Reproducible outputs)
    batch_invariant: bool = False
    # the quantization the weights load with (workers/quant: a method, or "fp8" on a
    # dense checkpoint); None: dense
    quantization: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pads_cliff(self, shape) -> bool:
        return tuple(shape) in self.pad_cliff

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "dtype_reason": self.dtype_reason, "isa": self.isa,
                "pad_cliff": [list(s) for s in self.pad_cliff],
                "batch_invariant": self.batch_invariant,
                "quantization": self.quantization}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> RuntimeChoices:
        return cls(d["dtype"], d["dtype_reason"], d["isa"],
                   tuple(tuple(s) for s in d.get("pad_cliff", ())),
                   bool(d.get("batch_invariant", False)), d.get("quantization"))  # fmt: skip


def decide(
    config: ModelConfig,
    dtype: str,
    checkpoint_dtype: str | None,
    device: str | torch.device,
    kernel_backend: str = "auto",
    *,
    level: str | None = None,
    tp_size: int = 1,
    batch_invariant: bool = False,
    quantized: QuantConfig | None = None,
) -> RuntimeChoices:
    """The engine's :class:`RuntimeChoices` for ``config`` on this rank's hardware at
    ``level`` (the lowest of the ranks'; default this process's): its dtype
    (:func:`choose_dtype`, measuring the model's products where no rule decides)
    and, in bf16 on several threads with AMX, which weights' cliff batches run
    padded (:func:`iterserve.kernels.cpu.linear.measure_cliff`). With
    ``batch_invariant`` nothing runs padded (the products run in fixed row blocks),
    and a kernel backend that cannot compute so is refused by name. ``quantized``:
    the quantization the weights load with (:func:`.quant.resolve`'s), its method
    recorded; refused off a CPU but with the torch references (no GPU kernel
    computes it yet), and with ``batch_invariant`` unless its products compute
    each row apart from its batch (:attr:`.quant.QuantConfig.rows_apart`: W8A8
    with per-token or static activations)."""
    on_cpu = torch.device(device).type == "cpu"
    quantization = None if quantized is None else quantized.method
    if quantization is not None and not on_cpu and kernel_backend != "torch":
        raise DtypeError(f"quantization {quantization!r} on {device}: no GPU kernel computes "
                         "quantized weights yet; kernel_backend: torch runs the references")  # fmt: skip
    if batch_invariant and quantized is not None and not quantized.rows_apart:
        raise DtypeError(f"batch_invariant with quantization {quantization!r} "
                         f"({quantized.describe()}): only W8A8 products with per-token or "
                         "static activations sum each row in one order whatever the batch; "
                         "serve the dense checkpoint, or turn batch_invariant off")  # fmt: skip
    if batch_invariant:
        from ..kernels.registry import check_batch_invariant

        check_batch_invariant(kernel_backend, device)
    level = isa.level() if level is None else level
    shapes = product_shapes(config, tp_size)
    choice = choose_dtype(dtype, checkpoint_dtype, device, kernel_backend, level=level,
                          measure=lambda: measure_products(shapes))  # fmt: skip
    if batch_invariant and on_cpu and choice.dtype == torch.float16:
        raise DtypeError("batch_invariant on a CPU computes in float32 or bfloat16 (float16 "
                         "runs the torch references, which batch rows); choose one of those")  # fmt: skip
    pads: tuple[tuple[int, int], ...] = ()
    if choice.dtype == torch.bfloat16 and on_cpu and not batch_invariant:
        pads = _cliff_shapes(shapes)
    logger.info("the engine computes in %s (%s) at %s%s", choice.name, choice.reason, level,
                ", batch-invariant" if batch_invariant else "")  # fmt: skip
    return RuntimeChoices(choice.name, choice.reason, level, pads, batch_invariant, quantization)


def _cliff_shapes(shapes) -> tuple[tuple[int, int], ...]:
    """The shapes whose bf16 cliff batches run faster padded here. Only a product
    of several threads can reach the cliff (on one, the AMX kernel takes every
    batch of up to 64 rows), so on one thread nothing is measured."""
    from ..kernels.cpu import linear

    if torch.get_num_threads() == 1:
        return ()
    return tuple(
        s for s in dict.fromkeys(shapes)
        if linear.may_pad_cliff(s, torch.bfloat16) and linear.measure_cliff(*s) < linear.CLIFF_GAIN
    )  # fmt: skip
