"""The model runner: one :class:`StepPlan` in, one :class:`StepResult` out."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from iterserve.kernels import build_cos_sin_cache, get_ops
from iterserve.scheduler.messages import SampledToken, StepPlan, StepResult
from iterserve.scheduler.seq_table import PlanMismatchError, SequenceTable
from iterserve.workers.batch import build_batch
from iterserve.workers.checkpoint import load_checkpoint, resolve_dtype
from iterserve.workers.kv_cache import KVCache
from iterserve.workers.model import AllReduce, LlamaModel
from iterserve.workers.sampler import Sampler


class ModelRunner:
    """Runs a Llama-family checkpoint over a paged KV cache, step by step.

    Every tensor-parallel rank runs one runner with the same plans; all ranks
    compute the same logits and, with the same ``seed``, sample the same tokens,
    so their sequence tables agree. By convention only rank 0's result is read.
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype = "auto",
        num_kv_blocks: int = 512,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
        kernel_backend: str = "auto",
        seed: int = 0,
    ):
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce callable")
        ckpt = load_checkpoint(model_path)
        self.config = ckpt.config
        self.generation_config = ckpt.generation_config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.ops = get_ops(kernel_backend, self.device)
        self.block_size = block_size
        c = self.config
        # fp32 table regardless of model dtype: the kernels rotate in fp32.
        cos_sin = build_cos_sin_cache(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling
        )
        self.model = LlamaModel(
            c,
            self.ops,
            cos_sin,
            dtype=self.dtype,
            device=self.device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            all_reduce=all_reduce,
        )
        self.model.load_weights(ckpt)
        ckpt.close()
        self.kv_cache = KVCache.allocate(
            c.num_layers,
            num_kv_blocks,
            block_size,
            self.model.tp.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
        )
        self.eos_token_ids = ckpt.eos_token_ids
        self.table = SequenceTable(self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, self.device, seed=seed)
        pad = c.pad_token_id
        self.pad_token_id = pad if pad is not None and pad < c.vocab_size else 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        """Applies ``plan``, runs one forward over all its rows and samples."""
        for slot in plan.released_slots:
            seq = self.table.by_slot.get(slot)
            if seq is not None:
                self.sampler.forget(seq.seq_id)
        for new in plan.new_seqs:
            bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PlanMismatchError(
                    f"{new.request_id}: token id {bad[0]} outside the vocabulary "
                    f"of {self.vocab_size}"
                )
        plan = self.table.apply(plan)
        result = StepResult(
            step=plan.step,
            num_tokens=plan.num_tokens,
            num_padding_tokens=plan.num_padding_tokens,
        )
        if not plan.scheduled and not plan.padding_slots:
            return result

        batch = build_batch(
            plan,
            self.table,
            block_size=self.block_size,
            scratch_block=self.kv_cache.scratch_block,
            pad_token_id=self.pad_token_id,
            max_position=self.model.cos_sin.shape[0],
            device=self.device,
        )
        start = time.perf_counter()
        logits = self.model(
            batch.input_ids, batch.positions, batch.attn, self.kv_cache, batch.logits_indices
        )  # [num_logits, vocab]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.forward_s = time.perf_counter() - start

        for entry in plan.scheduled:
            self.table.advance(entry)
        rows = [self.table.get(e.slot_idx) for e in batch.sample_entries]
        if not rows:
            return result
        out = self.sampler(logits[: len(rows)], rows)
        for i, seq in enumerate(rows):
            token = out.token_ids[i]
            result.sampled.append(
                SampledToken(
                    seq_id=seq.seq_id,
                    token_id=token,
                    logprob=out.logprobs[i],
                    top_logprobs=out.top_logprobs[i],
                )
            )
            finished = self.table.append_token(seq.slot_idx, token)
            if finished is not None:
                result.finished.append(finished)
                self.sampler.forget(finished.seq_id)
        return result
