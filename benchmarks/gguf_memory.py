"""A GGUF file served with its weights kept quantized, against its bf16 conversion: the weights'
resident bytes and single-stream decode speed, in one run.

    .venv/bin/python benchmarks/gguf_memory.py [GGUF] [--output-len 64] [--repeats 2]

``GGUF`` defaults to the bundled SmolLM2-135M-Instruct Q4_1 file, its bf16 counterpart to the
converted default model (the same weights, dequantized). Memory: each model built as the
executor builds it (bf16, native CPU kernels allowed) and loaded; the bytes of every tensor
its modules hold (parameters and derived forms such as the GEMM panels, each storage counted
once; no KV cache) and the process's RSS growth over the load. The GGUF model is loaded
first, so the bf16 load cannot reuse memory the GGUF one freed. Goal: the GGUF weights at
most 0.35x the bf16 ones. Speed: ``LLM`` on each model, one greedy request at a time
(``ignore_eos``), decode tokens/s with the time to the first token excluded.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoConfig  # noqa: E402

from services.executor.layers.selection import restore_weights  # noqa: E402
from services.executor.model_loader import quantization_config  # noqa: E402
from services.executor.models import get_model_class  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.model_source import _gguf_path, load_model_info  # noqa: E402

PROMPT = "Tell me about the history of Paris."


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every tensor the modules hold, of them the quantized GGUF blocks), each storage once."""
    seen: dict[int, tuple[int, bool]] = {}
    for module in model.modules():
        tensors = [*module._parameters.values(), *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = (storage.nbytes(), t.dtype == torch.uint8)
    return sum(n for n, _ in seen.values()), sum(n for n, q in seen.values() if q)


def load(path: Path) -> tuple[torch.nn.Module, int]:
    """The model of ``path`` as the executor builds it (bf16, native kernels), and the RSS growth of its load."""
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu", native_cpu_kernels=True,
                                     quant_config=quantization_config(path, config))
    model.load_weights(path)
    gc.collect()
    return model, psutil.Process().memory_info().rss - rss0


def decode_speed(model: str, output_len: int, repeats: int) -> float:
    """Best decode tokens/s of ``repeats`` single greedy requests through ``LLM``."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    best = 0.0
    with LLM(model=model, dtype="bfloat16") as llm:
        llm.generate("warm-up", SamplingParams(max_tokens=4), use_tqdm=False)

        async def one() -> tuple[float, int]:
            rid = f"gguf-{time.monotonic_ns()}"
            await llm._client.submit(rid, prompt=PROMPT, sampling_params=params)
            first, n = None, 0
            async for delta in llm._client.stream(rid):
                n += len(delta.token_ids)
                if first is None and delta.token_ids:
                    first = time.perf_counter()
            return time.perf_counter() - first, n

        for _ in range(repeats):
            seconds, n = llm._services.run(one())
            best = max(best, (n - 1) / seconds)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?", default=None)
    p.add_argument("--bf16-model", default=None, help="the bf16 Hugging Face directory (default: the converted default)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    gguf = Path(args.gguf) if args.gguf else _gguf_path()
    gguf_dir = load_model_info(Settings(model=str(gguf))).path
    bf16_dir = load_model_info(Settings(model=args.bf16_model)).path

    q_model, q_rss = load(gguf_dir)
    q_bytes, q_blocks = weight_bytes(q_model)
    del q_model
    b_model, b_rss = load(bf16_dir)
    b_bytes, _ = weight_bytes(b_model)
    restore_weights(b_model)  # the parameters hold their values again (panels unpacked)
    b_params = 2 * sum(t.numel() for t in {id(t): t for t in b_model.parameters()}.values())  # bf16, tied once
    del b_model
    gc.collect()
    print(f"bf16 params   {b_params / 2**20:8.1f} MiB (2 bytes per parameter; GGUF / this: {q_bytes / b_params:.3f}x)")
    print(f"bf16 weights  {b_bytes / 2**20:8.1f} MiB held (with the derived forms), RSS +{b_rss / 2**20:.1f} MiB over the load")
    print(f"GGUF weights  {q_bytes / 2**20:8.1f} MiB held ({q_blocks / 2**20:.1f} MiB of GGUF blocks), "
          f"RSS +{q_rss / 2**20:.1f} MiB over the load")
    print(f"ratio         {q_bytes / b_bytes:.3f}x held, {q_rss / b_rss:.3f}x RSS  (goal <= 0.35x)")
    b_speed = decode_speed(str(bf16_dir), args.output_len, args.repeats)
    q_speed = decode_speed(str(gguf), args.output_len, args.repeats)
    print(f"decode        bf16 {b_speed:.1f} tokens/s, GGUF {q_speed:.1f} tokens/s ({q_speed / b_speed:.2f}x), "
          f"{args.output_len} tokens, single stream, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
