#!/usr/bin/env python3
"""How far a correct bf16 forward drifts from fp32 with depth: the study behind
the tolerances of ``scripts/gpu_check.py``'s logits checks, run on the CPU.

    python scripts/bf16_drift.py --hidden 1024 --layers 32 --json drift.json

A Llama of Llama-3-8B proportions at a reduced width (head_dim 128, 4 query
heads per KV head, intermediate 3.5 x hidden) with random weights whose
standard deviation is scaled by sqrt(4096 / hidden), so that every product has
the gain it has at 8B width (0.02 at 4096). Three paths run the same weights on
the script's logits check (prompts of 700 and 129 tokens in one step, then a
decode step of both):

- ``fp32``: the weights widened to fp32, the torch references, an fp32 cache;
- ``torch``: bf16 through the torch references (each op in fp32, output
  rounded to bf16);
- ``triton``: bf16 through an emulation of the Triton kernels' numerics: the
  references everywhere except paged attention, which follows the kernels'
  online softmax tile by tile (64 positions), rounds the softmax weights to
  bf16 before the P.V product as the kernels do, and for decode rows splits the
  KV range and merges the partial results like the split-KV kernel, with the
  split counts the 8B model gets (8 KV heads, 132 SMs): 3 for the eager decode
  step, 9 for the batch-8 graph bucket.

For each path, the residual stream after every layer; from it the logits of
the model cut after that layer (the final norm and LM head on the stream), so
one run of 32 layers gives the error at every depth 1..32. Prints, per depth,
each bf16 path's relative error against fp32 and the ratio triton / torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_support import (  # noqa: E402
    StreamRecorder,
    logits_by_depth,
    rel_err,
    use_checkout,
)

TILE = 64  # KV positions per tile, decode and prefill kernels (bf16, head_dim 128)


def emulated_attention(dtype, *, plan_kv_heads: int = 8, num_sms: int = 132,
                       force_splits: int | None = None, bug: str = "none"):  # fmt: skip
    """A ``paged_attention`` with the Triton kernels' numerics (see the module
    docstring), for the torch references' inputs. ``bug`` plants a fault, to
    see what the tolerance rule makes of it: ``bf16_accumulator`` rounds the
    running P.V sum to bf16 after every tile (a precision bug), ``lost_split``
    leaves a decode row's last KV split out of the merge, ``self_masked`` hides
    a decode row's own new position from it (an off-by-one in the mask)."""
    import torch

    from iterserve.kernels.attention_plan import plan_attention
    from iterserve.scheduler.blocks import blocks_for

    def online(scores, v):
        """Online softmax over TILE-wide tiles: scores [H, R, L] (masked -inf),
        v [H, L, D] fp32. Returns (acc, m, l)."""
        h, r, length = scores.shape
        m = torch.full((h, r), -math.inf)
        s_l = torch.zeros(h, r)
        acc = torch.zeros(h, r, v.shape[-1])
        for t0 in range(0, length, TILE):
            s = scores[..., t0 : t0 + TILE]
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            s_l = s_l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p.to(dtype).float() @ v[:, t0 : t0 + TILE]
            if bug == "bf16_accumulator":
                acc = acc.to(dtype).float()
            m = m_new
        return acc, m, s_l

    def attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                  *, max_query_len=None, max_seq_len=None, window=None, soft_cap=None):  # fmt: skip
        if window is not None or soft_cap is not None:
            raise ValueError("the emulation covers full causal attention without a soft cap")
        num_tokens, heads, head_dim = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        group = heads // kv_heads
        bound = block_tables.shape[1] * block_size
        plan = plan_attention(
            num_tokens=num_tokens, num_seqs=seq_lens.shape[0], num_heads=plan_kv_heads * group,
            num_kv_heads=plan_kv_heads, head_dim=head_dim,
            max_seq_len=bound if max_seq_len is None else min(max_seq_len, bound),
            max_query_len=max_query_len, elem_bytes=query.element_size(), num_sms=num_sms,
        )  # fmt: skip
        splits = force_splits or plan.num_splits
        out = torch.zeros_like(query)
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        for s, seq_len in enumerate(lens):
            q0, q1 = starts[s], starts[s + 1]
            q_len = q1 - q0
            if q_len == 0:
                continue
            blocks = block_tables[s, : blocks_for(seq_len, block_size)].long()
            k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
            v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
            k = k.repeat_interleave(group, 1).transpose(0, 1)  # [heads, L, D]
            v = v.repeat_interleave(group, 1).transpose(0, 1)
            q = query[q0:q1].float().transpose(0, 1)  # [heads, R, D]
            scores = (q @ k.transpose(1, 2)) * scale
            pos = seq_len - q_len + torch.arange(q_len)
            decode = plan.use_decode and q_len <= plan.tiles.decode_block_q
            if bug == "self_masked" and decode:
                pos = pos - 1
            scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos[:, None], -math.inf)
            n = splits if decode else 1
            split_len = math.ceil(math.ceil(seq_len / n) / TILE) * TILE
            parts = [online(scores[..., lo : lo + split_len], v[:, lo : lo + split_len])
                     for lo in range(0, seq_len, split_len)]  # fmt: skip
            if bug == "lost_split" and len(parts) > 1:
                parts = parts[:-1]
            big = torch.stack([m for _, m, _ in parts]).amax(0)
            acc = sum(a * torch.exp(m - big)[..., None] for a, m, _ in parts)
            den = sum(sl * torch.exp(m - big) for _, m, sl in parts)
            out[q0:q1] = (acc / den[..., None]).transpose(0, 1).to(query.dtype)
        return out

    return attention


