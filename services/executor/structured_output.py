"""Structured outputs in an executor group: one grammar matcher per request, token bitmasks
for the rows that sample under a constraint.

Rank 0 owns the matchers (it alone samples, so every rank's tokens follow the masked
sample). The matcher advances with each token the runner samples, as soon as it is
sampled, so a step planned on an output placeholder (async scheduling) has its mask; a
request recomputed after preemption, or resubmitted, replays its output tokens; a sample of
an ``n > 1`` request starts from its parent's tokens.

The scheduler admits a constrained request only once the group has compiled its grammar
(``prepare``, asked by ``CompileGrammar`` and answered by ``GrammarReady``: the executor
service), so the compile runs off the step loop while other requests step. Those compiles
have a thread of their own, so a slow one never holds up a new request's grammar: that one
is taken from the process's cache (``shared/structured_output.py``) on the request thread
when its plan arrives; its first sample would wait for a compile only if the grammar were not
there (evicted from the cache between ``GrammarReady`` and the plan).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.logging import get_logger
from shared.messages import StructuredOutputsParams
from shared.structured_output import (
    CompiledGrammar,
    Matcher,
    StructuredOutputBackend,
    bitmask_words,
    shared_backend,
)

log = get_logger("executor")


@dataclass
class _Entry:
    """One request's constraint: its grammar (compiling), the output tokens it accepted, and
    its matcher once the grammar is there."""

    grammar: Future[CompiledGrammar]
    tokens: list[int] = field(default_factory=list)
    matcher: Matcher | None = None
    broken: bool = False  # a sampled token the grammar refused: no longer constrained


class StructuredOutputManager:
    """The matchers of one executor group's requests (rank 0).

    Args:
        model_path: the model directory (its tokenizer is loaded at the first constraint).
        vocab_size: the model's logits width.
        eos_token_ids: the tokens allowed once a constraint is complete.
    """

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._backend: StructuredOutputBackend | None = None
        # the scheduler's compiles (prepare) and the requests' (add, cache hits as a rule) apart,
        # so that a new request's grammar never queues behind another grammar's slow compile
        self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-prepare")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._entries: dict[str, _Entry] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        if self._backend is None:
            from transformers import AutoTokenizer

            self._backend = shared_backend(self.model_path, self.vocab_size, self.eos_token_ids,
                                           lambda: AutoTokenizer.from_pretrained(str(self.model_path)))
        return self._backend.compile(params)

    def prepare(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Compile ``params`` on the worker thread ahead of any request (the scheduler's
        ``CompileGrammar``); the requests' own compiles then hit the process's cache.

        The future raises ``StructuredOutputError`` when no backend compiles it."""
        return self._prepare_pool.submit(self._compile, params)

    def add(self, request_id: str, params: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        """Start compiling a new request's constraint; ``output_token_ids``: the tokens it
        already generated (recomputed after preemption or resubmitted), replayed."""
        self._entries[request_id] = _Entry(self._pool.submit(self._compile, params), list(output_token_ids))

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample of an n > 1 request: the parent's grammar, from the parent's tokens."""
        parent = self._entries.get(parent_id)
        if parent is not None:
            self._entries[child_id] = _Entry(parent.grammar, list(parent.tokens), broken=parent.broken)

    def remove(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def close(self) -> None:
        """Stop the worker threads: the queued compiles and masks are cancelled, a running one
        is left to finish on its own (its result unread)."""
        for pool in (self._prepare_pool, self._pool, self._mask_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def _matcher(self, entry: _Entry) -> Matcher | None:
        """The entry's matcher, made (waiting for its grammar) and caught up on first use."""
        if entry.matcher is None and not entry.broken:
            compiled = entry.grammar.result()  # compiled on the worker thread; usually done by now
            assert self._backend is not None
            matcher = self._backend.matcher(compiled)
            for t in entry.tokens:
                if not matcher.accept_token(t):
                    entry.broken = True
                    log.warning("structured_output_replay_refused", token_id=t)
                    return None
            entry.matcher = matcher
        return entry.matcher

    def bitmask(self, request_ids: list[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of the rows that sample under a constraint: ``(int32 [R, ceil(V / 32)],
        the row of each in request_ids)``, or None when no row has one."""
        rows = [i for i, rid in enumerate(request_ids)
                if (e := self._entries.get(rid)) is not None and not e.broken]
        if not rows:
            return None
        bitmask = torch.full((len(rows), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        kept = []
        for j, i in enumerate(rows):
            entry = self._entries.get(request_ids[i])  # on the mask thread: removed meanwhile, skipped
            matcher = self._matcher(entry) if entry is not None else None
            if matcher is not None:
                matcher.fill_bitmask(bitmask, j)
                kept.append(j)
        if len(kept) != len(rows):
            bitmask, rows = bitmask[kept], [rows[j] for j in kept]
        return (bitmask, rows) if rows else None

    def bitmask_async(self, request_ids: list[str]) -> Future[tuple[torch.Tensor, list[int]] | None] | None:
        """:meth:`bitmask` on a worker thread, so that it overlaps the step's forward pass (the
        matchers' states only change in :meth:`accept`, after sampling); None when no row of
        ``request_ids`` has a constraint."""
        if not any(rid in self._entries for rid in request_ids):
            return None
        return self._mask_pool.submit(self.bitmask, list(request_ids))

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        """Advance the constrained requests' matchers by the tokens just sampled."""
        for rid, tok in zip(request_ids, tokens, strict=True):
            entry = self._entries.get(rid)
            if entry is None or entry.broken:
                continue
            entry.tokens.append(tok)
            if entry.matcher is not None and not entry.matcher.accept_token(tok):
                if not entry.matcher.is_terminated():  # after EOS a dropped token (async) is expected
                    entry.broken = True
                    log.warning("structured_output_token_refused", request_id=rid, token_id=tok)
