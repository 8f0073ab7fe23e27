"""A quantized checkpoint's projections into the model, this rank's slice of each.

Every matrix product of the decoder is a *site*: the stacked q/k/v and gate/up
products (column-parallel: each part's rows of this rank), o_proj and down_proj
(row-parallel: this rank's inputs), every expert's two likewise, the MoE router
and the LM head (whole). :func:`sites` lists the ones ``config`` quantizes; the
dense loader leaves their ``.weight`` alone (:func:`claims`) and :func:`load`
reads each site's parts (:func:`.formats.read`), puts them side by side into one
:class:`~iterserve.kernels.quant.QuantizedTensors` (:func:`assemble`) and packs it
for the rank's kernels. The dense parameter is let go; the packed weight is what
the product's ``linear`` call reads (the owner's ``*_packed`` attribute, and the
parameter's ``quantized``, which :func:`iterserve.kernels.cpu.linear.pack` hands
back), so the model code does not know its weights are quantized.

Column-parallel parts keep their own rows of the scales and zero points;
row-parallel ones keep every group's, with each input's group (``g_idx`` sliced
with the inputs), so a rank's inputs may start in the middle of a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...kernels import quant as kq
from ..architectures import weight_names
from ..config import CheckpointError
from ..moe import SparseMoE
from . import formats
from .config import QuantConfig, Scheme

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..model import Decoder

# The tensor whose presence says a module is quantized, for configs that name none.
_PRESENCE = {"gptq": "qweight", "awq": "qweight", "fp8": "weight_scale_inv"}
FP8_MAX = 448.0  # the largest e4m3 value


@dataclass
class Site:
    """One product of the model: where its packed weight goes and which checkpoint
    modules (``parts``: name, full ``[out, in]``, split dim, start, stop) it reads."""

    owner: Any  # the module holding the packed weight (or a list, for experts)
    attr: str  # "qkv_packed", ...; for an expert, its index in the layer's list
    param: torch.Tensor | None  # the dense parameter it replaces (None: an expert's slice)
    parts: list[tuple[str, tuple[int, int], int | None, int, int | None]]
    shape: tuple[int, int]  # this rank's [out, in]
    scheme: Scheme | None = None


def _stacked(owner, attr, param, names, rows, hidden, tp) -> Site:
    """Parts stacked by rows, each ``(rows per rank, rows in all)``, this rank's span
    of each, from one module per part or consecutive rows of one fused module."""
    parts, offset = [], 0
    total = sum(whole for _, whole in rows)
    for i, (per_rank, whole) in enumerate(rows):
        lo, hi = tp.rows(per_rank)
        if len(names) == 1:
            parts.append((names[0], (total, hidden), 0, offset + lo, offset + hi))
        else:
            parts.append((names[i], (whole, hidden), 0, lo, hi))
        offset += whole
    return Site(owner, attr, param, parts, (sum(r for r, _ in rows), hidden))


def _all_sites(model: Decoder) -> list[Site]:
    c, tp, n = model.config, model.tp, weight_names(model.config)
    hd, h = c.head_dim, c.hidden_size
    q_rows, kv_rows = tp.num_heads * hd, tp.num_kv_heads * hd
    qkv_rows = [(q_rows, c.num_heads * hd), (kv_rows, c.num_kv_heads * hd),
                (kv_rows, c.num_kv_heads * hd)]  # fmt: skip
    sites = []
    for i, layer in enumerate(model.layers):
        p = n.layer.format(i)
        a = layer.attn
        sites.append(_stacked(a, "qkv_packed", a.qkv_weight, [p + t for t in n.qkv], qkv_rows,
                              h, tp))  # fmt: skip
        lo, hi = tp.rows(q_rows)
        sites.append(Site(a, "o_packed", a.o_weight, [(p + n.o, (h, c.num_heads * hd), 1, lo, hi)],
                          (h, q_rows)))  # fmt: skip
        m = layer.mlp
        if isinstance(m, SparseMoE):
            sites.append(Site(m, "router_packed", m.router,
                              [(p + n.router, tuple(m.router.shape), None, 0, None)],
                              tuple(m.router.shape)))  # fmt: skip
            inter, whole = tp.expert_intermediate, c.experts.intermediate_size
            gate, up, down = n.expert_gate_up_down
            lo, hi = tp.rows(inter)
            for e in range(m.w13.shape[0]):
                x = p + n.expert.format(e)
                sites.append(_stacked(m, e, None, [x + gate, x + up], [(inter, whole)] * 2, h, tp))
                sites.append(Site(m, (e, 1), None, [(x + down, (h, whole), 1, lo, hi)], (h, inter)))
            continue
        inter, whole = tp.intermediate, c.intermediate_size
        sites.append(_stacked(m, "gate_up_packed", m.gate_up_weight, [p + t for t in n.gate_up],
                              [(inter, whole)] * 2, h, tp))  # fmt: skip
        lo, hi = tp.rows(inter)
        sites.append(Site(m, "down_packed", m.down_weight, [(p + n.down, (h, whole), 1, lo, hi)],
                          (h, inter)))  # fmt: skip
    if not c.tie_word_embeddings:
        sites.append(Site(model, "lm_head_packed", model.lm_head,
                          [(n.lm_head, (c.vocab_size, h), None, 0, None)], (c.vocab_size, h)))  # fmt: skip
    return sites


def _scheme(config: QuantConfig, ckpt: Checkpoint | None, module: str) -> Scheme | None:
    scheme = config.scheme_for(module)
    if scheme is None or ckpt is None or not config.by_presence:
        return scheme
    tensor = _PRESENCE[config.method]
    if config.method == "fp8" and scheme.strategy == "tensor":
        tensor = "weight_scale"
    return scheme if f"{module}.{tensor}" in ckpt else None


def sites(model: Decoder, config: QuantConfig, ckpt: Checkpoint | None) -> list[Site]:
    """The products ``config`` quantizes, each with its scheme. A product whose parts
    are quantized differently (one dense, or two schemes) is refused by name."""
    chosen = []
    for site in _all_sites(model):
        schemes = [_scheme(config, ckpt, name) for name, *_ in site.parts]
        if all(s is None for s in schemes):
            continue
        names = [name for name, *_ in site.parts]
        if any(s != schemes[0] for s in schemes):
            raise CheckpointError(f"quantization_config: {', '.join(names)} are computed as one "
                                  "product and must be quantized alike")  # fmt: skip
        site.scheme = schemes[0]
        chosen.append(site)
    return chosen


def claims(quantized: list[Site]) -> set[str]:
    """The ``.weight`` tensors the dense loader must not read: the quantized sites'."""
    return {f"{name}.weight" for site in quantized for name, *_ in site.parts}


