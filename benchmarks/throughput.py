"""Offline generation throughput: pagedllm ``LLM.generate`` against Hugging Face
``generate`` on the same prompts, in the same run.

    .venv/bin/python benchmarks/throughput.py [--num-prompts 64] [--output-len 64] [--dtype bfloat16]
        [--tensor-parallel-size N]

Prints generated tokens/s for both (greedy, ``ignore_eos``: every request makes exactly
``--output-len`` tokens), plus the ratio. With ``--tensor-parallel-size N`` pagedllm runs
again on N ranks (one process each), against its single rank of the same run;
``benchmarks/tp_collectives.py`` says how much of a step the collectives take.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, ahead of benchmarks/

WORDS = (
    "the quick brown fox jumps over a lazy dog while engineers measure paged attention kernels "
    "on small machines and large clusters of accelerators every single day"
).split()


def make_prompts(n: int, min_words: int, max_words: int, seed: int, prefix_words: int = 0) -> list[str]:
    """``n`` prompts of random lengths; with ``prefix_words`` they all start with one long
    common prefix (the shared-prefix workload: a system prompt or few-shot examples)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]
    return [f"{prefix} {p}" if prefix else p for p in prompts]


def bench_pagedllm(
    args, prompts: list[str], enable_prefix_caching: bool = True, native_cpu_kernels: bool = True,
    tensor_parallel_size: int = 1,
) -> tuple[float, int]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1),
              enable_prefix_caching=enable_prefix_caching, native_cpu_kernels=native_cpu_kernels,
              tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(**{"temperature": 0, "max_tokens": args.output_len, "ignore_eos": True,
                               **json.loads(args.params)})
    warm = ["warm-up prompt one", "warm-up prompt two"]  # shares nothing with the workload
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    llm.close()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_hf(args, prompts: list[str], hf_dtype: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.config import Settings
    from shared.model_source import load_model_info

    path = load_model_info(Settings(model=args.model)).path
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[hf_dtype]
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    total, elapsed = 0, 0.0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = tok(prompts[i : i + args.hf_batch_size], return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )
        elapsed += time.perf_counter() - t0
        total += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return elapsed, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-words", type=int, default=20)
    p.add_argument("--max-words", type=int, default=60)
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-dtypes", default=None,
                   help="comma-separated dtypes to run Hugging Face in (default: --dtype); e.g. bfloat16,float32 "
                        "on a CPU where torch emulates bf16 and HF is faster in float32")
    p.add_argument("--prefix-words", type=int, default=0,
                   help="shared-prefix workload: every prompt starts with this many common words")
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="also run pagedllm with enable_prefix_caching=False")
    p.add_argument("--compare-native-cpu-kernels", action="store_true",
                   help="also run pagedllm with native_cpu_kernels=False (torch-only decode attention)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="also run pagedllm on this many tensor-parallel ranks (against one rank, same run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", default="{}",
                   help='more SamplingParams of pagedllm\'s requests, as JSON: e.g. \'{"logprobs": 5}\' or '
                        '\'{"repetition_penalty": 1.2}\' (what they cost; HF runs without them)')
    args = p.parse_args()
    prompts = make_prompts(args.num_prompts, args.min_words, args.max_words, args.seed, args.prefix_words)
    print(f"# {args.num_prompts} prompts ({args.min_words}-{args.max_words} random words"
          f"{f' after a {args.prefix_words}-word shared prefix' if args.prefix_words else ''}) x "
          f"{args.output_len} generated tokens, dtype={args.dtype}, torch threads={torch.get_num_threads()}"
          f"{f', pagedllm with {args.params}' if json.loads(args.params) else ''}")
    from kernels.cpu import ops

    ours = ("kernels/cpu/csrc/cpu_gemm_bf16.c, " + ("AVX512-BF16 tiles" if ops.hardware_bf16_gemm() else "FMA tiles")
            if ops.prefer_native_gemm() else "oneDNN")
    print(f"# CPU: {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16: {ops.native_bf16_matmul()} "
          f"(False: HF's bf16 is emulated); pagedllm's bf16 matmuls: {ours}")
    t, n = bench_pagedllm(args, prompts)
    print(f"pagedllm  LLM.generate: {n} tokens in {t:.2f} s = {n / t:.1f} generated tokens/s"
          " (prefix caching on)")
    if args.compare_prefix_caching:
        t_off, n_off = bench_pagedllm(args, prompts, enable_prefix_caching=False)
        print(f"pagedllm  LLM.generate: {n_off} tokens in {t_off:.2f} s = {n_off / t_off:.1f} generated "
              f"tokens/s (prefix caching off); on/off = {(n / t) / (n_off / t_off):.2f}x")
    if args.tensor_parallel_size > 1:
        tp = args.tensor_parallel_size
        t_tp, n_tp = bench_pagedllm(args, prompts, tensor_parallel_size=tp)
        print(f"pagedllm  LLM.generate: {n_tp} tokens in {t_tp:.2f} s = {n_tp / t_tp:.1f} generated "
              f"tokens/s (tensor_parallel_size={tp}); TP={tp} / TP=1 = {(n_tp / t_tp) / (n / t):.2f}x")
    if args.compare_native_cpu_kernels:
        t_tc, n_tc = bench_pagedllm(args, prompts, native_cpu_kernels=False)
        print(f"pagedllm  LLM.generate: {n_tc} tokens in {t_tc:.2f} s = {n_tc / t_tc:.1f} generated "
              f"tokens/s (native CPU kernels off); on/off = {(n / t) / (n_tc / t_tc):.2f}x")
    for hf_dtype in [] if args.skip_hf else (args.hf_dtypes or args.dtype).split(","):
        th, nh = bench_hf(args, prompts, hf_dtype)
        print(f"HF        generate    : {nh} tokens in {th:.2f} s = {nh / th:.1f} generated tokens/s "
              f"(batch {args.hf_batch_size}, {hf_dtype})")
        print(f"ratio pagedllm / HF   : {(n / t) / (nh / th):.2f}x ({args.dtype} / {hf_dtype})")


if __name__ == "__main__":
    main()
