"""The prefix cache's key of a full KV block (no I/O).

A key is a sha256 digest chained through the prefix: ``hash_block(parent key, the block's token
ids, the request's extra keys)``, so it stands for every token up to and including the block,
and for the extra keys (``Request.cache_extra_keys``: a ``cache_salt``), so requests with other
extra keys never share a block. ``BlockPool`` maps key -> block (``block_manager.py``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgpack

BlockHash = bytes  # a full block's prefix-cache key: a sha256 digest (32 bytes)
ROOT_PARENT: BlockHash = bytes(32)  # the parent key of a prefix's first block


def encode_extra_keys(extra_keys: tuple) -> bytes:
    """A request's extra keys (``Request.cache_extra_keys``, e.g. ``(cache_salt,)``) as
    ``hash_block`` takes them: msgpack, whose encoding of a value is self-delimiting.

    Raises:
        TypeError: a key msgpack cannot encode (a salt is a str)."""
    return msgpack.packb(extra_keys)


NO_EXTRA_KEYS = encode_extra_keys(())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = NO_EXTRA_KEYS) -> BlockHash:
    """The prefix-cache key of one full block: sha256 over its parent's key (``ROOT_PARENT``
    for a first block), the encoded extra keys (``encode_extra_keys``) and the token ids as
    little-endian int64s, so a key stands for the whole prefix up to and including this block.

    The bytes hashed are unambiguous (a fixed 32-byte parent, a self-delimiting msgpack value,
    then the tokens), and sha256 has no collision anyone can craft, unlike Python's ``hash()``
    (integers hash modulo 2**61 - 1), which let a crafted prompt take another request's cached
    blocks (vLLM's advisory GHSA-rm76-4mrf-v9r8).

    Raises:
        struct.error: a token id outside int64 (the tokenizer keeps them in the vocabulary).
    """
    return chain(parent, extra_keys, pack_token_ids(token_ids))


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64s (8 bytes each).

    Raises:
        struct.error: a token id outside int64."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def chain(parent: BlockHash, extra_keys: bytes, token_bytes: bytes) -> BlockHash:
    """``hash_block`` of token ids already packed (``pack_token_ids``)."""
    return hashlib.sha256(parent + extra_keys + token_bytes).digest()
