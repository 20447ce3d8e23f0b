"""Counting checks that went unanswered in a row, for the liveness watches.

The scheduler pings each gateway and detokenizer shard holding requests, and the engine
client asks the scheduler about requests with no output for a while. Both give a verdict
only after ``limit`` misses in a row: one miss may be a peer reconnecting after a NATS blip
(it has no subscription for a moment), two are an absence.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class MissCounter(Generic[K]):
    """Misses in a row per key (a ping subject, a request id).

    Args:
        limit: the misses in a row that make a verdict (>= 1).

    Raises:
        ValueError: ``limit`` < 1.
    """

    def __init__(self, limit: int = 2) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._misses: dict[K, int] = {}

    def miss(self, key: K) -> bool:
        """Count one more miss of ``key``. Returns True when this one makes ``limit`` in a
        row; the count then starts again from zero."""
        misses = self._misses.get(key, 0) + 1
        if misses >= self.limit:
            self._misses.pop(key, None)
            return True
        self._misses[key] = misses
        return False

    def hit(self, key: K) -> None:
        """``key`` answered: its next miss is the first of a new row."""
        self._misses.pop(key, None)

    def retain(self, keys: Iterable[K]) -> None:
        """Forget every key not in ``keys`` (no longer watched, or seen alive otherwise)."""
        keep = set(keys)
        self._misses = {k: n for k, n in self._misses.items() if k in keep}

    def misses(self, key: K) -> int:
        """The misses in a row of ``key`` so far (0 when none)."""
        return self._misses.get(key, 0)
