"""Compiles, for sm_90, every Triton kernel variant the runtime launches, and
reports each one's registers and spills. Needs no GPU.

Run as a script with ``TRITON_INTERPRET`` unset (``test_kernel_compile.py``
does). Variants are not listed by hand: a stand-in driver reports an sm_90
target, and the model's forward runs on the *meta* device (shapes, no data)
through the runtime's own code paths (eager steps through the staging buffer,
decode steps through the decode graphs' static buffers) for several model
shapes, dtypes and step kinds. A compile hook records each launch's exact
specialisation (dtypes, constexprs, the divisibility-by-16 attributes of
pointers and integers) instead of compiling; each distinct one is then
compiled to a cubin, with ptxas's own report of registers and spills (Triton
runs ``ptxas -v``; a fresh cache directory makes sure it runs) and
``cuobjdump -res-usage`` on the cubin. Exit status 1 when any variant spills
registers. Output: one JSON object per variant, then a summary line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="iterserve-compile-")

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class _Sm90:
    """Just enough of a driver for the launcher to specialise and stop."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


_seen: dict[str, tuple] = {}


def _record(*, key, repr, fn, compile, **_):
    spec = compile["specialization_data"]
    # The key embeds the JIT function's cache key; the spec alone identifies the variant.
    _seen.setdefault(spec, (fn.jit_function, repr.split("[")[0]))
    return True  # skip compiling and launching


