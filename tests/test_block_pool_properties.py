"""Stateful property test of the KV cache manager (hypothesis): allocate, decode, fork for
n > 1, copy-on-write, free, evict and prefix-cache hits, with a simulated executor that
keeps each slot's content, so sharing is checked for correctness, not just bookkeeping."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.block_manager import KVCacheManager, hash_block
from services.scheduler.request import Request
from shared.messages import SamplingParams

BLOCK = 2
NUM_BLOCKS = 10
PARAMS = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)


class KVCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # slot -> token prefix whose K/V it holds
        self.counter = 0
        self.history: list[list[int]] = [[0, 1, 2, 3, 0, 1]]

    # -------------------------------------------------------------- executor model

    def _compute(self, req: Request, num_new: int) -> None:
        """Write the K/V of the next tokens (as the executor would), then advance."""
        tokens = req.all_token_ids
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            slot = req.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
            self.content[slot] = tuple(tokens[: pos + 1])
        req.num_computed_tokens += num_new

    def _new_request(self, tokens: list[int]) -> Request:
        self.counter += 1
        return Request(request_id=f"r{self.counter}", gateway_id="g", prompt_token_ids=tokens,
                       sampling_params=PARAMS, max_model_len=10_000)

    # -------------------------------------------------------------- rules

    @rule(target=requests, prefix_of=st.integers(0, 20), keep=st.integers(0, 8),
          extra=st.lists(st.integers(0, 3), max_size=6), chunk=st.integers(1, 12))
    def admit(self, prefix_of, keep, extra, chunk):
        base = self.history[prefix_of % len(self.history)]
        tokens = base[:keep] + extra
        if not tokens:
            tokens = [1]
        req = self._new_request(tokens)
        computed, hit = self.kv.get_computed_blocks(req)
        assert hit == len(computed) * BLOCK and hit < req.num_tokens
        req.num_computed_tokens = hit
        num_new = min(req.num_tokens - hit, chunk)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(req, num_new, computed) is None:
            assert self.kv.num_free_blocks == free_before and req.block_ids == []
            return None
        self._compute(req, num_new)
        self.live[req.request_id] = req
        self.history.append(list(tokens))
        return req.request_id

    @rule(rid=requests, token=st.integers(0, 3), chunk=st.integers(1, 6))
    def step(self, rid, token, chunk):
        """Compute the next chunk (prefill) or append a sampled token and decode it."""
        req = self.live.get(rid)
        if req is None:
            return
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token)
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        idx = req.num_computed_tokens // BLOCK
        shared_partial = (req.num_computed_tokens % BLOCK != 0 and idx < len(req.block_ids)
                          and self.kv.pool.ref_counts[req.block_ids[idx]] > 1)
        extra = max(self.kv.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_ids), 0)
        if self.kv.num_free_blocks < extra + int(shared_partial):
            return  # the scheduler would preempt someone; here the step just waits
        if shared_partial:
            src, dst = self.kv.copy_on_write(req, num_new)
            for off in range(BLOCK):  # the executor copies the block's K/V
                if src * BLOCK + off in self.content:
                    self.content[dst * BLOCK + off] = self.content[src * BLOCK + off]
        assert self.kv.allocate_slots(req, num_new) is not None
        self._compute(req, num_new)
        self.history.append(req.all_token_ids)

    @precondition(lambda self: self.live)
    @rule(target=requests, data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if parent.num_computed_tokens != parent.num_tokens:
            return None
        child = self._new_request(list(parent.prompt_token_ids))
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child
        return child.request_id

    @rule(rid=requests)
    def free(self, rid):
        req = self.live.pop(rid, None)
        if req is not None:
            self.kv.free(req)

    # -------------------------------------------------------------- invariants

    @invariant()
    def blocks_are_accounted_for(self):
        pool = self.kv.pool
        used = sum(1 for r in pool.ref_counts if r > 0)
        assert used + self.kv.num_free_blocks == NUM_BLOCKS
        assert set(pool.free_queue) == {b for b, r in enumerate(pool.ref_counts) if r == 0}
        held = Counter(b for req in self.live.values() for b in req.block_ids)
        assert all(pool.ref_counts[b] == held.get(b, 0) for b in range(NUM_BLOCKS))
        for req in self.live.values():
            assert len(set(req.block_ids)) == len(req.block_ids), "a block twice in one table"

    @invariant()
    def hash_map_points_at_matching_content(self):
        pool = self.kv.pool
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h
            prefix = self.content.get(b * BLOCK + BLOCK - 1)
            assert prefix is not None and len(prefix) % BLOCK == 0
            parent = None
            for i in range(len(prefix) // BLOCK):  # recompute the chain over the block's content
                parent = hash_block(parent, prefix[i * BLOCK:(i + 1) * BLOCK])
            assert parent == h
            for off in range(BLOCK):
                assert self.content[b * BLOCK + off] == prefix[: len(prefix) - BLOCK + off + 1]

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for req in self.live.values():
            tokens = req.all_token_ids
            for pos in range(req.num_computed_tokens):
                slot = req.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
                assert self.content.get(slot) == tuple(tokens[: pos + 1]), (req.request_id, pos)


KVCacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True, database=None
)
TestKVCacheManager = KVCacheMachine.TestCase
