"""The model runner: one :class:`StepPlan` in, one :class:`StepResult` out.

On a GPU a step waits on the device once: when the sampled tokens come back.
Its inputs cross in one copy from a pinned buffer, decode steps replay a
captured CUDA graph (:mod:`.graphs`) and the forward is timed with events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..kernels import get_ops
from ..kernels.cpu import isa
from ..kernels.cpu.linear import packs_every_batch
from ..scheduler.messages import FinishedSeq, SampledToken, ScheduledSeq, StepPlan, StepResult
from ..scheduler.request import FinishReason
from ..scheduler.seq_table import PlanMismatchError, SeqState, SequenceTable
from .batch import INDEX_DTYPE, HostBatch, Staging, layout_batch, to_device
from .config import ModelConfig
from .dtype import RuntimeChoices, decide
from .graphs import DEFAULT_BATCH_SIZES, CudaGraph, DecodeGraphs, EagerReplay
from .kv_cache import KVCache
from .model import AllReduce, Decoder, rope_table
from .prompt_logprobs import PromptLogprobsCollector
from .quant import resolve as resolve_quantization
from .sampler import Sampler, SamplerOutput
from .step_params import DraftRow, SampleRow

if TYPE_CHECKING:
    from .draft import DraftModel
    from .grammar import Grammars
    from .lora_batch import LoraSlots
    from .pooling import Pooler

logger = logging.getLogger(__name__)

# The graphs' block tables are this wide unless max_model_len says otherwise: each
# replayed step copies bucket x width ids, so a 128k-position model's full width
# would cost 32 KB per row per step for sequences that rarely need it.
GRAPH_MAX_LEN = 8192
# The cpu backend keeps a oneDNN copy of the matrix products' fp32 weights
# (Decoder.pack_weights) for models up to this size: the copy doubles their
# memory, and a model past it is bound by reading its weights, which the layout
# does not change. bf16 weights are always packed: their plain copies are let go.
PACK_WEIGHTS_MAX_BYTES = 2 << 30


class ModelRunner:
    """Runs a checkpoint of a supported architecture over a paged KV cache, step by step.

    Every tensor-parallel rank runs one runner with the same plans; all ranks
    compute the same logits and, with the same ``seed``, sample the same tokens,
    so their sequence tables agree. By convention only rank 0's result is read.

    ``cuda_graphs``: ``None`` captures decode graphs when the Triton kernels run
    on CUDA with one rank; ``True`` forces them (off a GPU, replays rerun the
    captured step eagerly, which tests the static buffers); ``False`` never.
    ``graph_batch_sizes`` are the buckets.

    ``max_model_len`` is the context the engine serves (None: the checkpoint's,
    ``max_position_embeddings``): it picks a ``longrope`` model's factors, the
    long ones past its original context (:func:`.model.rope_table`, here and in
    the draft model), and it is the longest sequence a graph takes (at most
    ``GRAPH_MAX_LEN`` when None); a step with a longer one runs eagerly.

    ``batch_invariant``: a runner on its own computes every row apart from its
    batch (an engine's runners are told so by ``choices``; docs/model-runtime.md,
    "Reproducible outputs"). ``quantization``: a runner on its own serves the
    checkpoint's quantization (None) or this one (:func:`.quant.resolve`).
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
        *,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        max_model_len: int | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        draft_model: str | Path | None = None,
        pooling: str | None = None,
        choices: RuntimeChoices | None = None,
        batch_invariant: bool = False,
        quantization: str | None = None,
    ):
        # Imported here: reading checkpoints needs safetensors, the rest of the runtime does not.
        from .checkpoint import load_checkpoint

        ckpt = load_checkpoint(model_path)
        device = torch.device(device)
        self.tokenizer_path = Path(model_path)  # grammars read the checkpoint's tokenizer
        self.generation_config = ckpt.generation_config
        # An engine's ranks are handed their choices (its rank 0 made them); a runner
        # on its own makes them.
        if choices is None:
            choices = decide(ckpt.config, dtype, ckpt.config.torch_dtype, device,
                             kernel_backend, tp_size=tp_size,
                             batch_invariant=batch_invariant,
                             quantized=resolve_quantization(quantization, ckpt.quantization))  # fmt: skip
        logger.info("rank %d computes in %s (%s) at %s%s", tp_rank, choices.dtype,
                    choices.dtype_reason, choices.isa,
                    f", weights {choices.quantization}" if choices.quantization else "")  # fmt: skip
        self._build(
            ckpt.config, choices, device, tp_rank, tp_size, all_reduce, kernel_backend,
            num_kv_blocks, block_size, ckpt.eos_token_ids, max_model_len, weights=ckpt,
        )  # fmt: skip
        ckpt.close()
        self.enable_lora(max_loras, max_lora_rank, max_cpu_loras)
        self.enable_draft(draft_model, max_model_len)
        self.enable_pooling(pooling)
        self._start(seed, cuda_graphs, graph_batch_sizes, max_model_len)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        num_kv_blocks: int,
        block_size: int = 16,
        kernel_backend: str = "auto",
        seed: int = 0,
        weight_seed: int = 0,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        max_model_len: int | None = None,
        tokenizer_path: str | Path | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        batch_invariant: bool = False,
    ) -> ModelRunner:
        """A runner of ``config``'s shape with random weights drawn on the device:
        for benchmarks and device checks, where a checkpoint would only cost load time.
        ``tokenizer_path``: where grammars find a tokenizer (none: no grammars)."""
        runner = cls.__new__(cls)
        runner.generation_config = {}
        runner.tokenizer_path = tokenizer_path
        eos = frozenset(config.eos_token_ids)
        choices = RuntimeChoices(str(dtype).removeprefix("torch."), "configured", isa.level(),
                                 batch_invariant=batch_invariant)  # fmt: skip
        runner._build(config, choices, torch.device(device), 0, 1, None, kernel_backend,
                      num_kv_blocks, block_size, eos, max_model_len, weights=None,
                      weight_seed=weight_seed)  # fmt: skip
        runner.enable_lora(max_loras, max_lora_rank, max_cpu_loras)
        runner.enable_draft(None)
        runner.enable_pooling(None)
        runner._start(seed, cuda_graphs, graph_batch_sizes, max_model_len)
        return runner

    def _build(self, config, choices, device, tp_rank, tp_size, all_reduce, kernel_backend,
               num_kv_blocks, block_size, eos_token_ids, max_model_len, *, weights,
               weight_seed=0) -> None:  # fmt: skip
        if tp_size > 1 and all_reduce is None:
            raise ValueError("tp_size > 1 needs an all_reduce callable")
        self.config = c = config
        self.device = device
        self.choices = choices
        self.dtype = choices.torch_dtype
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.ops = get_ops(kernel_backend, self.device, invariant=choices.batch_invariant)
        if choices.batch_invariant and self.device.type == "cuda":
            from ..kernels import triton_matmul  # cuBLAS picks its kernels by the batch

            triton_matmul.enable()
        self.block_size = block_size
        # fp32 table regardless of model dtype: the kernels rotate in fp32. Every rank
        # builds it from the same max_model_len, so all take the same longrope factors.
        self.model = Decoder(
            c,
            self.ops,
            rope_table(c, max_model_len),
            dtype=self.dtype,
            device=self.device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            all_reduce=all_reduce,
            max_model_len=max_model_len,
        )
        if weights is not None:
            self.model.load_weights(weights, choices.quantization)
        else:
            self.model.init_random_(weight_seed)
        if self.ops.name == "cpu":
            size = sum(p.numel() * p.element_size() for p in self.model.parameters())
            invariant = choices.batch_invariant  # its products must be packed, whatever the size
            if size <= PACK_WEIGHTS_MAX_BYTES or packs_every_batch(self.dtype) or invariant:
                packed = self.model.pack_weights(choices.pads_cliff, invariant)
                if invariant and not packed:
                    raise ValueError(
                        f"batch_invariant: this build of torch cannot pack {self.dtype} weights "
                        "for oneDNN, whose fixed row blocks the mode's products run on"
                    )
        self.kv_cache = KVCache.allocate(
            c.num_layers,
            num_kv_blocks,
            block_size,
            self.model.tp.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
        )
        self.model.bind_kv_cache(self.kv_cache)
        self.eos_token_ids = eos_token_ids
        pad = c.pad_token_id
        self.pad_token_id = pad if pad is not None and pad < c.vocab_size else 0

    def enable_lora(self, max_loras: int, max_lora_rank: int = 16,
                    max_cpu_loras: int | None = None) -> None:  # fmt: skip
        """Gives the runner ``max_loras`` adapter slots (0: none, adapters refused);
        plans load adapters into them and name each sequence's (:mod:`.lora`)."""
        self.lora_slots: LoraSlots | None = None
        self.lora_context = None
        if max_loras <= 0:
            return
        from .lora_batch import LoraSlots

        self.lora_context = self.model.enable_lora()
        self.lora_slots = LoraSlots(
            self.config, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras or max_loras, tp_rank=self.tp_rank,
            tp_size=self.tp_size, dtype=self.dtype, device=self.device,
            cpu_kernel=self.ops.name == "cpu",
        )  # fmt: skip

    def enable_draft(self, path: str | Path | None, max_model_len: int | None = None) -> None:
        """Loads the draft model of speculative decoding (:mod:`.draft`); None: plans
        name their proposals or have none. ``max_model_len``: the context served (None:
        the target's), which picks a longrope draft's factors as it does the target's."""
        self.drafter: DraftModel | None = None
        if path is None:
            return
        from .draft import DraftModel

        self.drafter = DraftModel(
            path, ops=self.ops, dtype=self.dtype, device=self.device,
            num_kv_blocks=self.kv_cache.num_blocks, block_size=self.block_size,
            pad_token_id=self.pad_token_id,
            max_model_len=max_model_len or self.config.max_model_len,
        )  # fmt: skip

    def enable_pooling(self, pooling_type: str | None) -> None:
        """Makes this a pooling runner (``LAST`` or ``MEAN``; None: a generating one):
        its sequences compute their prompts only, and the step hands back each
        completed prompt's final hidden states pooled (:mod:`.pooling`), not tokens."""
        self.pooler: Pooler | None = None
        if pooling_type is not None:
            from .pooling import Pooler

            self.pooler = Pooler(pooling_type)
        self.model.returns_hidden = self.pooler is not None

    def _start(self, seed, cuda_graphs, graph_batch_sizes, max_model_len) -> None:
        self.sampler = Sampler(self.eos_token_ids, self.device, seed=seed)
        # Each sequence's state on this rank is its SeqState (tokens, blocks, its
        # token-count row, grammar matcher, pending prompt logprobs); what it holds
        # outside itself, its token-count row, goes back as it leaves.
        self.table = SequenceTable(
            self.eos_token_ids,
            on_forget=self.sampler.release,
            kv_window=self.config.kv_window,
            block_size=self.block_size,
            drafts=self.drafter is not None,
        )
        # Structured outputs' state: made with the first grammar, which is also when
        # xgrammar and the tokenizer are first imported (a runner without grammars
        # needs neither: the device image has torch and triton only).
        self.grammars: Grammars | None = None
        # Only rank 0's result is read: the other ranks need not compute them.
        self.prompt_logprobs = PromptLogprobsCollector(enabled=self.tp_rank == 0)
        on_gpu = self.device.type == "cuda"
        self.staging = Staging(self.device) if on_gpu else None
        self.timer = ForwardTimer(self.device)
        if cuda_graphs is None:  # graphs replay the base model's decodes only
            cuda_graphs = (on_gpu and self.ops.name == "triton" and self.tp_size == 1
                           and self.lora_slots is None and self.pooler is None)  # fmt: skip
        self.graphs = None
        if cuda_graphs:
            positions = self.model.cos_sin.shape[0]
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                batch_sizes=graph_batch_sizes,
                max_seq_len=min(max_model_len or GRAPH_MAX_LEN, positions),
                pad_token_id=self.pad_token_id,
                capture=CudaGraph if on_gpu else EagerReplay,
            )
            self.graphs.capture()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        """Applies ``plan``, runs one forward over all its rows and samples."""
        for new in plan.new_seqs:
            bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PlanMismatchError(
                    f"{new.label}: token id {bad[0]} outside the vocabulary of {self.vocab_size}"
                )
        if plan.adapter_loads:
            if self.lora_slots is None:
                raise PlanMismatchError("the plan loads LoRA adapters; this runner has no slots")
            for load in plan.adapter_loads:
                self.lora_slots.load(load.slot, load.adapter_id, load.path)
        plan = self.table.apply(plan)
        for new in plan.new_seqs:
            self._register(self.table.get(new.slot_idx))
        if self.drafter is not None:
            plan = self.drafter.propose(plan, self.table)
        segments: list[tuple[int, int, int]] = []
        if self.lora_slots is not None:
            plan, segments = self._by_adapter(plan)
        result = StepResult(
            step=plan.step,
            num_tokens=plan.num_tokens,
            num_padding_tokens=plan.num_padding_tokens,
        )
        if not plan.scheduled and not plan.padding_slots:
            return result

        host = layout_batch(
            plan,
            self.table,
            block_size=self.block_size,
            scratch_block=self.kv_cache.scratch_block,
            pad_token_id=self.pad_token_id,
            max_position=self.model.cos_sin.shape[0],
        )
        prompt_rows = self.prompt_logprobs.rows(plan, self.table)
        if prompt_rows is not None:  # their logits follow the sampled and padding rows
            extra = torch.tensor(prompt_rows.rows, dtype=host.logits_indices.dtype)
            host.logits_indices = torch.cat([host.logits_indices, extra])
        if self.pooler is not None:  # the rows it pools: their hidden states come back
            host.logits_indices = self.pooler.rows(plan.scheduled).to(host.logits_indices.dtype)
        self.timer.start()
        if segments:
            self.lora_context.batch = self.lora_slots.batch(segments)
        try:
            # A graph's logits rows are the sampled and padding rows: prompt rows run eagerly.
            logits = self.forward(host, replay=prompt_rows is None)  # [num_logits, vocab]
        finally:
            if segments:
                self.lora_context.batch = None
        self.timer.stop()

        for entry in plan.scheduled:
            self.table.advance(entry)
        if prompt_rows is not None:
            self.prompt_logprobs.take(logits[-len(prompt_rows.rows) :], prompt_rows)
        if self.pooler is not None:  # hidden states, not logits; its prompts end below
            result.pooled = self.pooler.take(logits, plan.scheduled, self.table)
        self._sample(logits, host.sample_entries, result)
        result.forward_s = self.timer.seconds()
        return result

    def _by_adapter(self, plan: StepPlan) -> tuple[StepPlan, list[tuple[int, int, int]]]:
        from .lora_batch import order_by_adapter

        return order_by_adapter(plan, self.table)

    def _register(self, seq: SeqState) -> None:
        if seq.params.structured_output is not None:
            if self.grammars is None:
                from .grammar import Grammars

                self.grammars = Grammars(
                    self.tokenizer_path, self.config.vocab_size, self.eos_token_ids
                )
            self.grammars.add(seq)
        self.prompt_logprobs.add(seq)

    def _sample(
        self, logits: torch.Tensor, entries: list[ScheduledSeq], result: StepResult
    ) -> None:
        """Samples a token for each of ``entries`` (they own the logits rows in order:
        one each, ``1 + k`` for an entry with ``k`` proposals, which keeps those its
        samples confirm); a sequence whose ``max_tokens`` is 0 ends instead, now
        that its prompt is in."""
        seqs = [self.table.get(e.slot_idx) for e in entries]
        for seq in seqs:
            prompt = self.prompt_logprobs.pop(seq)
            if prompt is not None:
                result.prompt_logprobs.append(prompt)
        rows: list[SampleRow] = []  # one per sampled logits row
        spans: list[tuple[ScheduledSeq, SeqState, int]] = []  # entry, its sequence, first row
        drawn: list[int] = []  # the logits rows sampled
        logits_row = 0
        for entry, seq in zip(entries, seqs):
            num_rows = 1 + entry.num_draft_tokens
            if seq.params.max_tokens == 0:
                result.finished.append(self.table.end(seq.slot_idx, FinishReason.LENGTH))
            elif self.pooler is not None:  # its rows are hidden states: nothing to sample
                logger.error("%s: a pooling runner computes prompts only; ending it", seq.label)
                result.finished.append(self.table.end(seq.slot_idx, FinishReason.ERROR))
            else:
                spans.append((entry, seq, len(rows)))
                drawn.extend(range(logits_row, logits_row + num_rows))
                if num_rows == 1:
                    rows.append(seq)
                else:  # each row samples with the proposals before it as its history
                    base = entry.start_pos + 1
                    rows.extend(DraftRow(seq, base + i) for i in range(num_rows))
            logits_row += num_rows
        if not rows:
            return
        if len(drawn) < logits_row:
            logits = logits[torch.tensor(drawn, dtype=torch.long, device=logits.device)]
        grammars, grammar = self.grammars, None
        if grammars is not None and any(row.grammar is not None for row in rows):
            grammar = grammars.fill(rows)
        out = self.sampler(logits[: len(rows)], rows, grammar)  # waits for the tokens
        for entry, seq, first in spans:
            if entry.num_draft_tokens:
                self._take_drafts(entry, seq, out, first, result)
                continue
            token = out.token_ids[first]
            result.sampled.append(
                SampledToken(seq.seq_id, token, out.logprobs[first], out.top_logprobs[first])
            )
            finished = self._append(seq, token)
            if finished is not None:
                result.finished.append(finished)

    def _take_drafts(self, entry: ScheduledSeq, seq: SeqState, out: SamplerOutput, first: int,
                     result: StepResult) -> None:  # fmt: skip
        num_rows = 1 + entry.num_draft_tokens
        sampled = out.token_ids[first : first + num_rows]
        num_kept, finished = self.table.take_drafts(entry, sampled)
        for i in range(first, first + num_kept):
            result.sampled.append(
                SampledToken(seq.seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
            )
        if finished is not None:
            result.finished.append(finished)

    def _append(self, seq: SeqState, token: int) -> FinishedSeq | None:
        """Records a sampled token; a sequence with a grammar also advances its matcher
        (or, while its grammar waits for its start, looks for it), and ends when the
        grammar does (its EOS, even where ``ignore_eos`` or ``min_tokens`` would go
        on) or cannot go on (it refused the token)."""
        if self.grammars is None or seq.grammar is None:
            return self.table.append_token(seq.slot_idx, token)
        if not self.grammars.accept(seq, token):
            logger.error("%s: its grammar refused token %d; ending it", seq.label, token)
            seq.token_ids.append(token)
            return self.table.end(seq.slot_idx, FinishReason.ERROR)
        finished = self.table.append_token(seq.slot_idx, token)
        if finished is None and self.grammars.done(seq):
            finished = self.table.end(seq.slot_idx, FinishReason.EOS)
        return finished

    def warm_up(self) -> None:
        """Runs a two-token prompt piece, then one decode row, through the model on
        the scratch block, so every kernel a CPU step runs is built here (the cpu
        backend's numba kernels compile, or load from numba's disk cache: ~8 s cold
        on a 2-core machine) instead of in the first request. No sequence state
        changes: the scratch block is where padding rows write anyway. CPU ranks of
        one only (more ranks would have to warm up in step)."""
        if self.device.type != "cpu" or self.tp_size > 1:
            return
        bs, scratch = self.block_size, self.kv_cache.scratch_block
        for q_len, seq_len in ((2, 2), (1, 3)):
            positions = torch.arange(seq_len - q_len, seq_len, dtype=INDEX_DTYPE)
            host = HostBatch(
                input_ids=torch.full((q_len,), self.pad_token_id, dtype=INDEX_DTYPE),
                positions=positions,
                slot_mapping=scratch * bs + positions % bs,
                logits_indices=torch.tensor([q_len - 1], dtype=INDEX_DTYPE),
                seq_lens=torch.tensor([seq_len], dtype=INDEX_DTYPE),
                query_start_loc=torch.tensor([0, q_len], dtype=INDEX_DTYPE),
                block_tables=torch.full((1, -(-seq_len // bs)), scratch, dtype=INDEX_DTYPE),
                sample_entries=[],
                max_query_len=q_len,
                max_seq_len=seq_len,
            )
            self.forward(host, replay=False)

    def forward(self, host: HostBatch, replay: bool = True) -> torch.Tensor:
        """Logits of ``host``'s logits rows: a graph replay when one fits (and
        ``replay``), else eager."""
        graphs = self.graphs
        if replay and graphs is not None and graphs.replayable(host):
            return graphs.run(host)
        batch = to_device(host, self.device, self.staging)
        return self.model(batch.input_ids, batch.attn, batch.logits_indices)


class ForwardTimer:
    """Times the forward without a wait of its own: on CUDA two events, read after
    the step's one wait (the sampled tokens), on the CPU the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self._end.synchronize()  # already done when the tokens have come back
            return self._start.elapsed_time(self._end) / 1000.0
        return self._t1 - self._t0
