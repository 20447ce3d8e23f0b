"""A GGUF file served directly (``LLM(model="...gguf")``, its Q4_1 / Q8_0 matrices kept
quantized): greedy token ids equal Hugging Face's for the same GGUF, in float32.

The reference is the ``smollm2_path`` directory: transformers' own dequantization of this file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, saved in float32 by
``convert_default_model``), the same weights as loading the GGUF again (which takes ~24 s)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm import LLM, SamplingParams
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
