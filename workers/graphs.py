"""CUDA graphs for decode steps, one per batch-size bucket.

An eager decode step launches ~10 kernels per layer, each with Python-side
argument handling; for an 8B model that is ~330 launches and, at small
batches, more host time than GPU time. A decode step (every sequence one query
row) at a fixed number of rows is a fixed sequence of launches, so it is
captured once per *bucket* at start-up and replayed: the step's rows are
padded up to the smallest bucket that holds them.

What a replay reads lives in static buffers, written before each replay::

    device buffer (int32), fixed offsets for the largest bucket B, width W:
    | input_ids[B] | positions[B] | slots[B] | logits_rows[B] | seq_lens[B] | starts[B+1] | tables[B, W] |
      a bucket b < B uses the first b (b + 1, b rows) of each

W is the block table's width for the longest sequence a graph takes (the
runner's ``max_model_len``), so the attention plan (and its split count) is
fixed per bucket; the kernels read each sequence's own length. Padding rows
are one-row sequences at position 0 of the scratch block, as plan padding is
(:mod:`.batch`). Steps with a prefill piece, more rows than the largest bucket
or a longer sequence run eagerly.

The bucket choice, the decision and the padding are plain functions; only
:class:`CudaGraph` needs a GPU. :class:`EagerReplay` stands in for it on the
CPU so the static-buffer path can be tested there.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from ..kernels import AttentionMetadata
from ..scheduler.blocks import blocks_for
from .batch import INDEX_DTYPE, HostBatch, segment_offsets
from .kv_cache import KVCache
from .model import Decoder

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The default buckets up to the first that holds ``max_num_seqs`` rows: no
    graph is captured for a batch the scheduler can never run."""
    kept = [size for size in DEFAULT_BATCH_SIZES if size < max_num_seqs]
    return (*kept, max_num_seqs) if max_num_seqs not in kept else tuple(kept)


def bucket_for(num_rows: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_rows`` rows (``batch_sizes`` sorted)."""
    i = bisect.bisect_left(batch_sizes, num_rows)
    return batch_sizes[i] if i < len(batch_sizes) else None


def replayable(host: HostBatch, batch_sizes: Sequence[int], width: int) -> bool:
    """Whether a captured graph computes ``host``: decode rows only, few enough,
    and every block table fits the graphs' width."""
    return (
        host.num_rows > 0
        and host.max_query_len == 1
        and host.num_seqs == host.num_rows
        and bucket_for(host.num_rows, batch_sizes) is not None
        and host.block_tables.shape[1] <= width
    )


def padded_arrays(host: HostBatch, bucket: int, width: int, scratch_block: int,
                  block_size: int, pad_token_id: int) -> list[torch.Tensor]:  # fmt: skip
    """``host``'s tensors grown to ``bucket`` one-row sequences and ``width`` columns.

    Rows past the step's own are padding: token ``pad_token_id`` at position 0,
    K/V to the scratch block's first slot, one KV position. Their logits rows
    follow the step's own; they are computed and never read."""
    n, s = host.num_rows, host.num_seqs
    extra = bucket - n

    def grow(t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, tail.to(INDEX_DTYPE)])

    def filled(value: int) -> torch.Tensor:
        return torch.full((extra,), value, dtype=INDEX_DTYPE)

    num_logits = host.logits_indices.numel()
    tables = torch.full((bucket, width), scratch_block, dtype=INDEX_DTYPE)
    tables[:s, : host.block_tables.shape[1]] = host.block_tables
    return [
        grow(host.input_ids, filled(pad_token_id)),
        grow(host.positions, filled(0)),
        grow(host.slot_mapping, filled(scratch_block * block_size)),
        grow(host.logits_indices, torch.arange(num_logits, bucket)),
        grow(host.seq_lens, filled(1)),
        grow(host.query_start_loc, n + 1 + torch.arange(extra)),
        tables,
    ]


class CudaGraph:
    """``fn`` captured into a CUDA graph after one warm-up run (which compiles the
    Triton kernels and lets cuBLAS pick its algorithms outside the capture)."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def pool(self):
        return self.graph.pool()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class EagerReplay:
    """Stands in for :class:`CudaGraph` off the GPU: replaying reruns ``fn`` on the
    same static buffers."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        self.fn = fn

    def pool(self):
        return None

    def replay(self) -> torch.Tensor:
        return self.fn()


