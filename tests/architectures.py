"""Helpers for the per-architecture parity tests (``tests/executor/test_arch_*.py`` and
``tests/e2e/test_architectures_e2e.py``): a tiny random-weight checkpoint from a
``transformers`` config, and greedy parity with Hugging Face ``generate`` in float32, through
the model alone (paged cache, continuous batching, chunked prefill) and through ``LLM``
(every service, 8 prompts together, chunked prefill and preemption in a tiny pool).

Tiny models use token ids below ``VOCAB`` (512) and SmolLM2's tokenizer files (copied beside
the checkpoint), so ``LLM`` can decode what they generate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from greedy import hf_greedy, paged_greedy
from transformers import AutoModelForCausalLM

from services.executor.models import get_model_class

VOCAB = 512
#: 8 prompts of different lengths (3 to 70 tokens: longer than a 32-token sliding window)
PROMPTS = [[(7 * i + 13 * j) % 509 + 2 for j in range(n)] for i, n in enumerate((3, 9, 17, 70, 5, 33, 12, 48))]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def tiny_checkpoint(config, path: Path, smollm2_path: Path | None = None, bias_std: float = 0.5,
                    seed: int = 0) -> torch.nn.Module:
    """Build Hugging Face's model for ``config`` with random weights (biases and norm weights
    randomised too: HF initialises them to 0 and 1), save it in ``path`` (safetensors) with
    SmolLM2's tokenizer files when ``smollm2_path`` is given, and return it (float32, eval).

    ``config`` should set ``initializer_range`` around 0.1-0.2 so that greedy tokens vary
    from step to step (HF's default 0.02 makes a tiny model repeat one token)."""
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, bias_std)
            elif "norm" in name or (name.split(".")[-2:-1] or [""])[0].startswith("ln"):  # GPT-2's ln_1, ln_f
                param.normal_(1.0, 0.2)
    hf_model.save_pretrained(path)
    if smollm2_path is not None:
        for file in TOKENIZER_FILES:
            if (smollm2_path / file).exists():
                shutil.copy(smollm2_path / file, path / file)
    return hf_model


def ours(config, path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Our model for ``config`` (``get_model_class``), loaded from ``path``."""
    model = get_model_class(config)(config, dtype, torch.device("cpu"))
    model.load_weights(path)
    return model


def assert_model_parity(config, path: Path, prompts: list[list[int]] = PROMPTS, max_new: int = 8,
                        atol: float = 1e-4) -> None:
    """Our model's greedy tokens equal HF's for every prompt, all prompts batched together,
    with whole prefills and with 5-token chunks (block sizes 16 and 8), and its prompt logits
    are within ``atol``."""
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = ours(config, path)
    refs = [hf_greedy(hf_model, prompt, max_new) for prompt in prompts]
    for block_size, chunk in ((16, None), (8, 5)):
        new, logits = paged_greedy(model, prompts, max_new, block_size=block_size, chunk=chunk, seed=block_size)
        for prompt, ours_new, ours_logits, (ref_new, ref_logits) in zip(prompts, new, logits, refs, strict=True):
            torch.testing.assert_close(ours_logits, ref_logits, atol=atol, rtol=atol)
            assert ours_new == ref_new, (block_size, chunk, prompt)
    assert len({tuple(ref) for ref, _ in refs}) > 1, "every prompt gives the same tokens: widen the random init"


def hf_tokens(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF ``generate(do_sample=False)``'s new tokens for each prompt, alone (no padding)."""
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(hf_model, prompt, max_new)[0] for prompt in prompts]


def llm_tokens(path: Path, prompts: list[list[int]], max_new: int, **llm_kwargs) -> tuple[list[list[int]], object]:
    """``LLM.generate``'s greedy tokens for the prompts submitted together (float32, EOS
    ignored), and the engine's statistics at the end (every block must be free)."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", **llm_kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
    assert all(g.num_free_blocks == g.num_blocks for g in stats.groups), "blocks left in use"
    return [o.outputs[0].token_ids for o in outs], stats
