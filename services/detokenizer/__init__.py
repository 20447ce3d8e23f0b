"""The detokenizer service: incremental detokenization and stop strings, per shard."""

from services.detokenizer.incremental import IncrementalDetokenizer
from services.detokenizer.service import DetokenizerService

__all__ = ["DetokenizerService", "IncrementalDetokenizer"]
