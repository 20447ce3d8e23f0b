"""The offline API on the default model: sampling seeds, stop conditions, chat, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from shared.model_source import ModelNotFoundError


@pytest.fixture(scope="module")
def llm(smollm2_path):
    threads_before = set(threading.enumerate())
    # 96 MiB hold 2,184 float32 tokens, more than max_model_len; 512, not the model's 8,192: the
    # test that fills the context prefills ~500 tokens
    with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=96 << 20, max_model_len=512) as engine:
        yield engine
        stats = engine.stats()
        assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)
    # closed, it leaves no thread behind (tqdm's monitor is one per process, started by a bar)
    assert [t.name for t in threading.enumerate() if t not in threads_before and t.name != "tqdm_monitor"] == []


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Write a story about a cat:", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate(
        ["Hello", "Write a story about a cat:", "Once upon a time", "Why is the sky blue?"],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    assert len(alone) == 24
    different_seed = seeded.replace(seed=99)
    assert llm.generate("Write a story about a cat:", different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_is_never_emitted_and_finishes_with_stop(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 6," in full
    out = llm.generate("Count: 1, 2, 3,", greedy.replace(stop=[" 6,"]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == " 6,"
    assert comp.text == full[: full.index(" 6,")]


def test_stop_token_ids_max_tokens_and_eos(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    first = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0]
    stop_tok = first.token_ids[3]
    out = llm.generate("Count: 1, 2, 3,", greedy.replace(stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    short = llm.generate("Count: 1, 2, 3,", greedy.replace(max_tokens=3), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == first.token_ids[:3] and short.outputs[0].finish_reason == "length"
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False)[0]
    assert "Paris" in chat.outputs[0].text
    assert chat.outputs[0].finish_reason == "stop" and chat.outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in chat.outputs[0].text


def test_token_id_prompts_and_input_order(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    text_out = llm.generate(["The capital of France is", "Hello"], greedy, use_tqdm=False)
    ids = [o.prompt_token_ids for o in text_out]
    id_out = llm.generate([{"prompt_token_ids": ids[0]}, ids[1]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in id_out] == [o.outputs[0].token_ids for o in text_out]
    assert id_out[0].prompt is None and id_out[1].prompt_token_ids == ids[1]


def test_prompt_plus_max_tokens_over_max_model_len_stops_at_max_model_len(llm):
    """As vLLM's LLM (not its OpenAI server): the request runs up to max_model_len and
    finishes with "length"; the others of the batch are unaffected."""
    ids = [100 + i % 997 for i in range(504)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # 504 + 24 > 512
    long, short = llm.generate([ids, "Hello"], params, use_tqdm=False)
    assert len(long.outputs[0].token_ids) == 512 - 504 and long.outputs[0].finish_reason == "length"
    assert len(short.outputs[0].token_ids) == 24 and short.outputs[0].finish_reason == "length"
    alone = llm.generate([ids], params.replace(max_tokens=8), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == long.outputs[0].token_ids


def test_chat_output_has_the_rendered_prompt(llm, smollm2_path):
    """As vLLM: RequestOutput.prompt of llm.chat is the text the chat template rendered."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False)["input_ids"]


