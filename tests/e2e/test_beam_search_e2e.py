"""Beam search through the whole engine on SmolLM2 in float32: the beams equal Hugging Face
``generate(num_beams=k, early_stopping="never", length_penalty=0.0)`` token for token, width 1
is greedy, and ``use_beam_search`` over HTTP (the OpenAI SDK) returns the same beams."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.service import GatewayService
from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchOutput
from pagedllm.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n"]
WIDTH, MAX_TOKENS = 4, 14


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=64 << 20) as engine:
        yield engine


def hf_beams(path, prompts: list[str]) -> list[list[list[int]]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [_hf_beams(tok, model, p) for p in prompts]


def _hf_beams(tok, model, prompt: str) -> list[list[int]]:
    ids = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                             length_penalty=0.0, early_stopping="never", max_new_tokens=MAX_TOKENS, pad_token_id=0)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    beams = []
    for seq in out[:, ids["input_ids"].shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))  # the EOS kept, padding dropped
        beams.append(seq[:cut])
    return beams


def test_beams_equal_hugging_face_and_width_1_is_greedy(llm, smollm2_path):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=0.0)
    outs = llm.beam_search([PROMPTS[0], {"prompt": PROMPTS[1]}], params)
    assert all(isinstance(o, BeamSearchOutput) and len(o.sequences) == WIDTH for o in outs)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for out, expected, g in zip(outs, hf_beams(smollm2_path, PROMPTS), greedy, strict=True):
        n = len(g.prompt_token_ids)
        assert [s.tokens[n:] for s in out.sequences] == expected
        for s in out.sequences:
            assert len(s.logprobs) == len(s.tokens) - n
            assert s.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(s.logprobs, s.tokens[n:], strict=True)))
        assert [s.cum_logprob for s in out.sequences] == sorted((s.cum_logprob for s in out.sequences), reverse=True)
    one = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS))
    for g, b in zip(greedy, one, strict=True):
        assert b.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert b.sequences[0].text == g.outputs[0].text
    assert all(g.num_free_blocks == g.num_blocks for g in llm.stats().groups)  # nothing leaked


def test_use_beam_search_over_http_returns_the_beams(llm):
    settings = llm.settings.model_copy(update={"host": "127.0.0.1", "port": 0})
    gateway = GatewayService(settings, llm.model_info)
    llm._services.run(gateway.start())
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model=llm.model_info.name, prompt=PROMPTS[0], n=3, max_tokens=8,
                                      temperature=0, extra_body={"use_beam_search": True, "length_penalty": 0.0})
        offline = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.0))
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.text for c in r.choices] == [s.text for s in offline[0].sequences]
        assert len({c.text for c in r.choices}) == 3
        chat = client.chat.completions.create(model=llm.model_info.name, n=2, max_tokens=6,
                                              messages=[{"role": "user", "content": "Name a color."}],
                                              extra_body={"use_beam_search": True})
        assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=llm.model_info.name, prompt="x", n=2, stream=True,
                                      extra_body={"use_beam_search": True})
        assert "use_beam_search" in str(exc.value)
    finally:
        llm._services.run(gateway.stop())


def test_bad_beam_search_params_are_refused_by_name(llm):
    for kwargs, name in (({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                         ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                         ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
                         ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature")):
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("x", SamplingParams(n=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(n=2, use_beam_search=True, top_p=0.5)
