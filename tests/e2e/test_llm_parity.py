"""Greedy parity: ``LLM.generate`` token ids equal Hugging Face ``generate(do_sample=False)``
in float32, for prompts of different lengths generated together (one continuous batch)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three colors: red,",
    "Once upon a time, in a small village near the mountains, there lived an old",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Translate to French: 'Good morning, how are you today?' ->",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. Photosynthesis in plants generally "
    "involves the green pigment chlorophyll and generates oxygen as a byproduct. In summary,",
    "Q: What is 12 times 12?\nA:",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hf_load(path: Path) -> tuple:
    """Hugging Face's tokenizer and float32 model of ``path`` (eval mode)."""
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path | tuple, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """HF ``generate`` greedy, exactly ``max_new_tokens`` new tokens (EOS suppressed until then) per
    prompt; ``path`` is a model directory or :func:`hf_load`'s ``(tokenizer, model)``."""
    tok, model = hf_load(path) if isinstance(path, Path) else path
    out = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding effects in the reference
            ids = tok(p, return_tensors="pt")
            gen = model.generate(
                **ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    return out


def pagedllm_greedy(path: Path, prompts: list[str], max_new_tokens: int, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=64 << 20, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)  # nothing leaked
    assert [o.prompt for o in outs] == prompts
    return [o.outputs[0].token_ids for o in outs]


def tiny_model(tmp_path: Path, smollm2_path: Path, config) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    for name in TOKENIZER_FILES:  # a real tokenizer so text prompts work end to end
        if (smollm2_path / name).exists():
            shutil.copy(smollm2_path / name, tmp_path / name)
    return tmp_path


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path) -> tuple:
    """HF's tokenizer and float32 SmolLM2, loaded once for this module's references."""
    return hf_load(smollm2_path)


@pytest.fixture(scope="module")
def hf_smollm2_greedy(hf_smollm2) -> list[list[int]]:
    """HF's 24 greedy tokens for each of ``PROMPTS`` (computed once: 216 decode steps). EOS is
    suppressed up to the last, so the first ``n`` of them are HF's answer for ``max_new_tokens=n``."""
    return hf_greedy(hf_smollm2, PROMPTS, 24)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    """One float32 SmolLM2 engine (64 MiB of KV cache) for this module's tests that only
    generate with it; none leaks a KV block (checked at the end)."""
    with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        yield llm
        assert all(g.num_free_blocks == g.num_blocks for g in llm.stats().groups)


def test_smollm2_greedy_parity(smollm2_llm, hf_smollm2_greedy):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(g.num_free_blocks == g.num_blocks for g in smollm2_llm.stats().groups)  # nothing leaked
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outs] == hf_smollm2_greedy


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            Qwen2Config(
                vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, rope_theta=10000.0, architectures=["Qwen2ForCausalLM"],
            ),
            id="qwen2-qkv-bias",
        ),
        pytest.param(
            LlamaConfig(
                vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                rope_parameters={
                    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                },
            ),
            id="llama-gqa-llama3-rope",
        ),
    ],
)
def test_tiny_random_model_greedy_parity(tmp_path, smollm2_path, config):
    path = tiny_model(tmp_path, smollm2_path, config)
    # a small token budget forces chunked prefill of the long prompt alongside decodes
    ours = pagedllm_greedy(path, PROMPTS, 16, max_num_batched_tokens=48, block_size=16)
    ref = hf_greedy(path, PROMPTS, 16)
    assert ours == ref


