"""Prefix-cache keys (``services/scheduler/block_hash.py``): sha256 over an unambiguous encoding
of (parent key, extra keys, token ids). A pair of prompts crafted to collide under Python's
``hash()`` (the scheme before, vLLM's GHSA-rm76-4mrf-v9r8) gets different keys, and a request
never gets another request's cached blocks, nor one with another cache salt (exact block ids)."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest

from services.scheduler.block_hash import ROOT_PARENT, encode_extra_keys, hash_block
from services.scheduler.block_manager import KVCacheManager
from services.scheduler.request import Request
from shared.messages import RequestSpec, SamplingParams

BS = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4, then the last token's block
#: prompts that collide with PROMPT under Python's hash(): an int hashes modulo 2**61 - 1, and
#: hash(-1) == hash(-2) (-1 is CPython's error value)
CRAFTED = {"modulus": [1 + 2**61 - 1] + PROMPT[1:], "minus_one": [-1] + PROMPT[1:]}
CRAFTED_BASE = {"modulus": PROMPT, "minus_one": [-2] + PROMPT[1:]}


def request(rid: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    spec = RequestSpec(request_id=rid, gateway_id="gw", sampling_params=SamplingParams(max_tokens=1),
                       cache_salt=cache_salt)
    return Request(spec=spec, prompt_token_ids=list(prompt), max_model_len=64)


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], list[int]]:
    """Admit ``req`` as the scheduler does: ``(cached block ids it took, new block ids)``."""
    cached, num_cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_cached
    new = kv.allocate_slots(req, req.num_tokens - num_cached, cached)
    assert new is not None
    return cached, new


def python_hash_keys(kv: KVCacheManager, req: Request, num_full_blocks: int) -> list[int]:
    """``KVCacheManager._block_hashes`` as it was: ``hash((parent, tokens, extra keys))``."""
    hashes = req.block_hashes.setdefault(kv.block_size, [])
    tokens = req.all_token_ids
    while len(hashes) < num_full_blocks:
        i = len(hashes)
        hashes.append(hash((hashes[-1] if hashes else None, tuple(tokens[i * BS:(i + 1) * BS]), req.cache_extra_keys)))
    return hashes


def test_a_key_is_sha256_of_parent_extra_keys_and_int64_tokens():
    want = hashlib.sha256(bytes(32) + msgpack.packb(["salt"]) + struct.pack("<4q", 1, 2, 3, 4)).digest()
    first = hash_block(ROOT_PARENT, [1, 2, 3, 4], encode_extra_keys(("salt",)))
    assert first == want and len(first) == 32
    second = hash_block(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + msgpack.packb([]) + struct.pack("<4q", 5, 6, 7, 8)).digest()
    others = {hash_block(ROOT_PARENT, [1, 2, 3, 4]), hash_block(ROOT_PARENT, [1, 2, 3, 5]),
              hash_block(second, [1, 2, 3, 4]), first}
    assert len(others) == 4


def test_the_manager_keys_each_block_with_hash_block_chained_however_it_extends():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = request("r", list(range(100, 117)), "s")
    assert len(kv._block_hashes(req, 1)) == 1
    keys = kv._block_hashes(req, 4)  # extended
    parent, want = ROOT_PARENT, []
    for i in range(4):
        parent = hash_block(parent, req.prompt_token_ids[i * BS:(i + 1) * BS], encode_extra_keys(("s",)))
        want.append(parent)
    assert keys == want


@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_pair_crafted_to_collide_under_python_hash_gets_other_keys(craft):
    base, crafted = CRAFTED_BASE[craft], CRAFTED[craft]
    assert base != crafted and hash((None, tuple(base[:BS]), ())) == hash((None, tuple(crafted[:BS]), ()))
    assert hash_block(ROOT_PARENT, base[:BS]) != hash_block(ROOT_PARENT, crafted[:BS])


@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_crafted_prompt_never_gets_another_requests_cached_blocks(craft, monkeypatch):
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert admit(kv, request("victim", CRAFTED_BASE[craft])) == ([], [0, 1, 2])
    assert admit(kv, request("attacker", CRAFTED[craft])) == ([], [3, 4, 5])  # computes its own
    assert admit(kv, request("same", CRAFTED_BASE[craft])) == ([0, 1], [6])  # a true hit still hits

    # the test has teeth: keyed with Python's hash(), the attacker reads the victim's K/V
    monkeypatch.setattr(KVCacheManager, "_block_hashes", python_hash_keys)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert admit(kv, request("victim", CRAFTED_BASE[craft])) == ([], [0, 1, 2])
    assert admit(kv, request("attacker", CRAFTED[craft])) == ([0, 1], [3])


def test_requests_with_other_cache_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert admit(kv, request("plain", PROMPT)) == ([], [0, 1, 2])
    assert admit(kv, request("s1", PROMPT, "s1")) == ([], [3, 4, 5])
    assert admit(kv, request("s2", PROMPT, "s2")) == ([], [6, 7, 8])
    assert admit(kv, request("s1-again", PROMPT, "s1")) == ([3, 4], [9])
    assert admit(kv, request("plain-again", PROMPT)) == ([0, 1], [10])
    assert admit(kv, request("s2-again", PROMPT, "s2")) == ([6, 7], [11])
