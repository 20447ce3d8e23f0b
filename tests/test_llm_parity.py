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


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
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


def test_smollm2_greedy_parity(smollm2_path):
    ours = pagedllm_greedy(smollm2_path, PROMPTS, 24)
    ref = hf_greedy(smollm2_path, PROMPTS, 24)
    assert ours == ref


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

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_engine_check.py"), "--tokenizer", str(smollm2_path),
         "--device", "cpu", "--backends", "torch", "--max-new-tokens", "8"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("float32 cpu attention_backend=torch") and " 6/6 prompts " in line for line in lines)
    assert any(line.startswith("bfloat16 cpu torch: 64 prompts x 64 tokens: 4096 tokens") for line in lines)
    assert lines[-1] == "engine check: PASS", proc.stdout[-2000:]
