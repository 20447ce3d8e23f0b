"""The whole engine on a CUDA GPU: ``LLM.generate`` greedy tokens against Hugging Face ``generate``.

    python3 benchmarks/gpu_engine_check.py --tokenizer DIR [--device cuda] [--backends triton,torch]

Builds a small random-weight Llama (GQA 8/2, head_dim 64, 4 layers, SmolLM2's vocabulary and
tokenizer from ``--tokenizer``), then for each attention backend runs ``LLM(device=...,
attention_backend=...)`` in float32 and compares its greedy tokens, prompt by prompt, with
Hugging Face ``generate(do_sample=False)`` on the same device (one prompt at a time, no
padding). A long prompt and a small ``max_num_batched_tokens`` force chunked prefill beside
decodes, as in ``tests/e2e/test_llm_parity.py``. Then a bfloat16 run of the first backend: its
agreement with Hugging Face in bfloat16 is printed (rounding may split near-ties) and 64
prompts x 64 tokens give a generated tokens/s figure. With ``--tensor-parallel-size N`` a
float32 run of the first backend on N ranks (NCCL on CUDA: one GPU per rank; gloo on the CPU)
is compared too. Exit status 1 when a float32 run disagrees or leaks KV blocks.

Part of ``benchmarks/gpu_check.sh``: the first CUDA run of the executor, its paged KV cache
on the GPU and the Triton kernels inside the model. On a machine without CUDA, ``--device cpu
--backends torch`` checks the script itself.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a small village near the mountains, there lived an old",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. Photosynthesis in plants generally "
    "involves the green pigment chlorophyll and generates oxygen as a byproduct. In summary,",
    "Q: What is 12 times 12?\nA:",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_model(tokenizer_dir: Path, out: Path) -> Path:
    """A random-weight Llama saved with ``save_pretrained`` plus the tokenizer files."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int, dtype: torch.dtype, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").to(device)
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    del model
    return out


def ours_greedy(path: Path, prompts: list[str], max_new_tokens: int, **settings) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether every KV block was free again at the end)."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    with LLM(model=str(path), **settings) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    return [o.outputs[0].token_ids for o in outs], all(g.num_free_blocks == g.num_blocks for g in stats.groups)


def compare(label: str, ours: list[list[int]], ref: list[list[int]]) -> int:
    """Print the agreement; return the number of prompts whose tokens differ."""
    bad = [i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b]
    print(f"{label}: {len(ref) - len(bad)}/{len(ref)} prompts token-for-token equal to Hugging Face", flush=True)
    for i in bad:
        first = next((j for j, (a, b) in enumerate(zip(ours[i], ref[i], strict=False)) if a != b), min(len(ours[i]), len(ref[i])))
        print(f"  prompt {i}: first difference at token {first}: ours {ours[i][first:first + 4]} "
              f"hf {ref[i][first:first + 4]}", flush=True)
    return len(bad)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory with SmolLM2's tokenizer files")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backends", default="triton,torch")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="also run the first backend on this many ranks (CUDA: needs as many GPUs)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu to check the script)")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.tokenizer, Path(tmp))
        ref = hf_greedy(path, PROMPTS, args.max_new_tokens, torch.float32, args.device)
        for backend in args.backends.split(","):
            t0 = time.perf_counter()
            ours, freed = ours_greedy(
                path, PROMPTS, args.max_new_tokens, dtype="float32", device=args.device,
                attention_backend=backend, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=48,
            )
            label = f"float32 {args.device} attention_backend={backend} ({time.perf_counter() - t0:.1f} s)"
            failures += compare(label, ours, ref) + (not freed)
            if not freed:
                print(f"  {label}: KV blocks still allocated after generate", flush=True)
        backend = args.backends.split(",")[0]
        if args.tensor_parallel_size > 1:
            t0 = time.perf_counter()
            ours, freed = ours_greedy(
                path, PROMPTS, args.max_new_tokens, dtype="float32", device=args.device, attention_backend=backend,
                kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=48,
                tensor_parallel_size=args.tensor_parallel_size,
            )
            label = (f"float32 {args.device} attention_backend={backend} tensor_parallel_size="
                     f"{args.tensor_parallel_size} ({time.perf_counter() - t0:.1f} s)")
            failures += compare(label, ours, ref) + (not freed)
        if not args.skip_bf16:
            ref16 = hf_greedy(path, PROMPTS, args.max_new_tokens, torch.bfloat16, args.device)
            ours16, _ = ours_greedy(path, PROMPTS, args.max_new_tokens, dtype="bfloat16", device=args.device,
                                    attention_backend=backend, kv_cache_memory_bytes=256 << 20)
            compare(f"bfloat16 {args.device} attention_backend={backend} (informational)", ours16, ref16)
            from pagedllm import LLM, SamplingParams

            prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
            with LLM(model=str(path), dtype="bfloat16", device=args.device, attention_backend=backend,
                     max_num_seqs=64, kv_cache_memory_bytes=1 << 30) as llm:
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                    use_tqdm=False)
                elapsed = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"bfloat16 {args.device} {backend}: 64 prompts x 64 tokens: {n} tokens in {elapsed:.2f} s = "
                  f"{n / elapsed:.0f} generated tokens/s (small random model: engine overhead dominates)", flush=True)
    print("engine check:", "PASS" if failures == 0 else f"FAIL ({failures})", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
