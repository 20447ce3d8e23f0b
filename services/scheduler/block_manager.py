"""The paged KV cache's block bookkeeping, scheduler side (no I/O, no tensors).

``BlockPool`` holds one executor group's physical blocks: a free queue and a refcount per
block. ``KVCacheManager`` maps requests to blocks: ``allocate_slots`` grows a request's
block table to hold its next tokens, or returns ``None`` when the pool is short (vLLM V1's
``KVCacheManager.allocate_slots`` contract).
"""

from __future__ import annotations

from collections import deque

from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Physical blocks ``0..num_blocks-1`` of one group, with refcounts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each).

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free queue."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Block tables of the requests placed on one executor group."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow ``request.block_ids`` to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns:
            The newly appended block ids (possibly empty), or ``None`` if the pool has too
            few free blocks; then nothing changes.
        """
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(request.block_ids)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(need)
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (finish, abort or preemption)."""
        # Free in reverse so that the tail blocks (least likely shared) are reused last.
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