def test_chat_shows_tools_through_a_given_template(llm, smollm2_path):
    """As vLLM's LLM.chat(tools=..., chat_template=...): the tools and past calls are rendered
    by the template given (a file here; its text works too); without one, SmolLM2's own
    template ignores the tools."""
    template = Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_smollm2.jinja"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    one = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(messages, one, use_tqdm=False, tools=tools, chat_template=str(template))[0]
    expected = AutoTokenizer.from_pretrained(smollm2_path).apply_chat_template(
        messages, tools=tools, chat_template=template.read_text(), add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert '<tools>\n{"name": "get_weather", "parameters"' in out.prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out.prompt
    assert llm.chat(messages, one, use_tqdm=False, tools=tools, chat_template=template.read_text())[0].prompt == expected
    assert "<tools>" not in llm.chat(messages[:1], one, use_tqdm=False, tools=tools)[0].prompt
    with pytest.raises(ValueError, match="tools: Field required"):
        llm.chat(messages[:1], one, use_tqdm=False, tools=[{"type": "function"}])


def test_bad_prompts_raise_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 512 tokens. However, you requested 512"):
        llm.generate(["Hello", [28] * 512], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_invalid_settings_and_unavailable_models_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=7)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 cannot split 9 attention heads with 3 KV heads"):
        LLM(tensor_parallel_size=4)  # SmolLM2: more ranks than KV heads, and 4 is not a multiple of 3
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(scheduling_policy="random")
    with pytest.raises(ModelNotFoundError, match="Hub"):
        LLM(model="meta-llama/Llama-3.1-8B-Instruct", cache_dir=tmp_path)


def test_bfloat16_answers(smollm2_path):
    """bf16 answers. The prompt's first answer token leads the runner-up by 1.4 logits in
    float32; the bare "What is the capital of France?" leads by 0.08, inside bf16's noise
    (about 1 logit after 30 layers), so which kernels run decides its answer. float32, oneDNN
    bf16 and both our GEMMs answer "The capital of France is Paris." here."""
    with LLM(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory_bytes=32 << 20) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                       SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text.startswith("The capital of France is Paris")


def test_parallel_sampling_n_shares_the_prompt_and_matches_single_samples(llm):
    prompt = "Once upon a time, in a land far away, there was a"  # ends mid-block: copy-on-write
    greedy1 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    greedy3 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3),
                           use_tqdm=False)[0]
    assert [c.index for c in greedy3.outputs] == [0, 1, 2]
    assert all(c.token_ids == greedy1[0].outputs[0].token_ids for c in greedy3.outputs)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5, n=3)
    out = llm.generate(prompt, seeded, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3 and out.finished
    for i in range(3):  # sample i of a seeded request is the request with seed + i
        single = llm.generate(prompt, seeded.replace(n=1, seed=5 + i), use_tqdm=False)[0]
        assert out.outputs[i].token_ids == single.outputs[0].token_ids
        assert out.outputs[i].text == single.outputs[0].text


def test_logprobs_stay_with_their_tokens_through_stops_forks_and_preemption(smollm2_path, llm):
    """Each output's logprobs hold one entry per token id, the sampled token first, whatever
    ends it (EOS, a stop string across steps, max_tokens) and whether it was forked (n=2) or
    preempted and recomputed (a 12-block KV cache for 6 requests, async scheduling), batched
    with requests that ask for none. The greedy ones equal the same requests run without
    preemption, token ids and log probabilities."""
    prompts = ["<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", "List the colours of a rainbow:",
               "Count: one, two, three,", "The capital of France is", "Write a haiku about the sea:",
               "def add(a, b):"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),  # EOS allowed
        SamplingParams(temperature=0, max_tokens=40, logprobs=0, stop=["visible light"]),
        SamplingParams(temperature=0, max_tokens=30),  # no logprobs
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=30, logprobs=1),
        SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, logprobs=1, stop=["Example usage"],
                       include_stop_str_in_output=True),
    ]
    reference = llm.generate(prompts, params, use_tqdm=False)
    with LLM(model=str(smollm2_path), dtype="float32", num_gpu_blocks_override=12, block_size=16,
             async_scheduling=True) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.stats().num_preemptions > 0
    for out, ref, p in zip(outs, reference, params, strict=True):
        for comp, ref_comp in zip(out.outputs, ref.outputs, strict=True):
            if p.logprobs is None:
                assert comp.logprobs is None
                continue
            assert len(comp.logprobs) == len(comp.token_ids) > 0
            assert [next(iter(d)) for d in comp.logprobs] == comp.token_ids
            assert all(len(d) in (p.logprobs, p.logprobs + 1) for d in comp.logprobs)
            if p.temperature == 0:
                assert comp.token_ids == ref_comp.token_ids and comp.text == ref_comp.text
                assert [d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids, strict=True)] == pytest.approx(
                    [d[t].logprob for d, t in zip(ref_comp.logprobs, ref_comp.token_ids, strict=True)], abs=1e-4)
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs] == [
        ("stop", None), ("stop", "visible light"), ("length", None), ("length", None), ("length", None),
        ("stop", "Example usage")]
    assert outs[1].outputs[0].text.endswith("(") and outs[5].outputs[0].text.endswith("# Example usage")