def exercise() -> None:
    from iterserve.kernels import build_cos_sin_cache, checks, get_ops
    from iterserve.scheduler.messages import NewSequence, ScheduledSeq, StepPlan
    from iterserve.scheduler.sampling import SamplingParams
    from iterserve.scheduler.seq_table import SequenceTable
    from iterserve.workers.batch import Staging, layout_batch, to_device
    from iterserve.workers.config import ModelConfig
    from iterserve.workers.graphs import DecodeGraphs, EagerReplay
    from iterserve.workers.kv_cache import KVCache
    from iterserve.workers.model import Decoder

    checks.check_triton_device = lambda *a: None  # meta tensors stand in for CUDA ones
    ops = get_ops("triton")
    meta = torch.device("meta")

    def model_of(hidden, inter, heads, kv_heads, head_dim, tp=1, arch="LlamaForCausalLM",
                 **keys):  # fmt: skip
        """A config.json of ``arch`` with these sizes and ``keys``, one layer unless said."""
        return ModelConfig.from_dict({
            "architectures": [arch], "vocab_size": 1024, "hidden_size": hidden,
            "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "num_hidden_layers": 1,
            **keys,
        }), tp  # fmt: skip

    # A sliding layer and a full one, scores and logits soft-capped at Gemma 2's
    # defaults, GELU, sandwich norms; experts in place of the MLP (Mixtral, Qwen3-MoE).
    gemma = dict(arch="Gemma2ForCausalLM", num_hidden_layers=2, sliding_window=4096,
                 tie_word_embeddings=False)  # fmt: skip
    shapes = {
        "llama3-8b": model_of(4096, 14336, 32, 8, 128),
        "llama2-7b": model_of(4096, 11008, 32, 32, 128),
        "70b-tp8-rank": model_of(8192, 28672, 64, 8, 128, tp=8),
        "qwen2-0.5b": model_of(896, 4864, 14, 2, 64),
        "demo": model_of(256, 704, 4, 2, 64),
        "gemma2-9b": model_of(3584, 14336, 16, 8, 256, **gemma),
        "mixtral-8x7b": model_of(
            4096,
            14336,
            32,
            8,
            128,
            arch="MixtralForCausalLM",
            num_local_experts=8,
            num_experts_per_tok=2,
        ),  # fmt: skip
        "qwen3-30b-a3b": model_of(
            2048,
            6144,
            32,
            4,
            128,
            arch="Qwen3MoeForCausalLM",
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
        ),  # fmt: skip
        # Mixtral's experts are intermediate_size wide.
        "moe-demo": model_of(
            256,
            128,
            4,
            2,
            64,
            arch="MixtralForCausalLM",
            num_local_experts=8,
            num_experts_per_tok=2,
        ),  # fmt: skip
    }
    cases = [
        ("llama3-8b", torch.bfloat16, 16),
        ("llama3-8b", torch.float16, 16),
        ("llama3-8b", torch.bfloat16, 32),
        ("llama2-7b", torch.bfloat16, 16),
        ("70b-tp8-rank", torch.bfloat16, 16),
        ("qwen2-0.5b", torch.bfloat16, 16),
        ("demo", torch.float32, 16),
        ("gemma2-9b", torch.bfloat16, 16),
        ("gemma2-9b", torch.float16, 16),
        ("gemma2-9b", torch.float32, 16),
        ("mixtral-8x7b", torch.bfloat16, 16),
        ("qwen3-30b-a3b", torch.float16, 16),
        ("moe-demo", torch.float32, 16),
    ]
    # A batch-invariant engine's launches: one attention kernel and one split for
    # every row, experts in 16-row blocks (its products are below).
    invariant_cases = [
        ("llama3-8b", torch.bfloat16, 16),
        ("llama3-8b", torch.float16, 16),
        ("gemma2-9b", torch.bfloat16, 16),
        ("demo", torch.float32, 16),
        ("mixtral-8x7b", torch.bfloat16, 16),
    ]
    invariant = get_ops("triton", invariant=True)
    params = SamplingParams(temperature=0.0)
    for ops, name, dtype, block_size in [(ops, *c) for c in cases] + [
        (invariant, *c) for c in invariant_cases
    ]:
        config, tp = shapes[name]
        cos_sin = build_cos_sin_cache(config.head_dim, config.max_position_embeddings, 1e4)
        model = Decoder(config, ops, cos_sin, dtype=dtype, device=meta, tp_size=tp,
                           all_reduce=lambda t: t)  # fmt: skip
        num_blocks = 64 * (8192 // block_size) + 16
        kv = KVCache.allocate(config.num_layers, num_blocks, block_size, model.tp.num_kv_heads,
                              config.head_dim, dtype, meta)  # fmt: skip
        model.bind_kv_cache(kv)

        def step(pieces, kv=kv, block_size=block_size):
            """A plan of (cached, new) pieces over fresh sequences; its host batch."""
            table, scheduled, next_block = SequenceTable(), [], 0
            new = []
            for slot, (cached, n) in enumerate(pieces):
                tokens = [1] * (cached + n)
                new.append(NewSequence(slot, f"s{slot}", slot, tokens, len(tokens), params))
            table.apply(StepPlan(0, new_seqs=new))
            for slot, (cached, n) in enumerate(pieces):
                seq = table.get(slot)
                need = -(-(cached + n) // block_size)
                seq.block_ids = list(range(next_block, next_block + need))
                seq.num_computed_tokens = cached
                next_block += need
                scheduled.append(ScheduledSeq(slot, cached, n, [], sample=True))
            return layout_batch(StepPlan(1, scheduled=scheduled), table, block_size=block_size,
                                scratch_block=kv.scratch_block, pad_token_id=0,
                                max_position=8192)  # fmt: skip

        staging = Staging(meta)
        for pieces in (
            [(8191, 1)],  # one long decode: split
            [(2000, 1)] * 64,  # a wide decode batch: not split
            [(1000, 1)] * 8 + [(300, 512)],  # mixed: decode kernel and prefill kernel
            [(0, 2048)],  # one prefill piece alone
        ):
            b = to_device(step(pieces), meta, staging)
            model(b.input_ids, b.attn, b.logits_indices)
        graphs = DecodeGraphs(model, kv, batch_sizes=(1, 64), max_seq_len=8192,
                              pad_token_id=0, capture=EagerReplay)  # fmt: skip
        graphs.capture()
        for pieces in ([(100, 1)], [(3000, 1)] * 50):
            graphs.run(step(pieces))

    # The batch-invariant engine's fixed-tile products (behind aten's mm and addmm on CUDA).
    from iterserve.kernels import triton_matmul

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.empty(37, 4096, dtype=dtype, device=meta)
        w = torch.empty(1024, 4096, dtype=dtype, device=meta)
        triton_matmul.linear(x, w)
        triton_matmul.linear(x, w, torch.empty(1024, dtype=dtype, device=meta))

    ops = get_ops("triton")
    # The public ops also take int64 metadata (the runtime itself sends int32).
    q = torch.empty(9, 32, 128, dtype=torch.bfloat16, device=meta)
    cache = torch.empty(4096, 16, 8, 128, dtype=torch.bfloat16, device=meta)
    i64 = dict(dtype=torch.int64, device=meta)
    for num_tokens, starts in ((4, [0, 1, 2, 3, 4]), (9, [0, 1, 2, 3, 9])):
        ops.paged_attention(
            q[:num_tokens], cache, cache, torch.empty(4, 256, **i64), torch.empty(4, **i64),
            torch.tensor(starts, **i64), 0.088, max_query_len=num_tokens - 3,
        )  # fmt: skip
    kv = torch.empty(9, 8, 128, dtype=torch.bfloat16, device=meta)
    ops.store_kv(kv, kv, cache, cache, torch.empty(9, **i64))


def res_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))


def ptxas_report(log: str) -> dict[str, int]:
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m is None:
        raise RuntimeError(f"no spill report in the ptxas log:\n{log}")
    return {"spill_stores": int(m.group(1)), "spill_loads": int(m.group(2))}


def main() -> int:
    driver.set_active(_Sm90())
    knobs.runtime.jit_cache_hook = _record
    exercise()
    knobs.runtime.jit_cache_hook = None
    knobs.nvidia.dump_ptxas_log = True
    failures = 0
    for spec, (fn, name) in _seen.items():
        data = json.loads(spec)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = fn.preload(spec)  # compiles for the stand-in driver's sm_90 target
        usage = {**res_usage(kernel.asm["cubin"]), **ptxas_report(log.getvalue())}
        constexprs = {fn.arg_names[k[0]]: v for k, v in zip(data["constant_keys"],
                                                             data["constant_vals"])}  # fmt: skip
        record = {"kernel": name, "signature": data["signature"], "constexprs": constexprs,
                  "num_warps": data["options"]["num_warps"], **usage}  # fmt: skip
        spills = usage["spill_stores"] > 0 or usage["spill_loads"] > 0
        failures += spills
        print(json.dumps({**record, "spills": spills}), flush=True)
    print(json.dumps({"variants": len(_seen), "spilling": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
