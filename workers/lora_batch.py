"""The adapters a rank holds, and a step's rows added to the products by adapter.

A step's rows are ordered by adapter slot (:func:`order_by_adapter`), so each
adapter's rows are one contiguous segment::

    rows:     base base base | A A A A | B B      (slot 0 | slot 1 | slot 2)
    per product and segment: out[seg] += (x[seg] @ At_slot) @ Bt_slot

Base-model rows cost nothing. On a CPU (the ``cpu`` kernel backend) every
adapter of a step runs in one compiled call per product (:class:`CpuLoraBatch`,
:mod:`iterserve.kernels.cpu.lora`); on a GPU through the segmented Triton
kernels (:class:`KernelLoraBatch`). Elsewhere (the ``torch`` backend, fp16 on a
CPU) a step of one adapter runs its two products (:class:`LoraBatch`) and
several run as one batched product each way (:class:`BatchedLoraBatch`). The
adapters' weights, per layer and fused product, are :mod:`.lora`'s
:class:`~iterserve.workers.lora.LoraProduct`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..kernels.cpu.linear import bucket_rows
from ..scheduler.messages import StepPlan
from ..scheduler.seq_table import SequenceTable
from .config import ModelConfig
from .lora import (
    GROUPS,
    TARGETS,
    LoraProduct,
    PeftAdapter,
    group_columns,
    read_adapter,
    shard_adapter,
    target_parts,
)


def order_by_adapter(
    plan: StepPlan, table: SequenceTable
) -> tuple[StepPlan, list[tuple[int, int, int]]]:
    """The plan with its entries ordered by adapter slot (base rows first, plan
    order within a slot), and the ``(slot, first row, end row)`` segment of each
    adapter's rows; the plan itself and no segment when no row is adapted."""
    slots = [table.get(e.slot_idx).lora_slot for e in plan.scheduled]
    if not any(slots):
        return plan, []
    order = sorted(range(len(slots)), key=slots.__getitem__)  # stable
    plan = dataclasses.replace(plan, scheduled=[plan.scheduled[i] for i in order])
    segments: list[tuple[int, int, int]] = []
    row = 0
    for i, entry in zip(order, plan.scheduled):
        slot, end = slots[i], row + entry.num_tokens
        if slot:
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], end)
            else:
                segments.append((slot, row, end))
        row = end
    return plan, segments


# The compiled CPU kernel (CpuLoraBatch) serves steps of at most this many adapted
# rows; longer ones take the torch forms, whose oneDNN products cost little more
# for more rows. With the kernel's register tiles, whole prefill steps of the demo
# model (bf16, rank 16 on every projection, one thread, alternating in one
# process): 8 prompts of 16 tokens over 4 adapters 6.96 ms against 7.75 batched
# (base 4.71), 16 of 32 over 8 adapters 16.3 against 16.4 (base 11.1), 32 of 32
# over 8 adapters 30.5 against 29.7; past that the two are even, and the torch
# forms meet a new oneDNN kernel for every row count they have not seen.
CPU_KERNEL_MAX_ROWS = 512