def test_gpu_engine_check_script_runs_on_cpu(smollm2_path):
    """benchmarks/gpu_engine_check.py (run on a lent GPU by benchmarks/gpu_check.sh) works: its
    dry run on the CPU compares the engine with Hugging Face and passes."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_engine_check.py"), "--tokenizer", str(smollm2_path),
         "--device", "cpu", "--backends", "torch", "--max-new-tokens", "8", "--tensor-parallel-size", "2"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("float32 cpu attention_backend=torch (") and " 6/6 prompts " in line for line in lines)
    assert any(line.startswith("float32 cpu attention_backend=torch tensor_parallel_size=2")
               and " 6/6 prompts " in line for line in lines)
    assert any(line.startswith("bfloat16 cpu torch: 64 prompts x 64 tokens: 4096 tokens") for line in lines)
    assert lines[-1] == "engine check: PASS", proc.stdout[-2000:]


def test_smollm2_logprobs_match_hugging_face(smollm2_llm, hf_smollm2):
    """``logprobs`` equal the log-softmax of Hugging Face's float32 logits at each generated
    token: greedy requests of different lengths batched with a sampled ``n=2`` request (its
    second sample forked from the first's prefill). Each position's dict holds the sampled
    token first, then the other most likely tokens in order, with HF's ranks and token texts.
    The distribution is the raw one, before the sampled request's temperature."""
    tok, model = hf_smollm2
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    sampled = SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = PROMPTS[:4]
    outs = smollm2_llm.generate(prompts + [PROMPTS[1]], [greedy] * len(prompts) + [sampled], use_tqdm=False)
    checked = 0
    for out, params in zip(outs, [greedy] * len(prompts) + [sampled], strict=True):
        assert len(out.outputs) == params.n
        for comp in out.outputs:
            assert len(comp.logprobs) == len(comp.token_ids) == 8
            assert comp.cumulative_logprob == pytest.approx(
                sum(d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids, strict=True)))
            ids = torch.tensor([out.prompt_token_ids + comp.token_ids])
            with torch.inference_mode():
                ref = model(ids).logits[0, len(out.prompt_token_ids) - 1:-1].float().log_softmax(-1)  # [8, V]
            for pos, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
                row = ref[pos]
                first_id, first = next(iter(entry.items()))
                assert first_id == token  # the sampled token comes first
                assert first.logprob == pytest.approx(row[token].item(), abs=2e-4)
                assert first.rank == int((row >= row[token]).sum())
                assert first.decoded_token == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(token)])
                top = row.topk(params.logprobs)
                expected = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                assert list(entry)[1:] == [t for t in expected if t != token]  # then the most likely, in order
                for rank, t in enumerate(expected, start=1):
                    assert entry[t].logprob == pytest.approx(expected[t], abs=2e-4) and entry[t].rank == rank
                if params.temperature == 0:
                    assert first.rank == 1
                checked += 1
    assert checked == 8 * (len(prompts) + 2)
    assert outs[-1].outputs[0].token_ids != outs[-1].outputs[1].token_ids  # two different samples


def test_smollm2_repetition_penalty_matches_hugging_face(smollm2_llm, hf_smollm2, hf_smollm2_greedy):
    """Greedy decoding with ``repetition_penalty`` 1.3 (CTRL's rule over the prompt and the
    output, in vLLM and in HF's RepetitionPenaltyLogitsProcessor) gives HF's tokens, batched;
    without the penalty the tokens differ (the test would notice a penalty not applied)."""
    prompts = PROMPTS[:3] + PROMPTS[5:6]
    tok, model = hf_smollm2
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt")
            gen = model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                                 repetition_penalty=1.3)
            ref.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    ours = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    assert ours == ref
    assert ref != [hf_smollm2_greedy[PROMPTS.index(p)][:16] for p in prompts]  # HF's 16 without the penalty


def test_smollm2_min_tokens_matches_hugging_face_min_new_tokens(smollm2_llm, hf_smollm2):
    """A chat answer that ends (EOS) after 26 tokens goes on to HF's ``min_new_tokens`` tokens
    with ``min_tokens`` 30: the same greedy tokens, then its own EOS."""
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    tok, model = hf_smollm2
    with torch.inference_mode():
        ids = tok(prompt, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=60, min_new_tokens=30, do_sample=False, pad_token_id=0)
    ref = gen[0, ids["input_ids"].shape[1]:].tolist()
    free, held = smollm2_llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=60),
                                                     SamplingParams(temperature=0, max_tokens=60, min_tokens=30)],
                                      use_tqdm=False)
    assert len(free.outputs[0].token_ids) < 30 and free.outputs[0].finish_reason == "stop"
    assert held.outputs[0].token_ids == ref[: len(held.outputs[0].token_ids)]
    assert 30 < len(held.outputs[0].token_ids) and held.outputs[0].finish_reason == "stop"


def test_smollm2_prompt_logprobs_match_hugging_face(smollm2_path, hf_smollm2):
    """``prompt_logprobs`` equal the log-softmax of HF's float32 logits at every prompt token
    after the first (None), with the prompt prefilled in chunks (a 16-token budget) and asked
    twice: the second time its blocks are in the prefix cache, which a request with
    prompt_logprobs does not use (those positions must be computed). An n=2 request has
    them once, for its prompt."""
    tok, model = hf_smollm2
    prompt = PROMPTS[7]  # 44 tokens: 3 chunks
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=64 << 20,
             max_num_batched_tokens=16) as llm:
        first_params = SamplingParams(temperature=0, max_tokens=2)
        first = llm.generate([prompt], first_params, use_tqdm=False)[0]
        assert first.prompt_logprobs is None
        again, forked, plain = llm.generate(
            [prompt, PROMPTS[1], prompt], [params, params.replace(n=2), first_params], use_tqdm=False)
    for out in (again, forked):
        ids = out.prompt_token_ids
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)  # [P - 1, V]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            token, row = ids[p + 1], ref[p]
            assert next(iter(entry)) == token
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-4)
            assert entry[token].rank == int((row >= row[token]).sum())
            assert entry[token].decoded_token == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(token)])
            top = row.topk(3).indices.tolist()
            assert list(entry)[1:] == [t for t in top if t != token]
    assert again.num_cached_tokens == 0 and plain.num_cached_tokens >= 32  # the cache was there to use
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and plain.prompt_logprobs is None
    assert len(again.prompt_token_ids) > 32 and len(forked.outputs) == 2
