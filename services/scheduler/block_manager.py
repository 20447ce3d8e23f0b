"""The paged KV cache's block bookkeeping, scheduler side (no I/O, no tensors).

``BlockPool`` holds one executor group's physical blocks: refcounts, a free queue in LRU
order, and the prefix-cache map from a full block's key (``block_hash.py``: a sha256 digest
chained through the prefix) to the block holding that content.
``KVCacheManager`` maps requests to blocks: ``get_computed_blocks`` finds the longest cached
prefix of full blocks, ``allocate_slots`` grows a request's block table to hold its next
tokens or returns ``None`` when the pool is short, ``allocate_running`` does the same for a
running request after ``copy_on_write`` gives it its own copy of a shared partial block, and
``fork`` shares a request's blocks with a child (n > 1).
Design after vLLM V1's ``BlockPool`` / ``KVCacheManager`` (automatic prefix caching,
hash-chained full blocks, LRU eviction of freed cached blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.scheduler.block_hash import ROOT_PARENT, BlockHash, chain, encode_extra_keys, pack_token_ids
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Physical blocks ``0..num_blocks-1`` of one group.

    A block is *free* when its refcount is 0; free blocks wait in ``free_queue`` in the order
    they were freed (least recently used first). A free block may still hold cached content
    (it stays in ``cached``) until it is allocated again, which evicts it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a cache hit or a fork)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each), evicting their cached content (LRU first).

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail
        (pass the blocks tail first, so a prefix's last blocks are evicted before its first)."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` holds the content keyed by ``block_hash`` (first one wins)."""
        if block_hash in self.cached or self.block_hash[block_id] is not None:
            return
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash


class KVCacheManager:
    """Block tables of the requests placed on one executor group.

    Args:
        num_blocks: blocks in the group's pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks across requests by content.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of them, found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover ``num_full_blocks`` full blocks."""
        hashes = request.block_hashes.setdefault(self.block_size, [])
        first = len(hashes)
        if first >= num_full_blocks:
            return hashes
        # the new blocks' tokens packed in one call; each block's key is hash_block's
        bs = self.block_size
        packed = pack_token_ids(request.all_token_ids[first * bs : num_full_blocks * bs])
        extra_keys = encode_extra_keys(request.cache_extra_keys)
        parent = hashes[-1] if hashes else ROOT_PARENT
        width = 8 * bs
        for start in range(0, len(packed), width):
            parent = chain(parent, extra_keys, packed[start : start + width])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        At least the last block holding the request's last known token is left to compute,
        so the step that computes it yields logits and never writes into a shared block.
        Looks only; nothing changes.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (for the statistics)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's block table to hold ``num_computed_tokens + num_new_tokens``.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, for a request being admitted)
        are appended first; ``request.num_computed_tokens`` must already count them.

        Returns:
            The newly allocated block ids (possibly empty), or ``None`` when the pool has
            too few free blocks; then nothing changes.
        """
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(request.block_ids) - len(computed_blocks)
        reviving = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if max(need, 0) + reviving > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        request.block_ids.extend(new)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return new

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` in the prefix cache.

        Safe before the step runs: a group's steps run one after another, and within a
        step every sequence's K/V is written before any attention reads it.
        """
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[i], hashes[i])
        request.num_cached_blocks = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (refcounts), e.g. for n > 1 samples."""
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = {bs: list(h) for bs, h in parent.block_hashes.items()}

    def allocate_running(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[int], tuple[int, int] | None] | None:
        """Blocks for a running request's next ``num_new_tokens``: first its own copy of the
        shared, partially filled block it would write into (a sample of an n > 1 request,
        forked with its parent's blocks; :meth:`copy_on_write`), then :meth:`allocate_slots`.

        Returns:
            ``(new block ids, (src, dst) or None)``: the blocks appended to its table and the
            copy the executor makes before the step, if one was needed; or ``None`` when the
            pool has too few free blocks for both, and then nothing changes.
        """
        copy_needed = self._shared_partial_block(request, num_new_tokens) is not None
        extra = max(self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids), 0)
        if copy_needed and 1 + extra > self.num_free_blocks:
            return None
        copy = self.copy_on_write(request, num_new_tokens) if copy_needed else None
        new = self.allocate_slots(request, num_new_tokens)
        if new is None:  # never after a copy: the pool had room for both
            return None
        return new, copy

    def _shared_partial_block(self, request: Request, num_new_tokens: int) -> int | None:
        """The index in the request's block table of the partially filled block its next
        tokens would write into, if another request shares it; else None."""
        if num_new_tokens <= 0 or request.num_computed_tokens % self.block_size == 0:
            return None
        idx = request.num_computed_tokens // self.block_size
        if idx >= len(request.block_ids) or self.pool.ref_counts[request.block_ids[idx]] <= 1:
            return None
        return idx

    def copy_on_write(self, request: Request, num_new_tokens: int) -> tuple[int, int] | None:
        """Before writing into a shared, partially filled block: give the request its own copy.

        Returns:
            ``(src, dst)`` block ids to copy (the executor copies K/V before the step), or
            ``None`` if no copy is needed. Raises ``ValueError`` when no block is free
            (callers check ``num_free_blocks`` first).
        """
        idx = self._shared_partial_block(request, num_new_tokens)
        if idx is None:
            return None
        src = request.block_ids[idx]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        request.block_ids[idx] = dst
        return src, dst

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (finish, abort or preemption)."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_cached_blocks = 0
