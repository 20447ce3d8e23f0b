"""Prefix caching on the real model: it hits, and it never changes a greedy output."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams

BLOCK = 16


def workload(tokenizer_ids: list[int]) -> list[list[int]]:
    base = tokenizer_ids
    prompts = [
        base[: 2 * BLOCK],  # ends exactly on a block boundary
        base[: 2 * BLOCK + 1],  # one token past it
        base[: 3 * BLOCK - 1],
        base[: 2 * BLOCK] + base[5:20],  # shares two blocks, then diverges
    ]
    return prompts


def run(llm: LLM, prompts, warm) -> tuple[list[list[int]], list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=12)
    # warm-up that ends on a stop string, with prompts sharing the prefix
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=30, stop=[","]), use_tqdm=False)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    again = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in again]


def test_prefix_caching_on_and_off_give_the_same_greedy_outputs(smollm2_path):
    text = ("In the beginning the universe was created. This has made a lot of people very angry and "
            "been widely regarded as a bad move. Many races believe that it was created by some sort of god. "
            "The Jatravartid people of Viltvodle VI believe that the entire universe was sneezed out of "
            "the nose of a being called the Great Green Arkleseizure.")
    results = {}
    for enabled in (True, False):
        with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=64 << 20,
                 enable_prefix_caching=enabled, block_size=BLOCK) as llm:
            ids = llm.generate(text, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
            assert len(ids) > 3 * BLOCK
            prompts = workload(ids)
            warm = [ids[: 2 * BLOCK + 3], ids[: 3 * BLOCK]]
            results[enabled] = run(llm, prompts, warm)
            stats = llm.stats()
            assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)
            if enabled:
                assert stats.groups[0].prefix_cache_hits > 0
    (on, cached_on), (off, cached_off) = results[True], results[False]
    assert on == off
    # a full cached prefix leaves the block holding the last prompt token to compute
    assert cached_on == [BLOCK, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK]
    assert cached_off == [0, 0, 0, 0]
