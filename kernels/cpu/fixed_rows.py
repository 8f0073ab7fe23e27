"""Matrix products that sum every row in one order whatever the batch: a
batch-invariant engine's (``batch_invariant``, docs/model-runtime.md,
"Reproducible outputs").

oneDNN chooses its kernel, and with it how each output's sum over the reduced
dimension is blocked, by the number of rows it is asked for, and so does
``F.linear``: the same row comes out with other low bits in a batch of 17 than
alone or in one of 64 (fp32 and bf16, measured on the 144M Llama's weights).
Asked always for the same number of rows, oneDNN runs one kernel, and a row's
sums depend neither on where in the call it sits nor on what the other rows hold
(every position of every row count from 1 to 300, fp32 and bf16, one thread and
two, AMX and AVX-512 BF16: ``tests/kernels/cpu/test_fixed_rows.py``). So, by the
dispatch table's (:mod:`.dispatch`) rows with the ``invariant`` trait:

- ``amx_blocks``: bf16 on CPUs with AMX, on one thread, without a bias:
  :mod:`.amx_linear`'s kernel, whose tiles sum each output over the reduced
  dimension in one order whatever the rows (it takes passes of 32 rows, any
  number of them). Past 64 rows it runs :data:`AMX_ROWS` rows a call, so the rows
  a weight panel meets stay in L2 (the sums are the same): 1024 rows of the 144M
  model's 1024 → 5632 weight 13.4 ms against 15.5 unblocked and oneDNN's 11.2;
  at 64 rows and fewer it is the default mode's kernel.
- ``onednn_blocks``: everything else: oneDNN's product called on blocks of
  exactly :data:`ONEDNN_ROWS` rows, the last one padded with zeros. Fewer rows
  cost the block's: fp32, one thread, the 1024 → 5632 weight in cache, 1 row
  2.8 against 0.9 ms, 32 rows 2.8 against 2.8, 256 rows 23.3 against 19.9
  (64-row blocks: 5.1, 5.1 and 20.7).
"""

from __future__ import annotations

import torch

# oneDNN's products run on blocks of this many rows (see the module docstring).
ONEDNN_ROWS = 32
# The AMX kernel takes at most this many rows a call: 512 KiB of rows of 1024 bf16
# values, which a weight panel's passes then find in L2.
AMX_ROWS = 256


def amx_blocks(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    """``x @ W.T`` on :mod:`.amx_linear`'s kernel for contiguous bf16 ``x`` of any
    number of rows, ``packed`` a ``PackedWeight`` it reads (``packed.amx``)."""
    from . import amx_linear

    x = x.contiguous()
    rows, outputs = x.shape[0], packed.shape[0]
    out = torch.empty((rows, outputs), dtype=torch.bfloat16)
    bits, out_bits = x.view(torch.uint16).numpy(), out.view(torch.uint16).numpy()
    for first in range(0, rows, AMX_ROWS):
        amx_linear._product(bits[first : first + AMX_ROWS], packed.amx,
                            out_bits[first : first + AMX_ROWS])  # fmt: skip
    return out


def onednn_blocks(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` on ``packed.onednn`` (``W`` in oneDNN's layout), as
    calls of exactly :data:`ONEDNN_ROWS` rows each."""
    rows = x.shape[0]
    parts = []
    for first in range(0, max(rows, 1), ONEDNN_ROWS):
        block = x[first : first + ONEDNN_ROWS]
        if block.shape[0] < ONEDNN_ROWS:  # the last block, padded with zero rows
            padded = x.new_zeros(ONEDNN_ROWS, x.shape[1])
            padded[: block.shape[0]] = block
            block = padded
        out = torch.ops.mkldnn._linear_pointwise(block.contiguous(), packed.onednn, bias,
                                                 "none", [], "")  # fmt: skip
        parts.append(out[: rows - first])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# The kernels by their names in the dispatch table.
KERNELS = {"amx_blocks": amx_blocks, "onednn_blocks": onednn_blocks}