def config_for(hidden: int, layers: int, vocab: int):
    from iterserve.workers.config import ModelConfig

    heads = hidden // 128
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": hidden * 7 // 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "eos_token_id": 1,
    })  # fmt: skip


def run_path(model, ops, kv, steps):
    """Each step's logits and per-layer streams, recorded through ``ops``."""
    out = []
    for ids, attn, rows in steps:
        rec = StreamRecorder(ops)
        model.set_ops(rec.ops, kv)
        logits = model(ids, attn, rows).float()
        out.append((logits, rec.layers()))
    return out


def study(
    hidden: int, layers: int, vocab: int, lens: tuple[int, ...], seed: int, bug: str = "none"
) -> dict:

    import torch

    from iterserve.kernels import AttentionMetadata, build_cos_sin_cache, get_ops
    from iterserve.scheduler.blocks import blocks_for
    from iterserve.workers.kv_cache import KVCache
    from iterserve.workers.model import Decoder

    torch.manual_seed(seed)
    c = config_for(hidden, layers, vocab)
    cos_sin = build_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta)
    ref = get_ops("torch")
    bf16 = Decoder(c, ref, cos_sin, dtype=torch.bfloat16, device="cpu")
    bf16.init_random_(seed, std=0.02 * math.sqrt(4096 / hidden))
    fp32 = Decoder(c, ref, cos_sin, dtype=torch.float32, device="cpu")
    fp32.load_state_dict(bf16.state_dict())  # the same values, widened
    bs = 16
    tables, nb = [], 0
    for n in lens:
        need = blocks_for(n + 2, bs)
        tables.append(list(range(nb, nb + need)))
        nb += need
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]

    def slots(s, positions):
        return torch.tensor(
            [tables[s][p // bs] * bs + p % bs for p in positions], dtype=torch.int32
        )

    ids = torch.cat(prompts).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens]).to(torch.int32)
    slot = torch.cat([slots(s, range(n)) for s, n in enumerate(lens)])
    qsl = torch.tensor([0, *itertools_accumulate(lens)], dtype=torch.int32)
    prefill = (ids, AttentionMetadata(pos, slot, bt, torch.tensor(lens, dtype=torch.int32),
                                           qsl, max(lens), max(lens)),
               (qsl[1:] - 1).long())  # fmt: skip

    def decode_step(tokens):
        d_pos = torch.tensor(lens, dtype=torch.int32)
        d_slot = torch.cat([slots(s, [n]) for s, n in enumerate(lens)])
        attn = AttentionMetadata(d_pos, d_slot, bt, d_pos + 1,
                                 torch.arange(len(lens) + 1, dtype=torch.int32), 1, max(lens) + 1)  # fmt: skip
        return (tokens.to(torch.int32), attn, torch.arange(len(lens)))

    def cache(dtype):
        return KVCache.allocate(c.num_layers, nb, bs, c.num_kv_heads, c.head_dim, dtype, "cpu")

    t0 = time.perf_counter()
    truth_kv = cache(torch.float32)
    truth_pre = run_path(fp32, ref, truth_kv, [prefill])[0]
    tokens = truth_pre[0].argmax(-1)
    truth_dec = run_path(fp32, ref, truth_kv, [decode_step(tokens)])[0]
    paths = {"torch": ref,
             "triton": ref.with_attention(emulated_attention(torch.bfloat16, bug=bug)),
             "triton_graph_splits": ref.with_attention(
                 emulated_attention(torch.bfloat16, force_splits=9))}  # fmt: skip
    results = {}
    for name, ops in paths.items():
        kv = cache(torch.bfloat16)
        pre = run_path(bf16, ops, kv, [prefill])[0]
        dec = run_path(bf16, ops, kv, [decode_step(tokens)])[0]
        results[name] = {"prefill": pre, "decode": dec}
    rows = {"prefill": prefill[-1], "decode": torch.arange(len(lens))}
    report: dict = {"hidden": hidden, "layers": layers, "vocab": vocab, "lens": list(lens),
                    "bug": bug, "seconds": 0.0}  # fmt: skip
    for step, truth in (("prefill", truth_pre), ("decode", truth_dec)):
        want = logits_by_depth(truth[1], rows[step], fp32.norm, fp32.lm_head, c.rms_norm_eps, ref)
        per = {}
        for name in paths:
            got = results[name][step]
            depth = logits_by_depth(got[1], rows[step], bf16.norm, bf16.lm_head, c.rms_norm_eps,
                                    ref)  # fmt: skip
            per[name] = [rel_err(g, w) for g, w in zip(depth, want)]
            per[name + "_stream"] = [rel_err(g, w) for g, w in zip(got[1], truth[1])]
            assert abs(rel_err(got[0], truth[0]) - per[name][-1]) < 1e-6
        direct = [rel_err(a, b) for a, b in zip(
            logits_by_depth(results["triton"][step][1], rows[step], bf16.norm, bf16.lm_head,
                            c.rms_norm_eps, ref),
            logits_by_depth(results["torch"][step][1], rows[step], bf16.norm, bf16.lm_head,
                            c.rms_norm_eps, ref))]  # fmt: skip
        per["direct_triton_vs_torch"] = direct
        report[step] = per
    g = [rel_err(a, b) for a, b in zip(
        logits_by_depth(results["triton_graph_splits"]["decode"][1], rows["decode"], bf16.norm,
                        bf16.lm_head, c.rms_norm_eps, ref),
        logits_by_depth(results["triton"]["decode"][1], rows["decode"], bf16.norm, bf16.lm_head,
                        c.rms_norm_eps, ref))]  # fmt: skip
    report["decode"]["direct_9_vs_3_splits"] = g
    report["seconds"] = time.perf_counter() - t0
    return report