def assemble(parts: list[formats.Part], scheme: Scheme, shape: tuple[int, int],
             names: list[str]) -> kq.QuantizedTensors:  # fmt: skip
    """Parts side by side by output as one product's weight; weight-only inputs
    sorted by group, each group's run padded to whole chunks (:mod:`~iterserve.kernels.quant`)."""
    values = torch.cat([p.values for p in parts])
    if scheme.w8a8:
        activations = parts[0].activations
        if not activations.dynamic:  # one static scale for the product: the largest, as vLLM
            scale = max(p.activations.scale for p in parts)
            activations = kq.Activations(False, False, activations.symmetric, scale,
                                         activations.zero)  # fmt: skip
        scales = torch.cat([p.scales for p in parts])
        if scales.shape[1] != 1:
            raise CheckpointError(f"weights: {names[0]}'s W8A8 scales must be one an output")
        return kq.QuantizedTensors(kq.W8A8, shape, values, scales[:, 0].contiguous(),
                                   activations=activations)  # fmt: skip
    group_of = parts[0].group_of
    for p, name in zip(parts[1:], names[1:]):
        if not torch.equal(p.group_of, group_of) or p.scales.shape[1] != parts[0].scales.shape[1]:
            raise CheckpointError(f"weights: {names[0]} and {name} are computed as one product "
                                  "and must group their inputs alike (g_idx, group_size)")  # fmt: skip
    scales = torch.cat([p.scales for p in parts]).float()
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.scales)
                           for p in parts]).float()  # fmt: skip
    perm, chunk_groups = layout(group_of, scales.shape[1])
    if perm is not None:
        values = torch.nn.functional.pad(values, (0, 1))[:, perm]
    return kq.QuantizedTensors(kq.WX, shape, values.contiguous(), scales, zeros, chunk_groups,
                               perm, scheme.bits, scheme.number)  # fmt: skip


