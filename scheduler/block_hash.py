"""Chained content hashes of full KV-cache blocks, the keys of the prefix cache.

A full block's hash covers its parent block's hash, its own token ids and extra keys (such as
a per-request ``cache_salt``), so equal hashes mean equal *prefixes*, not just equal blocks:
``h_i = H(h_{i-1}, tokens[i*B:(i+1)*B], extra_i)``. This is the scheme of vLLM's automatic
prefix caching (vLLM v1 ``kv_cache_utils.hash_block_tokens``; PagedAttention paper, Kwon et
al., SOSP 2023, section 4.4 on shared prefixes).

``H`` is SHA-256 over a stable byte encoding (never Python's ``hash()``, which is salted per
process and only 64 bits wide). A collision is still not trusted: the block pool stores each
cached block's (parent hash, token ids, extra keys) and compares them on every hit, so a hash
collision can cost a cache miss but never share wrong KV.

The cache salt and the KV cache's dtype enter only the first block's extra keys; the chain
carries them to every later block. The dtype is there because a block's bytes mean K/V only
in the dtype they were written in: a bf16 pool and an fp32 pool never share a hash (vLLM
keys its caches by ``cache_dtype`` for the same reason).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block together with its whole prefix."""

_DOMAIN = b"pagedserve.block.v1"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_U32 = struct.Struct("<I")


def extra_keys_for_block(
    block_index: int, cache_salt: str | None, kv_cache_dtype: str = ""
) -> tuple[str, ...]:
    """Extra keys mixed into block ``block_index`` of a sequence.

    Args:
        block_index: logical block index (0 = first block of the sequence).
        cache_salt: optional per-request salt; requests with different salts never share
            blocks. Only block 0 carries it (the chain propagates it).
        kv_cache_dtype: the pool's KV dtype name, ``""`` for none; block 0 carries it as
            ``"kv_dtype=<name>"`` ahead of the salt.

    Returns:
        A tuple of strings (empty when there is nothing extra).
    """
    if block_index != 0:
        return ()
    keys = (f"kv_dtype={kv_cache_dtype}",) if kv_cache_dtype else ()
    return keys if cache_salt is None else (*keys, cache_salt)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
) -> BlockHash:
    """Hash one full block, chained to its parent.

    Encoding (stable across processes and machines): a domain tag, a parent flag byte and the
    parent digest, the token count as uint32 little-endian, every token id as int64
    little-endian, then each extra key as uint32 length + UTF-8 bytes.

    Args:
        parent_hash: hash of the previous block of the sequence, ``None`` for block 0.
        token_ids: the block's token ids (any length; callers pass exactly ``block_size``).
        extra_keys: extra strings that must match for a hit (e.g. the cache salt).

    Returns:
        A 32-byte SHA-256 digest.

    Raises:
        struct.error: a token id outside the int64 range.
    """
    # NOTE: one digest per block that fills: the encoding is joined first and hashed in
    # one call (several update() calls cost more than the copy).
    n = len(token_ids)
    body = struct.pack(f"<I{n}q", n, *token_ids)  # the count, then the ids
    if parent_hash is None:
        head = _DOMAIN + _NO_PARENT
    else:
        head = _DOMAIN + _HAS_PARENT + parent_hash
    if not extra_keys:
        return hashlib.sha256(head + body).digest()
    parts = [head, body]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return hashlib.sha256(b"".join(parts)).digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    cache_salt: str | None = None,
    start_block: int = 0,
    parent_hash: BlockHash | None = None,
    kv_cache_dtype: str = "",
) -> list[BlockHash]:
    """Hashes of full blocks ``start_block .. num_blocks - 1`` of a token sequence.

    Args:
        token_ids: the sequence's tokens; must hold at least ``num_blocks * block_size``.
        block_size: tokens per block.
        num_blocks: index one past the last block to hash.
        cache_salt: per-request salt (enters block 0 only).
        start_block: first block to hash; ``parent_hash`` must then be block
            ``start_block - 1``'s hash (``None`` when ``start_block == 0``).
        parent_hash: see ``start_block``.
        kv_cache_dtype: the pool's KV dtype name (enters block 0 only; ``""``: none).

    Returns:
        ``num_blocks - start_block`` hashes, in block order.
    """
    out: list[BlockHash] = []
    parent = parent_hash
    for i in range(start_block, num_blocks):
        parent = hash_block_tokens(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            extra_keys_for_block(i, cache_salt, kv_cache_dtype),
        )
        out.append(parent)
    return out
