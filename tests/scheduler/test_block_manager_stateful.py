"""Stateful property test (hypothesis) of ``KVCacheManager`` driven the way the scheduler
drives it, with a simulated executor that keeps every KV slot's content.

A step has the scheduler's two phases. *Scheduling* (rules ``admit`` and ``schedule_running``,
interleaved with ``add_request``): waiting requests are admitted (``get_computed_blocks`` ->
``num_computed_tokens`` -> ``allocate_slots`` with the hit blocks, possibly a partial chunk);
running requests get their next chunk or token (``allocate_running``: ``copy_on_write`` of a
shared partial block first, then ``allocate_slots``; preempting the newest unscheduled request
while the pool is short, as ``Scheduler.schedule`` does). *Execution* (rule ``execute``):
aborts may land while the step is in flight (the executor still writes those requests' K/V);
the executor copies the CoW blocks (gather, then scatter, like ``ModelRunner._copy_blocks``)
and writes each scheduled position's K/V into its slot; then ``num_computed_tokens``
advances, a request whose known tokens are all computed samples a token (siblings often the
same one, so duplicate blocks arise), n > 1 requests fork their children
(``KVCacheManager.fork``) and some requests finish (``free``).

The simulated K/V of a slot is ``(cache_extra_keys, token prefix)``: the tokens whose K/V the
slot holds (position ``p`` of a sequence holds ``tokens[:p + 1]``), tagged with the salt so
cross-salt sharing shows up as wrong content. Checked after every rule (and after each
in-flight abort): block accounting, refcounts against the live block tables, the free queue
(exactly the refcount-0 blocks, in LRU order: freed blocks join the tail, a request's last
block first; allocation and copy-on-write take the head), the prefix-cache map (each hash
stands for one content; a cached block holds that content, unless the step in flight is
about to write it), longest-prefix hits (also probed with recent requests' tokens), and that
every request reads its own tokens back from its computed positions.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.block_manager import KVCacheManager, cdiv
from services.scheduler.request import Request, RequestStatus
from shared.messages import RequestSpec, SamplingParams

pytestmark = pytest.mark.heavy  # a stateful property search (tests/conftest.py)

VOCAB = 4  # tiny vocabulary: prefix hits and identical blocks are frequent
MAX_LIVE = 6  # waiting + running requests before add_request stops (forks may exceed it)
PARAMS = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

Content = tuple[tuple, tuple[int, ...]]  # (cache_extra_keys, token prefix)


@dataclass
class Scheduled:
    """One request's share of the step being scheduled / in flight (what the executor gets)."""

    req: Request
    start: int  # num_computed_tokens when scheduled
    num_new: int
    table: list[int]  # the block table sent to the executor
    tokens: list[int]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.seen: list[Request] = []  # every request ever made: prefix sources
        self.n: dict[str, int] = {}  # request id -> samples wanted (n)
        self.forked: set[str] = set()
        self.content: dict[int, Content] = {}  # slot -> what its K/V stands for
        self.meaning: dict[int, Content] = {}  # block hash -> the content it stands for
        self.plan: list[Scheduled] = []
        self.copies: list[tuple[int, int]] = []
        self.counter = 0

    # ------------------------------------------------------------------ helpers

    @property
    def bs(self) -> int:
        assert self.kv is not None
        return self.kv.block_size

    def _queue(self) -> list[int]:
        return list(self.kv.pool.free_queue)

    def _planned(self, req: Request) -> bool:
        return any(s.req is req for s in self.plan)

    def _draw_index(self, data, seq) -> int:
        return data.draw(st.integers(0, len(seq) - 1))

    def _snapshot(self, req: Request):
        pool = self.kv.pool
        return (
            list(pool.ref_counts),
            self._queue(),
            dict(pool.cached),
            list(pool.block_hash),
            list(req.block_ids),
            req.num_cached_blocks,
        )

    def _record(self, req: Request) -> None:
        """Learn what each of the request's block hashes stands for; a hash standing for two
        contents would let one request read another's K/V."""
        bs = self.bs
        tokens = req.all_token_ids
        for i, h in enumerate(req.block_hashes.get(bs, [])):
            end = (i + 1) * bs
            assert end <= len(tokens), f"{req.request_id}: hash for block {i}, which is not full"
            m = (req.cache_extra_keys, tuple(tokens[:end]))
            old = self.meaning.setdefault(h, m)
            assert old == m, f"block hash {h} stands for two contents: {old} and {m}"

    def _pending_slots(self) -> set[int]:
        """Slots the scheduled / in-flight step will still write (their content is not there yet)."""
        bs = self.bs
        slots = {dst * bs + o for _, dst in self.copies for o in range(bs)}
        for s in self.plan:
            for pos in range(s.start, s.start + s.num_new):
                slots.add(s.table[pos // bs] * bs + pos % bs)
        return slots

    def _free(self, req: Request) -> None:
        pool = self.kv.pool
        old_q, table = self._queue(), list(req.block_ids)
        self.kv.free(req)
        assert req.block_ids == [] and req.num_cached_blocks == 0
        newly = [b for b in reversed(table) if pool.ref_counts[b] == 0]
        assert self._queue() == old_q + newly, (
            f"free({table}): freed blocks must join the free queue's tail, last block first; "
            f"queue was {old_q}, is {self._queue()}"
        )

    def _preempt(self, req: Request) -> None:
        assert not self._planned(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.running.remove(req)
        self.waiting.insert(0, req)

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self._free(req)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def _schedule(self, req: Request, num_new: int) -> None:
        self.plan.append(
            Scheduled(req, req.num_computed_tokens, num_new, list(req.block_ids), req.all_token_ids)
        )

    def _check_allocation(self, req, old_q, computed, new, total) -> None:
        """allocate_slots refused exactly when the pool was short; it took the LRU blocks."""
        pool = self.kv.pool
        if new is None:
            return
        assert len(req.block_ids) == cdiv(total, self.bs), (
            f"{req.request_id}: table does not cover {total} tokens"
        )
        rest = [b for b in old_q if b not in set(computed)]
        assert new == rest[: len(new)], f"allocate took {new}, the LRU free blocks were {rest[: len(new)]}"
        assert self._queue() == rest[len(new) :]
        for b in new:
            assert pool.ref_counts[b] == 1
            h = pool.block_hash[b]  # evicted, or registered again by this very request
            assert h is None or h in req.block_hashes.get(self.bs, []), f"block {b} kept a stale hash"

    def _check_longest_hit(self, req: Request, computed: list[int]) -> None:
        bs, pool = self.bs, self.kv.pool
        if not self.kv.enable_prefix_caching:
            assert computed == []
            return
        self._record(req)
        tokens, keys = req.all_token_ids, req.cache_extra_keys
        for i, b in enumerate(computed):
            want = (keys, tuple(tokens[: (i + 1) * bs]))
            assert self.meaning.get(pool.block_hash[b]) == want, (
                f"{req.request_id}: hit block {b} holds other content"
            )
        k = len(computed)
        if k < (req.num_tokens - 1) // bs:
            want = (keys, tuple(tokens[: (k + 1) * bs]))
            hits = [b for h, b in pool.cached.items() if self.meaning.get(h) == want]
            assert not hits, f"{req.request_id}: missed a prefix hit on block(s) {hits} after {k} hit blocks"

    def _allocate_running(self, req: Request, num_new: int) -> list[int] | None:
        """``KVCacheManager.allocate_running``, as ``Scheduler.schedule`` calls it, with every
        effect checked against the model: it copies exactly when the request's next token falls
        in a partially filled block that another live request holds, the copy takes the LRU free
        block, and it refuses exactly when the pool is short of the copy plus the new blocks."""
        kv, bs, pool = self.kv, self.bs, self.kv.pool
        idx = req.num_computed_tokens // bs
        partial = req.num_computed_tokens % bs != 0 and idx < len(req.block_ids)
        shared = partial and sum(req.block_ids[idx] in r.block_ids for r in self.running) > 1
        extra = max(cdiv(req.num_computed_tokens + num_new, bs) - len(req.block_ids), 0)
        old_q, before, table = self._queue(), self._snapshot(req), list(req.block_ids)
        rc_src = pool.ref_counts[table[idx]] if shared else 0
        got = kv.allocate_running(req, num_new)
        assert (got is None) == (int(shared) + extra > len(old_q)), (
            f"allocate_running returned {got} with {len(old_q)} free, {extra} new blocks and "
            f"{int(shared)} copy needed"
        )
        if got is None:
            assert self._snapshot(req) == before, "a refused allocate_running changed state"
            return None
        new, copy = got
        total = req.num_computed_tokens + num_new
        if shared:
            assert copy is not None, (
                f"{req.request_id}: allocate_running declined to copy shared partial block {table[idx]}"
            )
            src, dst = copy
            assert src == table[idx] and req.block_ids[idx] == dst, (copy, req.block_ids)
            assert req.block_ids[: len(table)] == table[:idx] + [dst] + table[idx + 1 :]
            assert dst == old_q[0], "copy_on_write must take the LRU free block"
            assert pool.ref_counts[src] == rc_src - 1 and pool.ref_counts[dst] == 1
            h = pool.block_hash[dst]  # no stale hash: none, or this request's own for that block
            assert h is None or h == req.block_hashes[bs][idx], f"copied block {dst} kept a stale hash"
            self.copies.append(copy)
            old_q = old_q[1:]
        else:
            assert copy is None, f"{req.request_id}: needless copy-on-write {copy}"
            assert req.block_ids[: len(table)] == table
        self._check_allocation(req, old_q, (), new, total)
        self._record(req)
        return new

    # ------------------------------------------------------------------ rules

    @initialize(
        num_blocks=st.sampled_from([6, 6, 7, 8, 10, 12, 16, 24]),
        block_size=st.sampled_from([2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.max_len = min(num_blocks * block_size, 16)  # a request always fits the pool alone

    @precondition(lambda self: len(self.running) + len(self.waiting) < MAX_LIVE)
    @rule(data=st.data())
    def add_request(self, data):
        """A new request, often continuing (a prefix of) an earlier one's tokens."""
        tokens: list[int] = []
        if self.seen and data.draw(st.integers(0, 3)) > 0:
            recent = self.seen[-6:]
            src = recent[self._draw_index(data, recent)].all_token_ids
            tokens = src[: data.draw(st.sampled_from([len(src), data.draw(st.integers(0, len(src)))]))]
        tokens += data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
        tokens = tokens[: data.draw(st.integers(1, self.max_len - 2))] or [0]  # room to decode
        self.counter += 1
        req = Request(
            spec=RequestSpec(request_id=f"r{self.counter}", gateway_id="g", sampling_params=PARAMS,
                             cache_salt=data.draw(st.sampled_from([None, None, "salt"]))),
            prompt_token_ids=tokens,
            max_model_len=self.max_len,
        )
        self.n[req.request_id] = data.draw(st.sampled_from([1, 1, 2, 3]))
        self.seen.append(req)
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def admit(self, data, chunk):
        """``admission.admit_one`` (``GroupState.admit``): hit the cache, then allocate the hit blocks and the chunk."""
        req = self.waiting[self._draw_index(data, self.waiting)]
        kv = self.kv
        computed, hit = kv.get_computed_blocks(req)
        assert hit == len(computed) * self.bs and hit < req.num_tokens, (computed, hit, req.num_tokens)
        self._check_longest_hit(req, computed)
        req.num_computed_tokens = hit
        num_new = min(req.num_tokens - hit, chunk)
        total = hit + num_new
        need = cdiv(total, self.bs) - len(computed)
        reviving = sum(1 for b in computed if kv.pool.ref_counts[b] == 0)
        old_q, before = self._queue(), self._snapshot(req)
        new = kv.allocate_slots(req, num_new, computed)
        assert (new is None) == (need + reviving > len(old_q)), (
            f"allocate_slots returned {new} with {len(old_q)} free"
        )
        if new is None:
            assert self._snapshot(req) == before, "a refused allocate_slots changed state"
            req.num_computed_tokens = 0
            return
        assert req.block_ids[: len(computed)] == computed
        self._check_allocation(req, old_q, computed, new, total)
        self._record(req)
        req.status = RequestStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        self._schedule(req, num_new)

    def _schedulable(self) -> list[Request]:
        return [r for r in self.running if not self._planned(r) and r.num_tokens > r.num_computed_tokens]

    @precondition(lambda self: self._schedulable())
    @rule(data=st.data(), chunk=st.integers(1, 8), preempt_one=st.sampled_from([False, False, False, True]))
    def schedule_running(self, data, chunk, preempt_one):
        """A running request's next chunk (prefill) or token (decode); preempts the newest
        unscheduled request while the pool is short (``Scheduler.schedule``), or first preempts
        one at random (``preempt_one``)."""
        cands = self._schedulable()
        req = cands[self._draw_index(data, cands)]
        others = [r for r in self.running if r is not req and not self._planned(r)]
        if preempt_one and others:
            self._preempt(others[self._draw_index(data, others)])
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        while True:
            if self._allocate_running(req, num_new) is not None:
                break
            victims = [r for r in self.running if r is not req and not self._planned(r)]
            victim = victims[-1] if victims else req
            self._preempt(victim)
            if victim is req:
                return
        self._schedule(req, num_new)

    @precondition(lambda self: self.plan)
    @rule(data=st.data(), num_aborts=st.sampled_from([0, 0, 0, 0, 1, 2]))
    def execute(self, data, num_aborts):
        """Dispatch the step; aborts (of any request) may land while it is in flight, and the
        executor still writes the aborted requests' K/V; then ``update_from_output`` (advance,
        sample, fork n > 1, finish)."""
        bs = self.bs
        for _ in range(num_aborts):
            reqs = self.running + self.waiting
            if reqs:
                self._finish(reqs[self._draw_index(data, reqs)])
                self._check_all()
        gathered = [(dst, [self.content.get(src * bs + o) for o in range(bs)]) for src, dst in self.copies]
        for dst, values in gathered:
            for o, v in enumerate(values):
                if v is None:
                    self.content.pop(dst * bs + o, None)
                else:
                    self.content[dst * bs + o] = v
        writer: dict[int, str] = {}
        for s in self.plan:
            for pos in range(s.start, s.start + s.num_new):
                slot = s.table[pos // bs] * bs + pos % bs
                assert slot not in writer, (
                    f"slot {slot} written by {writer.get(slot)} and {s.req.request_id} in one step"
                )
                writer[slot] = s.req.request_id
                self.content[slot] = (s.req.cache_extra_keys, tuple(s.tokens[: pos + 1]))
        plan, self.plan, self.copies = self.plan, [], []
        for s in plan:
            req = s.req
            if req not in self.running:
                continue  # aborted while in flight
            req.num_computed_tokens += s.num_new
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled
            samples = [req]
            if self.n[req.request_id] > 1 and req.request_id not in self.forked:
                self.forked.add(req.request_id)
                samples += [self._fork(req, i) for i in range(1, self.n[req.request_id])]
            common = data.draw(st.integers(0, VOCAB - 1))  # samples often agree: duplicate blocks
            for sample in samples:
                same = data.draw(st.booleans())
                sample.output_token_ids.append(common if same else data.draw(st.integers(0, VOCAB - 1)))
                if sample.num_tokens >= self.max_len or data.draw(st.integers(0, 7)) == 0:
                    self._finish(sample)

    def _fork(self, parent: Request, index: int) -> Request:
        """``results.fork_sample``: ``Request.fork_child`` (the child keeps the parent's
        ``cache_extra_keys``: its copied hashes were made with them), then ``KVCacheManager.fork``."""
        pool = self.kv.pool
        child = parent.fork_child(index)
        assert child.cache_extra_keys == parent.cache_extra_keys and child.sampling_params == PARAMS
        assert child.status is RequestStatus.RUNNING and child.num_computed_tokens == parent.num_computed_tokens
        old_q, old_rc = self._queue(), list(pool.ref_counts)
        self.kv.fork(parent, child)
        assert child.block_ids == parent.block_ids and child.block_ids is not parent.block_ids
        assert child.num_cached_blocks == parent.num_cached_blocks
        assert child.block_hashes == parent.block_hashes
        assert all(child.block_hashes[k] is not parent.block_hashes[k] for k in child.block_hashes)
        for b in parent.block_ids:
            assert pool.ref_counts[b] == old_rc[b] + 1
        assert self._queue() == [b for b in old_q if b not in set(parent.block_ids)]
        self.n[child.request_id] = 1
        self.seen.append(child)
        self.running.append(child)
        return child

    # ------------------------------------------------------------------ invariants

    def _check_all(self) -> None:
        self.blocks_are_accounted_for()
        self.tables_cover_exactly_the_scheduled_tokens()
        self.hash_map_points_at_its_content()
        self.lookups_find_the_longest_cached_prefix()
        self.every_request_reads_its_own_tokens()

    @invariant()
    def blocks_are_accounted_for(self):
        if self.kv is None:
            return
        pool, n = self.kv.pool, self.kv.num_blocks
        assert all(rc >= 0 for rc in pool.ref_counts)
        used = sum(1 for rc in pool.ref_counts if rc > 0)
        assert used + self.kv.num_free_blocks == n, f"{used} used + {self.kv.num_free_blocks} free != {n}"
        queue = self._queue()
        assert len(queue) == len(set(queue)), f"free queue has duplicates: {queue}"
        assert set(queue) == {b for b in range(n) if pool.ref_counts[b] == 0}, (
            "free queue != refcount-0 blocks"
        )
        held = Counter(b for r in self.running for b in r.block_ids)
        for b in range(n):
            assert pool.ref_counts[b] == held[b], (
                f"block {b}: refcount {pool.ref_counts[b]}, held {held[b]} times"
            )
        for r in self.running:
            assert len(set(r.block_ids)) == len(r.block_ids), (
                f"{r.request_id}: a block twice in {r.block_ids}"
            )
        for r in self.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.num_cached_blocks == 0

    @invariant()
    def tables_cover_exactly_the_scheduled_tokens(self):
        if self.kv is None:
            return
        scheduled = {s.req.request_id: s.num_new for s in self.plan}
        for r in self.running:
            covered = r.num_computed_tokens + scheduled.get(r.request_id, 0)
            assert len(r.block_ids) == cdiv(covered, self.bs), (
                f"{r.request_id}: {r.block_ids} for {covered} tokens"
            )
            assert r.num_cached_blocks <= covered // self.bs
            if not self.kv.enable_prefix_caching:
                assert r.num_cached_blocks == 0

    @invariant()
    def hash_map_points_at_its_content(self):
        if self.kv is None:
            return
        pool, bs = self.kv.pool, self.bs
        for r in self.running + self.waiting:
            self._record(r)
        for b, h in enumerate(pool.block_hash):
            assert h is None or pool.cached.get(h) == b, (
                f"block {b} has hash {h}, the map says {pool.cached.get(h)}"
            )
        if not self.kv.enable_prefix_caching:
            assert not pool.cached
        pending = self._pending_slots()
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h, f"cached[{h}] = {b}, whose hash is {pool.block_hash[b]}"
            assert h in self.meaning, f"cached hash {h} (block {b}) belongs to no request"
            keys, prefix = self.meaning[h]
            assert len(prefix) % bs == 0 and prefix
            for o in range(bs):
                slot = b * bs + o
                if slot in pending:
                    continue  # registered ahead: the step in flight writes it
                want = (keys, prefix[: len(prefix) - bs + o + 1])
                assert self.content.get(slot) == want, (
                    f"cached block {b} slot {o}: {self.content.get(slot)} != {want}"
                )

    @invariant()
    def lookups_find_the_longest_cached_prefix(self):
        """Probe the prefix cache with the recent requests' tokens (a pure lookup)."""
        if self.kv is None:
            return
        for r in self.seen[-8:]:
            probe = Request(
                spec=r.spec.derive(request_id="probe"),
                prompt_token_ids=r.all_token_ids,
                max_model_len=self.max_len,
            )
            before = self._snapshot(probe)
            computed, hit = self.kv.get_computed_blocks(probe)
            assert self._snapshot(probe) == before, "get_computed_blocks changed the pool"
            assert hit == len(computed) * self.bs and hit < probe.num_tokens
            self._check_longest_hit(probe, computed)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        if self.kv is None:
            return
        bs, pending = self.bs, self._pending_slots()
        for r in self.running:
            tokens = r.all_token_ids
            for pos in range(r.num_computed_tokens):
                slot = r.block_ids[pos // bs] * bs + pos % bs
                if slot in pending:
                    continue  # a hit on blocks registered this step, or a CoW copy: written before attention
                want = (r.cache_extra_keys, tuple(tokens[: pos + 1]))
                assert self.content.get(slot) == want, (
                    f"{r.request_id} position {pos} (block {r.block_ids[pos // bs]}): "
                    f"reads {self.content.get(slot)}, wants {want}"
                )


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