def layout(group_of: torch.Tensor, num_groups: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(perm, chunk_groups)`` for inputs of groups ``group_of``: the inputs sorted by
    group (stable), each group's run padded with the zero input (index ``in``) to a
    multiple of :data:`~iterserve.kernels.quant.CHUNK`; ``perm`` None where that is the
    identity."""
    k = group_of.shape[0]
    counts = torch.bincount(group_of, minlength=num_groups)
    padded = (counts + kq.CHUNK - 1) // kq.CHUNK * kq.CHUNK
    order = torch.argsort(group_of, stable=True)
    sorted_groups = group_of[order]
    run_start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    dest = run_start[sorted_groups] + torch.arange(k) - first[sorted_groups]
    perm = torch.full((int(padded.sum()),), k, dtype=torch.long)
    perm[dest] = order
    chunk_groups = torch.repeat_interleave(torch.arange(num_groups), padded // kq.CHUNK)
    identity = perm.shape[0] == k and torch.equal(perm, torch.arange(k))
    return (None if identity else perm), chunk_groups.to(torch.int32)


def _pack(model: Decoder, q: kq.QuantizedTensors) -> kq.QuantizedWeight:
    """``q`` packed for the model's device, dtype and kernel backend."""
    backend = getattr(model.ops, "name", "auto")
    return kq.pack(q, model.embed.device, model.embed.dtype, backend)


def _place(site: Site, weight: kq.QuantizedWeight) -> None:
    """The packed weight where the product reads it; the dense parameter let go."""
    if site.param is not None:
        site.param.data = site.param.data.new_empty(0)
        site.param.quantized = weight
        setattr(site.owner, site.attr, weight)
        return
    moe: SparseMoE = site.owner
    if moe.packed is None or not isinstance(moe.packed[0], list):
        moe.packed = [[None, None] for _ in range(moe.w13.shape[0])]
    expert, which = site.attr if isinstance(site.attr, tuple) else (site.attr, 0)
    moe.packed[expert][which] = weight


def load(model: Decoder, ckpt: Checkpoint, config: QuantConfig, quantized: list[Site]) -> None:
    """Reads, assembles and packs every quantized site (:func:`sites`)."""
    for site in quantized:
        names = [name for name, *_ in site.parts]
        parts = [formats.read(ckpt, name, site.scheme, full, dim, lo, hi)
                 for name, full, dim, lo, hi in site.parts]  # fmt: skip
        _place(site, _pack(model, assemble(parts, site.scheme, site.shape, names)))
    _release_experts(model)


def _release_experts(model: Decoder) -> None:
    for layer in model.layers:
        m = layer.mlp
        if isinstance(m, SparseMoE) and m.packed is not None and isinstance(m.packed[0], list):
            m.packed = [tuple(pair) for pair in m.packed]
            m.w13.data, m.w2.data = m.w13.data.new_empty(0), m.w2.data.new_empty(0)
            m.w13.quantized = m.packed  # what SparseMoE.pack keeps


def quantize_fp8(weight: torch.Tensor) -> kq.QuantizedTensors:
    """A dense ``[out, in]`` weight as e4m3 values with one fp32 scale an output
    (``max|w| / 448``), the inputs padded to whole chunks."""
    w = weight.detach().float().cpu()
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    values = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    perm, chunk_groups = layout(torch.zeros(w.shape[1], dtype=torch.long), 1)
    if perm is not None:
        values = torch.nn.functional.pad(values, (0, 1))[:, perm]
    return kq.QuantizedTensors(kq.WX, tuple(w.shape), values.contiguous(), scales, None,
                               chunk_groups, perm, 8, "e4m3")  # fmt: skip


def quantize_online(model: Decoder, config: QuantConfig) -> None:
    """``quantization: fp8`` on a dense checkpoint, after its weights loaded: every
    site ``config`` covers quantized to fp8 per output channel, then packed."""
    for site in sites(model, config, None):
        if site.param is not None:
            _place(site, _pack(model, quantize_fp8(site.param.data)))
            continue
        moe: SparseMoE = site.owner
        expert, which = site.attr if isinstance(site.attr, tuple) else (site.attr, 0)
        dense = (moe.w13 if which == 0 else moe.w2).data[expert]
        _place(site, _pack(model, quantize_fp8(dense)))
    _release_experts(model)
