"""Chained block hashes and the cache key that decides which requests may share computed KV.

A full block's hash covers its parent block's hash, its position in the chain, its exact token ids
and the cache key: the model fingerprint (weights identity, dtype, RoPE settings), the adapter and
the tenant's cache salt. Equal hashes therefore mean the same tokens at the same positions under the
same computation, inside one access boundary; the block pool also compares token ids on lookup so a
hash collision can never hand out wrong K/V.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheKey:
    model_fingerprint: str
    adapter_id: str | None = None
    cache_salt: str | None = None

    def digest(self) -> bytes:
        # repr() of None differs from any string, so "no salt" never equals a salt spelled "None".
        text = repr((self.model_fingerprint, self.adapter_id, self.cache_salt))
        return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class BlockIdentity:
    """What a cached block holds: checked on every lookup, not only its hash."""

    hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]


def block_identity(parent: bytes | None, key_digest: bytes, index: int, token_ids: list[int]) -> BlockIdentity:
    digest = hashlib.sha256()
    digest.update(parent or b"\0" * 32)
    digest.update(key_digest)
    digest.update(index.to_bytes(8, "little"))
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return BlockIdentity(digest.digest(), parent, tuple(token_ids))


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], num_full_blocks: int, block_size: int, key_digest: bytes
) -> None:
    """Append hashes for full blocks len(hashes) .. num_full_blocks-1 of token_ids (in place)."""
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[index - 1] if index else None
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(block_identity(parent, key_digest, index, tokens).hash)


def identity_at(hashes: list[bytes], token_ids: list[int], index: int, block_size: int) -> BlockIdentity:
    """The identity of full block `index`, from hashes already computed by extend_block_hashes."""
    tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
    return BlockIdentity(hashes[index], hashes[index - 1] if index else None, tokens)
