"""Content hashes of full KV blocks: the keys of the prefix cache.

Block ``i`` of a sequence holds its tokens ``[i * block_size, (i + 1) * block_size)``,
but its KV depends on every token before it too, so its hash chains from the
hash of block ``i - 1``; the first block chains from a root that carries
whatever else changes the KV (``salt``: a tenant's isolation key, an adapter)::

    root = H("iterserve-kv-1" | salt)
    h[0] = H(root | tokens[0:bs])      h[1] = H(h[0] | tokens[bs:2bs])    ...

Two blocks with equal hashes hold the same KV. Only full blocks are hashed: a
partial last block is never shared. The hash is BLAKE2b-128 over the token ids
as little-endian int64, deterministic across processes and machines (no
Python hash randomization), so a router hashing a prompt with
:func:`prompt_block_hashes` gets exactly the keys the engine caches under.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 16
_VERSION = b"iterserve-kv-1"


def root_hash(salt: str = "") -> bytes:
    """What the first block's hash chains from."""
    return hashlib.blake2b(_VERSION + salt.encode(), digest_size=DIGEST_SIZE).digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    data = array("q", tokens)  # int64: every vocabulary fits
    if sys.byteorder == "big":
        data.byteswap()  # hash the same bytes on every host
    return data.tobytes()


def chain_block_hashes(
    parent: bytes | None, tokens: Sequence[int], block_size: int, salt: str = ""
) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``, the blocks that follow the one
    hashed ``parent`` (None: the first blocks of a sequence)."""
    parent = root_hash(salt) if parent is None else parent
    out = []
    for i in range(len(tokens) // block_size):
        data = parent + _token_bytes(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: str = ""
) -> list[bytes]:
    """Appends to ``hashes`` (the hashes of ``token_ids``' first blocks) the hashes of
    every further full block of ``token_ids``; returns ``hashes``."""
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else None
    hashes.extend(chain_block_hashes(parent, token_ids[start:], block_size, salt))
    return hashes


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, *, salt: str = "", max_blocks: int | None = None
) -> list[bytes]:
    """The hashes of the full blocks of ``token_ids`` (at most ``max_blocks``), as the
    scheduler computes them: a router that sends a prompt to the replica holding
    its first blocks hashes it with this and the engine's ``block_size``."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * block_size]
    return extend_block_hashes([], token_ids, block_size, salt)
