"""A GGUF file served directly (``LLM(model="...gguf")``, its Q4_1 / Q8_0 matrices kept
quantized): greedy token ids equal Hugging Face's for the same GGUF, in float32.

The reference is the ``smollm2_path`` directory: transformers' own dequantization of this file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, saved in float32 by
``convert_default_model``), the same weights as loading the GGUF again (which takes ~24 s)."""

from __future__ import annotations

import torch
from gguf_files import TINY_FORMATS, TINY_LAYER0_V, tiny_hf_config, write_tiny_gguf
from greedy import hf_greedy
from processes import start_serve, stop_all
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from services.executor.layers.quantization.gguf import GGUFLinearMethod, GGUFShardedLinearMethod
from services.executor.model_loader import quantization_config
from services.executor.models import get_model_class
from shared.config import kernel_cache_dir
from shared.model_source import _gguf_path

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village near the"]


def test_bundled_gguf_served_directly_matches_hugging_face(smollm2_path):
    gguf = _gguf_path()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(gguf), dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        assert llm.model_info.name == gguf.stem
        served = llm.model_info.path
        assert (served / "model.gguf").resolve() == gguf.resolve() and not list(served.glob("*.safetensors"))
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    tok = AutoTokenizer.from_pretrained(served)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ref = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")
            gen = model.generate(**ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
            ref.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    assert ours == ref


def test_k_quant_gguf_served_directly_gives_the_tokens_of_its_dequantized_weights(tmp_path, smollm2_path):
    """A tiny Llama GGUF written by our own packer with Q4_K, Q5_K and Q6_K matrices (q/k rows in
    llama.cpp's order, layer 0's v in another format than its q and k, SmolLM2's tokenizer cut to
    1,024 tokens): every matrix stays in its blocks, and greedy tokens
    through ``LLM.generate`` equal Hugging Face's Llama on the same weights dequantized to float32
    by ``gguf.quants``."""
    path = tmp_path / "tiny-kq.gguf"
    state = write_tiny_gguf(path, smollm2_path)
    (tmp_path / "cache").mkdir()  # the served directory goes with tmp_path; the kernels are the ones built
    (tmp_path / "cache" / "kernels").symlink_to(kernel_cache_dir(), target_is_directory=True)
    prompts = [[1, 2, 3, 400, 500, 700], [900, 17, 31], list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, cache_dir=str(tmp_path / "cache")) as llm:
        served = llm.model_info.path
        ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    config = tiny_hf_config(state["model.embed_tokens.weight"].shape[0])
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(state)
    ref = [hf_greedy(hf, p, 8)[0] for p in prompts]
    assert ours == ref
    assert len({tuple(t) for t in ref}) > 1

    config = AutoConfig.from_pretrained(served)  # the served directory's config, as the executor reads it
    model = get_model_class(config)(config, torch.float32, torch.device("cpu"),
                                     quant_config=quantization_config(served, config))
    model.load_weights(served)
    layer = model.model.layers[1]
    kept = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "embed": model.model.embed_tokens}
    assert all(isinstance(m.quant_method, GGUFLinearMethod) for m in kept.values())
    assert {k: m.quant_method.fmt for k, m in kept.items()} == {
        "qkv": TINY_FORMATS["attn_q"], "o": TINY_FORMATS["attn_output"], "gate_up": TINY_FORMATS["ffn_gate"],
        "down": TINY_FORMATS["ffn_down"], "embed": TINY_FORMATS["token_embd"]}
    mixed = model.model.layers[0].self_attn.qkv_proj  # q, k Q5_K and v Q6_K: each shard's blocks
    assert isinstance(mixed.quant_method, GGUFShardedLinearMethod)
    assert [p.fmt for p in mixed.quant_method.parts] == [TINY_FORMATS["attn_q"], TINY_FORMATS["attn_k"], TINY_LAYER0_V]


def test_serve_of_the_bundled_gguf_answers_a_chat_completion_with_the_openai_sdk(smollm2_path):
    """``pagedllm serve <the bundled .gguf>`` (Q4_1 kept quantized, float32 activations), asked
    through the ``openai`` SDK: greedy chat text equals Hugging Face's on the same file's weights
    (``smollm2_path``, see the module docstring) with the file's chat template."""
    from openai import OpenAI

    gguf = _gguf_path()
    proc, port, _ = start_serve(smollm2_path.parent, str(gguf), "--dtype", "float32",
                                "--kv-cache-memory-bytes", str(16 << 20), "--log-level", "WARNING")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(model=gguf.stem, messages=messages, temperature=0, max_tokens=10)
    finally:
        stop_all([proc])
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        gen = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    new = gen[0, ids["input_ids"].shape[1]:]
    assert reply.model == gguf.stem and reply.usage.completion_tokens == len(new)
    assert reply.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