class LoraBatch:
    """One step's rows by adapter: ``segments`` are ``(slot, start, end)`` row
    ranges of adapted rows (base-model rows appear in none)."""

    def __init__(self, slots: LoraSlots, segments: list[tuple[int, int, int]]):
        # Per segment, the adapter's products by layer: looked up once per step.
        self.parts = [(slots.layers[slot], start, end) for slot, start, end in segments]

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[seg] += (x[seg] @ At) @ Bt`` for each segment whose adapter adapts
        ``group`` of ``layer``; ``out`` is a fresh product output, changed in place."""
        for layers, start, end in self.parts:
            product = layers[layer].get(group)
            if product is not None:
                rows = out[start:end]
                rows.addmm_(torch.mm(x[start:end], product.at), product.bt)


class BatchedLoraBatch:
    """A step of several adapters as one batched shrink and one batched expand per
    product: each adapter's rows one matrix of a batch, padded to the longest::

        x[adapted rows] -> [A, L, in]        (a view when every adapter has L rows,
                                              else gathered, padding rows repeated)
        s = bmm(x, At)          [A, L, R]    (At: the step's adapters, [A, in, R],
        s *= row mask                         ranks zero-padded to the largest R)
        d = bmm(s, Bt)          [A, L, out]
        out[adapted rows] += d               (a view, else an index_add)

    Three to five calls per product whatever the number of adapters, and no more
    arithmetic than each adapter's own products (but the padding): on a CPU step
    of a few rows per adapter the calls cost more than the arithmetic
    (``iterserve bench lora``)."""

    def __init__(self, slots: LoraSlots, segments: list[tuple[int, int, int]]):
        self.start, self.end = segments[0][1], segments[-1][2]
        self.layers = slots.stacked(tuple(slot for slot, _, _ in segments))
        lengths = [end - start for _, start, end in segments]
        # Past 64 rows an adapter, padded to a multiple of 32 (cpu_linear.bucket_rows):
        # oneDNN compiles a kernel for every new shape (~0.6 ms for a batched shrink
        # of eight adapters, against 0.06 for one it has), and prefill pieces would
        # bring a new one nearly every step.
        self.num, self.width = len(segments), bucket_rows(max(lengths))
        self.index: torch.Tensor | None = None  # [A * L] rows, when not one even block
        self.row_mask: torch.Tensor | None = None  # [A, L, 1], zero on padding rows
        if min(lengths) != self.width:
            rows = [start + min(j, end - start - 1) for _, start, end in segments
                    for j in range(self.width)]  # fmt: skip
            self.index = torch.tensor(rows, device=slots.device)
            mask = [[1.0 if j < n else 0.0] for n in lengths for j in range(self.width)]
            self.row_mask = torch.tensor(mask, dtype=slots.dtype, device=slots.device).view(
                self.num, self.width, 1
            )

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        product = self.layers[layer].get(group)
        if product is None:
            return
        shape = (self.num, self.width, -1)
        if self.index is None:
            shrunk = torch.bmm(x[self.start : self.end].view(shape), product.at)
            out[self.start : self.end].view(shape).baddbmm_(shrunk, product.bt)
            return
        shrunk = torch.bmm(x.index_select(0, self.index).view(shape), product.at)
        shrunk.mul_(self.row_mask)
        delta = torch.bmm(shrunk, product.bt)  # [A, L, out]
        out.index_add_(0, self.index, delta.view(self.num * self.width, -1))


class KernelLoraBatch:
    """On a GPU: every adapter of the step in one launch per shrink and per expand,
    segmented by adapter (:mod:`iterserve.kernels.triton_lora`), over the step's
    adapters stacked as for :class:`BatchedLoraBatch`."""

    def __init__(self, slots: LoraSlots, segments: list[tuple[int, int, int]]):
        from ..kernels import triton_lora

        self.kernels = triton_lora
        self.layers = slots.stacked(tuple(slot for slot, _, _ in segments))
        self.starts = [start for _, start, _ in segments]
        self.lens = [end - start for _, start, end in segments]
        self.index = list(range(len(segments)))  # segment i computes with stack entry i

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        product = self.layers[layer].get(group)
        if product is None:
            return
        shrunk = self.kernels.lora_shrink(x, product.at, self.starts, self.lens, self.index)
        self.kernels.lora_expand(shrunk, product.bt, out, self.starts, self.lens, self.index)


class CpuLoraBatch:
    """On a CPU: every adapter of the step in one compiled call per product, the
    shrink and expand of each segment's rows together
    (:func:`iterserve.kernels.cpu.lora.lora_add`), over the slots' weights as
    :class:`CpuLayout` holds them. One call where the batched form makes two
    through torch (and the segments form two per adapter), and no arithmetic on
    the zero blocks of the fused q/k/v and gate/up expands (``iterserve bench
    lora``)."""

    def __init__(self, slots: LoraSlots, segments: list[tuple[int, int, int]]):
        from ..kernels.cpu import lora as cpu_lora

        assert slots.cpu_layout is not None
        self.kernel, self.layout = cpu_lora.lora_add, slots.cpu_layout
        # Slot s is index s - 1 of the layout's weights.
        self.tiles = cpu_lora.tiles([(slot - 1, start, end) for slot, start, end in segments])
        self.threads = torch.get_num_threads()

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        weights = self.layout.arrays[layer].get(group)
        if weights is None:
            return
        layout = self.layout
        self.kernel(x, out, weights[0], weights[1], layout.ranks[group], self.tiles,
                    layout.cols[group], self.threads)  # fmt: skip


class CpuLayout:
    """Every slot's adapter weights as :mod:`iterserve.kernels.cpu.lora` reads them:
    per layer and fused product, ``a [max_loras, T, in, rpad]`` (A transposed,
    ranks padded to ``cpu_lora.padded_rank(rmax)``) and ``b [max_loras, rmax,
    width]`` (``rmax``: ``max_lora_rank``; slot ``s`` at index
    ``s - 1``), and per product the slots' ranks by target. A slot is written
    when it loads an adapter, in place: no copy per step or per set of adapters
    in a step. The weights take the model's dtype; their memory is that of
    ``max_loras`` adapters of rank ``max_lora_rank`` on the products some loaded
    adapter adapts."""

    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 tp_size: int, dtype: torch.dtype):  # fmt: skip
        from ..kernels.cpu.lora import padded_rank

        self.config, self.max_loras, self.rmax, self.dtype = config, max_loras, max_lora_rank, dtype
        self.rpad = padded_rank(max_lora_rank)
        self.cols = {g: np.array(c, dtype=np.int64)
                     for g, c in group_columns(config, tp_size).items()}  # fmt: skip
        self.targets = {g: [t for t in TARGETS if GROUPS[t] == g] for g in self.cols}
        self.ranks = {g: np.zeros((max_loras, len(t)), dtype=np.int64)
                      for g, t in self.targets.items()}  # fmt: skip
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(config.num_layers)
        ]
        # The same weights as the kernel reads them (numpy views, made once).
        self.arrays: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [
            {} for _ in range(config.num_layers)
        ]

    def write(self, slot: int, parts: list[dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]]
              ) -> None:  # fmt: skip
        """Slot ``slot``'s adapter, as :func:`~iterserve.workers.lora.target_parts`
        gives it; the slot's rows of products and targets it lacks are not read
        again (their ranks are 0)."""
        from ..kernels.cpu.fastmath import as_array

        i = slot - 1
        for ranks in self.ranks.values():
            ranks[i] = 0
        for layer, groups in enumerate(parts):
            for group, targets in groups.items():
                cols, names = self.cols[group], self.targets[group]
                weights = self.layers[layer].get(group)
                if weights is None:
                    num_in = targets[0][1].shape[1]
                    weights = (
                        torch.zeros(self.max_loras, len(names), num_in, self.rpad,
                                    dtype=self.dtype),
                        torch.zeros(self.max_loras, self.rmax, int(cols[-1]), dtype=self.dtype),
                    )  # fmt: skip
                    self.layers[layer][group] = weights
                    self.arrays[layer][group] = (as_array(weights[0]), as_array(weights[1]))
                a, b = weights
                for target, a_t, bt_t in targets:
                    t, rank = names.index(target), a_t.shape[0]
                    a[i, t, :, :rank] = a_t.t()
                    b[i, :rank, cols[t] : cols[t + 1]] = bt_t
                    self.ranks[group][i, t] = rank


class LoraContext:
    """What every layer's LoRA site reads: the step's :class:`LoraBatch`, or None
    when the step has no adapted row (then a product costs one attribute check)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraSite:
    """One layer's hook: ``site(group, x, out)`` adds the step's adapters' deltas."""

    __slots__ = ("context", "layer")

    def __init__(self, context: LoraContext, layer: int):
        self.context, self.layer = context, layer

    def __call__(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is not None:
            batch.add(self.layer, group, x, out)
        return out


class LoraSlots:
    """The rank's adapter slots ``1..max_loras`` (their weights in the model's dtype,
    on its device) and a host cache of the ``max_cpu_loras`` adapters read most
    recently, so that an adapter evicted and loaded again is not read again."""

    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, tp_rank: int, tp_size: int, dtype: torch.dtype,
                 device: Any, cpu_kernel: bool = False):  # fmt: skip
        self.config, self.max_loras, self.max_lora_rank = config, max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.tp_rank, self.tp_size, self.dtype, self.device = tp_rank, tp_size, dtype, device
        empty: list[dict[str, LoraProduct]] = [{} for _ in range(config.num_layers)]
        self.layers: list[list[dict[str, LoraProduct]]] = [empty] * (max_loras + 1)
        self.adapter_ids = [0] * (max_loras + 1)
        self.host: OrderedDict[int, PeftAdapter] = OrderedDict()  # adapter_id -> read adapter
        self.num_reads = 0
        self.batch_adapters = True  # several adapters in a step: BatchedLoraBatch
        # The segmented Triton kernels (KernelLoraBatch): on a GPU.
        self.use_kernels = torch.device(device).type == "cuda"
        self.stacks: OrderedDict[tuple[int, ...], list[dict[str, LoraProduct]]] = OrderedDict()
        # On a CPU, the compiled kernel (CpuLoraBatch) where asked for and it runs
        # here; its weights are laid out as each slot loads.
        self.cpu_layout: CpuLayout | None = None
        if cpu_kernel and not self.use_kernels:
            from ..kernels.cpu import lora as cpu_lora

            if cpu_lora.available(dtype):
                self.cpu_layout = CpuLayout(config, max_loras=max_loras,
                                            max_lora_rank=max_lora_rank, tp_size=tp_size,
                                            dtype=dtype)  # fmt: skip
        self.use_cpu_kernel = self.cpu_layout is not None

    def load(self, slot: int, adapter_id: int, path: str) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"adapter slot {slot} outside 1..{self.max_loras}")
        adapter = self.host.get(adapter_id)
        if adapter is None:
            adapter = read_adapter(path, self.config, self.max_lora_rank)
            self.num_reads += 1
            self.host[adapter_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(adapter_id)
        self.stacks.clear()  # they may hold the slot's old adapter
        self.layers[slot] = shard_adapter(adapter, self.config, tp_rank=self.tp_rank,
                                          tp_size=self.tp_size, dtype=self.dtype,
                                          device=self.device)  # fmt: skip
        if self.cpu_layout is not None:
            self.cpu_layout.write(slot, target_parts(adapter, self.config, tp_rank=self.tp_rank,
                                                     tp_size=self.tp_size))  # fmt: skip
        self.adapter_ids[slot] = adapter_id

    def batch(
        self, segments: list[tuple[int, int, int]]
    ) -> LoraBatch | BatchedLoraBatch | KernelLoraBatch | CpuLoraBatch | None:
        """The step's adapted rows: on a GPU through the segmented kernels; on a CPU
        through the compiled kernel (:class:`CpuLoraBatch`) when the adapted rows
        are at most :data:`CPU_KERNEL_MAX_ROWS`, unless ``use_cpu_kernel`` is off
        or it cannot run; else one adapter as its own
        products, several as batched ones (:class:`BatchedLoraBatch`) unless
        ``batch_adapters`` is off."""
        if not segments:
            return None
        if self.use_kernels:
            return KernelLoraBatch(self, segments)
        if (self.use_cpu_kernel and self.cpu_layout is not None
                and segments[-1][2] - segments[0][1] <= CPU_KERNEL_MAX_ROWS):  # fmt: skip
            return CpuLoraBatch(self, segments)
        if len(segments) > 1 and self.batch_adapters:
            return BatchedLoraBatch(self, segments)
        return LoraBatch(self, segments)

    def stacked(self, slots: tuple[int, ...]) -> list[dict[str, LoraProduct]]:
        """Per layer and product, the adapters of ``slots`` as one batch
        (``at [A, in, R]``, ``bt [A, R, out]``, ranks zero-padded to the largest, an
        adapter without the product all zeros); kept for the next steps with the
        same adapters until a slot loads another."""
        stack = self.stacks.get(slots)
        if stack is not None:
            self.stacks.move_to_end(slots)
            return stack
        stack: list[dict[str, LoraProduct]] = []
        for layer in range(self.config.num_layers):
            products = [self.layers[slot][layer] for slot in slots]
            batched: dict[str, LoraProduct] = {}
            for group in sorted({g for p in products for g in p}):
                parts = [p.get(group) for p in products]
                known = next(q for q in parts if q is not None)
                rank = max(q.at.shape[1] for q in parts if q is not None)
                at = known.at.new_zeros(len(slots), known.at.shape[0], rank)
                bt = known.bt.new_zeros(len(slots), rank, known.bt.shape[1])
                for i, q in enumerate(parts):
                    if q is not None:
                        at[i, :, : q.at.shape[1]] = q.at
                        bt[i, : q.bt.shape[0]] = q.bt
                batched[group] = LoraProduct(at, bt)
            stack.append(batched)
        self.stacks[slots] = stack
        while len(self.stacks) > 4:
            self.stacks.popitem(last=False)
        return stack
