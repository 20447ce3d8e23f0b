"""Greedy generation helpers shared by the model tests: ours over a paged KV cache with
continuous batching (no services; each step's forward pass run as the model runner runs it,
``services/executor/forward_pass.py``), and Hugging Face's ``generate``."""

from __future__ import annotations

import random

import torch

from services.executor.attention import AttentionMetadata
from services.executor.forward_pass import ForwardPass
from services.executor.models import kv_cache_shape


def paged_greedy(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    chunk: int | None = None,
    seed: int = 0,
    forward: ForwardPass | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation with continuous batching over a paged cache.

    Every step puts all sequences in one flat batch: prompts (in chunks of ``chunk`` tokens when
    given, so chunks with cached context mix with decodes), then one token per sequence.
    Blocks come from a shuffled free list. Each step runs through ``forward`` (default: a new
    ``ForwardPass(model)``; pass one to look at its choices afterwards). Returns the new tokens
    of each prompt and the float32 logits ``[len(prompt), vocab]`` of every prompt position.
    """
    if forward is None:
        forward = ForwardPass(model)
    cfg = model.hf_config
    # a short prompt keeps decoding while a long one is prefilled in chunks: room for that too
    longest = max(map(len, prompts))
    num_blocks = sum(-(-(len(p) + max_new_tokens + longest) // block_size) for p in prompts) + 5
    shape = kv_cache_shape(cfg, num_blocks, block_size, model.num_kv_heads_per_rank)
    caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
              for _ in range(cfg.num_hidden_layers)]
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    blocks: list[list[int]] = [[] for _ in prompts]
    prompt_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        while min(len(t) - len(p) for t, p in zip(tokens, prompts, strict=True)) < max_new_tokens:
            query_lens, seq_lens, ids, positions = [], [], [], []
            for i, toks in enumerate(tokens):
                n = len(toks) - computed[i]
                if chunk is not None:
                    n = min(n, chunk)
                while len(blocks[i]) * block_size < computed[i] + n:
                    blocks[i].append(free.pop())
                ids += toks[computed[i] : computed[i] + n]
                positions += range(computed[i], computed[i] + n)
                query_lens.append(n)
                seq_lens.append(computed[i] + n)
            meta = AttentionMetadata.build(query_lens, seq_lens, blocks, block_size,
                                           num_prompt_tokens=[len(p) for p in prompts])
            hidden = forward(torch.tensor(ids), torch.tensor(positions), caches, meta)  # [T, hidden]
            start = 0
            for i, n in enumerate(query_lens):
                rows = hidden[start : start + n]
                start += n
                n_prompt = max(0, min(len(prompts[i]) - computed[i], n))
                if n_prompt:
                    prompt_logits[i].append(model.compute_logits(rows[:n_prompt]))
                computed[i] += n
                if computed[i] == len(tokens[i]):
                    tokens[i].append(int(model.compute_logits(rows[-1:]).argmax(-1)))
    new = [t[len(p) : len(p) + max_new_tokens] for t, p in zip(tokens, prompts, strict=True)]
    return new, [torch.cat(parts) for parts in prompt_logits]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF ``generate(do_sample=False)`` new tokens and the prompt logits ``[len(prompt), vocab]``."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0].float()
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist(), logits


