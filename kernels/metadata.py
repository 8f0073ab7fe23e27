"""What a step's attention reads besides the layer's own tensors, built once a step.

The rank lays a step's rows out as one flat batch (``workers/batch.py``); how
that batch splits into sequences is this record, handed to every layer. A
backend may derive what its kernels read from it once a step
(``KernelOps.prepare``, kept in ``host``): the cpu backend's arrays of rows,
tables and pieces (:mod:`.cpu.plan`); the Triton and torch backends read the
tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """How the flat batch splits into sequences."""

    positions: torch.Tensor  # [num_tokens], each row's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens], block_id * block_size + offset; < 0: not stored
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs], KV length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    # Host-side bounds the Triton kernels choose their launches by (no sync): the
    # longest query piece and the longest sequence; None = infer from shapes.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    # What the backend derived from the above for its kernels, once this step.
    host: Any = None