def itertools_accumulate(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--lens", default="700,129", help="prompt lengths of the check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bug",
        default="none",
        choices=("none", "bf16_accumulator", "lost_split", "self_masked"),
        help="plant a fault in the emulated kernels",
    )
    parser.add_argument("--json", help="write the per-depth errors here")
    args = parser.parse_args(argv)
    use_checkout()
    lens = tuple(int(x) for x in args.lens.split(","))
    report = study(args.hidden, args.layers, args.vocab, lens, args.seed, args.bug)
    print(f"hidden {args.hidden}, {args.layers} layers: {report['seconds']:.0f} s")
    for step in ("prefill", "decode"):
        per = report[step]
        print(
            f"{step}: depth  torch-vs-fp32  triton-vs-fp32  ratio  direct"
            + ("  9-vs-3 splits" if step == "decode" else "")
        )
        for d in range(args.layers):
            if (d + 1) & d and d + 1 != args.layers:
                continue  # powers of two and the last
            t, e = per["torch"][d], per["triton"][d]
            line = f"  {d + 1:5d}  {t:13.4f}  {e:14.4f}  {e / t:5.2f}  {per['direct_triton_vs_torch'][d]:6.4f}"
            if step == "decode":
                line += f"  {per['direct_9_vs_3_splits'][d]:.4f}"
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
