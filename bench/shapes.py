"""Random-weight checkpoints of named shapes, for benchmarks at real sizes.

``iterserve bench checkpoint --shape llama-1b --out DIR`` writes a Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, the demo model's
tokenizer) whose layers have the named model's shape and whose weights are
drawn by transformers' own initialisation from ``--seed``: the same command
gives the same weights on any machine with the same transformers and torch.
Both iterserve and vLLM load it like any checkpoint, so a side-by-side
comparison at a real size needs no model hub. The vocabulary is the demo
tokenizer's (4096): the layers are the named model's, the embedding and LM
head are not (a 128k-vocabulary head would be ~0.5 GB of a 1B model's bf16
weights; say so when quoting a figure). Text from random weights is noise:
benchmark with ``ignore_eos``.

transformers (a dev dependency) builds the model, so any architecture it knows
and iterserve loads can be a shape: add an entry to :data:`SHAPES`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

# name -> (what it is shaped like, the config's fields)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-144m": (
        "a 144M-parameter Llama (12 layers of hidden 1024, GQA 16/4 heads of 64)",
        {
            "model_type": "llama",
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 2048,
        },
    ),
    "llama-1b": (
        "Llama-3.2-1B's layers (16 of hidden 2048, GQA 32/8 heads of 64, MLP 8192)",
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        },
    ),
    "qwen2-0.5b": (
        "Qwen2-0.5B's layers (24 of hidden 896, GQA 14/2 heads of 64, q/k/v bias)",
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        },
    ),
}

# The 144M Llama's layers under each architecture the loader takes, with that
# architecture's own features as its checkpoints ship them (so that a figure
# against vLLM compares what each costs there); MoE shapes keep the Llama's
# active width: two experts of half its MLP per token. Gemma ties its embeddings,
# as every Gemma checkpoint does (vLLM's Gemma has no separate LM head).
_LLAMA_144M = {k: v for k, v in SHAPES["llama-144m"][1].items() if k != "model_type"}
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("with Mistral's sliding window (4096)", {"model_type": "mistral",
                                                          "sliding_window": 4096}),
    "qwen3": ("with Qwen3's q/k norms", {"model_type": "qwen3"}),
    "gemma2": ("with Gemma 2's sandwich norms, GELU, soft caps, alternating 4096 window",
               {"model_type": "gemma2", "query_pre_attn_scalar": 64, "sliding_window": 4096,
                "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "gemma3": ("with Gemma 3's q/k norms, 5 local (512 window) to 1 global layers",
               {"model_type": "gemma3_text", "query_pre_attn_scalar": 64, "sliding_window": 512,
                "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "phi3": ("with Phi-4-mini's partial rotary (0.75)", {"model_type": "phi3",
                                                        "partial_rotary_factor": 0.75}),
    "mixtral": ("as Mixtral: 8 experts of MLP 1408, 2 a token", {
        "model_type": "mixtral", "intermediate_size": 1408, "num_local_experts": 8,
        "num_experts_per_tok": 2}),
    "qwen3-moe": ("as Qwen3-MoE: 8 experts of MLP 1408, 2 a token, normalised", {
        "model_type": "qwen3_moe", "moe_intermediate_size": 1408, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1}),
}  # fmt: skip
for _name, (_what, _fields) in _ARCHITECTURES.items():
    SHAPES[f"{_name}-144m"] = (f"the 144M Llama's layers {_what}", {**_LLAMA_144M, **_fields})
DTYPES = ("bfloat16", "float32", "float16")
# --quantize's schemes (workers/quant/write.py), the three the benchmarks quote first
QUANTIZE = ("w8a8", "w4a16", "fp8", "w4a16-asym", "w8a16", "fp8-block", "gptq", "gptq-8bit",
            "awq")  # fmt: skip


def build_checkpoint(
    shape: str, out: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
    quantize: str | None = None, group_size: int = 128,
) -> Path:  # fmt: skip
    """Writes the random-weight checkpoint ``shape`` into ``out``; returns ``out``.
    ``quantize``: its projections quantized by rounding to nearest, in that scheme's
    format (:data:`iterserve.workers.quant.write.SCHEMES`: ``w8a8`` is
    compressed-tensors' W8A8 int8, ``w4a16`` its W4A16 in groups of ``group_size``,
    ``fp8`` its FP8 per channel with dynamic activations)."""
    if quantize is not None:
        import tempfile

        from ..workers.quant.write import quantize_checkpoint

        with tempfile.TemporaryDirectory() as dense:
            build_checkpoint(shape, dense, dtype=dtype, seed=seed)
            return quantize_checkpoint(dense, out, quantize, group_size=group_size)
    import torch
    import transformers

    from ..models import DEMO_MODEL_PATH

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    demo = json.loads((DEMO_MODEL_PATH / "config.json").read_text())
    fields = dict(SHAPES[shape][1])
    config = transformers.AutoConfig.for_model(
        fields.pop("model_type"),
        **fields,
        vocab_size=demo["vocab_size"],
        bos_token_id=demo["bos_token_id"],
        eos_token_id=demo["eos_token_id"],
        pad_token_id=demo["pad_token_id"],
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEMO_MODEL_PATH / name).exists():
            shutil.copy(DEMO_MODEL_PATH / name, out / name)
    return out


def cached_checkpoint(shape: str, *, dtype: str = "bfloat16", seed: int = 0,
                      quantize: str | None = None) -> Path:  # fmt: skip
    """The checkpoint ``shape``, built once under ``~/.cache/iterserve/shapes``."""
    name = f"{shape}-{dtype}-seed{seed}" + (f"-{quantize}" if quantize else "")
    path = Path.home() / ".cache" / "iterserve" / "shapes" / name
    if not (path / "config.json").exists():
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build_checkpoint(shape, partial, dtype=dtype, seed=seed, quantize=quantize)
        partial.rename(path)
    return path


def main(args: argparse.Namespace) -> None:
    if args.list or not args.shape:
        for name, (what, _) in SHAPES.items():
            print(f"{name:12} {what}")
        return
    if not args.out:
        raise SystemExit("--out DIR is required with --shape")
    path = build_checkpoint(args.shape, args.out, dtype=args.dtype, seed=args.seed,
                            quantize=args.quantize, group_size=args.group_size)  # fmt: skip
    print(path)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "checkpoint", help="write a random-weight checkpoint of a named shape (real sizes)"
    )
    p.add_argument("--shape", choices=sorted(SHAPES), help="which shape (--list names them)")
    p.add_argument("--out", help="the checkpoint directory to write")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the weights' dtype")
    p.add_argument("--seed", type=int, default=0, help="the weights' random seed")
    p.add_argument("--quantize", choices=QUANTIZE, metavar="SCHEME",
                   help="quantize the projections by rounding to nearest: w8a8 (int8, "
                        "compressed-tensors), w4a16 (4-bit, groups of --group-size), fp8 "
                        f"(e4m3 per channel); also {', '.join(QUANTIZE[3:])}")  # fmt: skip
    p.add_argument("--group-size", type=int, default=128,
                   help="inputs a scale covers in the grouped schemes (w4a16, gptq, awq)")  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the shapes and stop")
    p.set_defaults(func=main)
    return p