class DecodeGraphs:
    """One captured decode step per bucket, sharing one memory pool and one set
    of static input buffers."""

    def __init__(
        self,
        model: Decoder,
        kv_cache: KVCache,
        *,
        batch_sizes: Sequence[int],
        max_seq_len: int,
        pad_token_id: int,
        capture: type = CudaGraph,
    ):
        if not batch_sizes:
            raise ValueError("batch_sizes must not be empty")
        self.model, self.kv_cache = model, kv_cache
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_size = kv_cache.block_size
        self.width = blocks_for(max_seq_len, self.block_size)
        self.pad_token_id = pad_token_id
        self.capture_cls = capture
        device = kv_cache.keys[0].device
        big = self.batch_sizes[-1]
        self._sizes = [big, big, big, big, big, big + 1, big * self.width]
        self._offsets, end = segment_offsets(self._sizes)
        self._pinned = device.type == "cuda"
        self._host = torch.zeros(end, dtype=INDEX_DTYPE, pin_memory=self._pinned)
        self._dev = torch.zeros(end, dtype=INDEX_DTYPE, device=device)
        self._copied = torch.cuda.Event() if self._pinned else None
        self.graphs: dict[int, CudaGraph | EagerReplay] = {}
        self.num_replays = 0

    def replayable(self, host: HostBatch) -> bool:
        return replayable(host, self.batch_sizes, self.width)

    def _views(self, bucket: int) -> list[torch.Tensor]:
        o, buf = self._offsets, self._dev
        views = [buf[o[i] : o[i] + bucket] for i in range(5)]
        views.append(buf[o[5] : o[5] + bucket + 1])
        views.append(buf[o[6] : o[6] + bucket * self.width].view(bucket, self.width))
        return views

    def capture(self) -> None:
        """Captures every bucket, largest first so the smaller ones fit in its pool."""
        none = torch.zeros(0, dtype=INDEX_DTYPE)
        empty = HostBatch(none, none, none, none, none, torch.zeros(1, dtype=INDEX_DTYPE),
                          torch.zeros((0, 1), dtype=INDEX_DTYPE), [], 1, 0)  # fmt: skip
        pool = None
        for bucket in reversed(self.batch_sizes):
            self._load(empty, bucket)  # every row padding: a valid step to warm up on
            graph = self.capture_cls(self._step_fn(bucket), pool)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        if self._pinned:
            torch.cuda.synchronize()

    def _step_fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        ids, positions, slots, rows, seq_lens, starts, tables = self._views(bucket)
        attn = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=starts,
            max_query_len=1,
            max_seq_len=self.width * self.block_size,
        )
        everything = torch.arange(bucket, device=ids.device)  # logits for every row
        return lambda: self.model(ids, attn, everything)

    def _load(self, host: HostBatch, bucket: int) -> list[torch.Tensor]:
        arrays = padded_arrays(host, bucket, self.width, self.kv_cache.scratch_block,
                               self.block_size, self.pad_token_id)  # fmt: skip
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the host buffer is done
        for a, off in zip(arrays, self._offsets):
            self._host[off : off + a.numel()].copy_(a.reshape(-1))
        # Everything up to the bucket's last table row, in one copy.
        end = self._offsets[6] + bucket * self.width
        self._dev[:end].copy_(self._host[:end], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()
        return self._views(bucket)

    def run(self, host: HostBatch, eager: bool = False) -> torch.Tensor:
        """Replays the bucket for ``host`` (``replayable`` must hold); returns
        ``[len(host.logits_indices), vocab]`` logits, the rows ``host`` asked for.
        ``eager``: runs the bucket's step outside its graph instead, with the same
        padding, table width and attention plan (what a replay must reproduce)."""
        bucket = bucket_for(host.num_rows, self.batch_sizes)
        views = self._load(host, bucket)
        if eager:
            logits = self._step_fn(bucket)()
        else:
            logits = self.graphs[bucket].replay()  # [bucket, vocab], one row per input row
            self.num_replays += 1
        num_logits = host.logits_indices.numel()
        if torch.equal(host.logits_indices, torch.arange(num_logits, dtype=INDEX_DTYPE)):
            return logits[:num_logits]
        return logits.index_select(0, views[3][:num_logits])
