"""The Batch API against the offline engine, and interactive latency while a batch runs.

    .venv/bin/python benchmarks/batch_throughput.py [--requests 1000] [--max-tokens 32] [--dtype bfloat16]

In one run: ``LLM.chat`` of N chat requests (greedy, ``ignore_eos``) -> generated tokens/s;
then ``pagedllm serve`` (with its ``batch`` service): interactive streaming requests alone
(TTFT p50 / p90 of ``--probes`` requests, one at a time), the same N requests as one batch
through the official ``openai`` SDK (upload -> completed; generated tokens/s from the output
file's usage), and the interactive probes again while that batch runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

QUESTIONS = ["Write a short poem about the sea.", "Explain what a CPU does.", "List five fruits.",
             "Describe a sunny day.", "What is a paged KV cache?", "Tell me about the moon."]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}] for i in range(n)]


def offline(args) -> float:
    from pagedllm import LLM, SamplingParams

    extra = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    with LLM(dtype=args.dtype, **extra) as llm:
        llm.chat(conversations(2), SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.chat(conversations(args.requests),
                        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
        elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"LLM.chat          : {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} generated tokens/s")
    return tokens / elapsed


def ttft(url: str, model: str, probes: int) -> list[float]:
    out = []
    for i in range(probes):
        body = {"model": model, "messages": [{"role": "user", "content": f"Say something nice ({i})."}],
                "max_tokens": 8, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = (time.perf_counter() - t0) * 1e3
        out.append(first)
    return out


def describe(label: str, values: list[float]) -> str:
    values = sorted(values)
    return (f"{label}: TTFT p50 {statistics.median(values):.0f} ms, p90 "
            f"{values[int(0.9 * (len(values) - 1))]:.0f} ms over {len(values)} requests")


def main() -> None:
    import openai

    from shared.config import DEFAULT_MODEL_NAME
    from shared.nats_server import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="for both engines (default: each one's own: 8192 offline, 512 for serve on a CPU)")
    args = p.parse_args()
    rate_offline = offline(args)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    serve = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--dtype", args.dtype,
                              "--log-level", "WARNING", "--max-num-seqs", "256"]
                             + (["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                                if args.max_num_batched_tokens else []),
                             env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while "serving" not in serve.stdout.readline():
            if serve.poll() is not None:
                sys.exit("serve did not start")
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="none")
        ttft(url, DEFAULT_MODEL_NAME, 2)
        alone = ttft(url, DEFAULT_MODEL_NAME, args.probes)
        print(describe("interactive alone        ", alone))
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": DEFAULT_MODEL_NAME, "messages": m, "max_tokens": args.max_tokens,
                           "temperature": 0, "ignore_eos": True}}
                 for i, m in enumerate(conversations(args.requests))]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        t0 = time.perf_counter()
        file = client.files.create(file=("bench.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        during: list[float] = []
        probe = threading.Thread(target=lambda: (time.sleep(3), during.extend(ttft(url, DEFAULT_MODEL_NAME,
                                                                                     args.probes))))
        probe.start()
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.2)
        elapsed = time.perf_counter() - t0
        probe.join()
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
        rate = tokens / elapsed
        print(f"Batch API         : {batch.status}, {len(out)} lines, {tokens} tokens in {elapsed:.1f} s "
              f"(upload to completed) = {rate:.1f} generated tokens/s = {rate / rate_offline:.2f}x LLM.chat")
        print(describe("interactive with a batch ", during))
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(60)


if __name__ == "__main__":
    main()
