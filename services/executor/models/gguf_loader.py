"""A Llama-architecture GGUF file -> a :class:`~services.executor.models.llama.LlamaForCausalLM`'s
parameters, its Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices kept quantized (``layers/gguf.py``).

GGUF names (llama.cpp's ``gguf-py`` tensor map) -> ours, per decoder layer ``N``:

- ``blk.N.attn_q`` | ``attn_k`` | ``attn_v`` -> ``self_attn.qkv_proj`` (rows q | k | v),
  ``attn_output`` -> ``self_attn.o_proj``, ``ffn_gate`` | ``ffn_up`` -> ``mlp.gate_up_proj``,
  ``ffn_down`` -> ``mlp.down_proj``, ``attn_norm`` / ``ffn_norm`` -> ``input_layernorm`` /
  ``post_attention_layernorm``;
- ``token_embd`` -> ``embed_tokens``, ``output_norm`` -> ``norm``, ``output`` -> ``lm_head``
  (absent when the embeddings are tied).

llama.cpp's converter permutes the rows of q and k for its RoPE (pairs of a head's rows
interleaved: HF row ``h * D + j * D/2 + i`` is stored at ``h * D + 2 i + j``); the rows are put
back here as transformers' ``LlamaTensorProcessor`` does. Rows are whole runs of blocks, so the
quantized blocks are moved without dequantizing. A merged layer whose shards are all of one
kept format keeps its blocks (``GGUFLinearMethod``), one whose shards are of several kept
formats keeps each shard's (``GGUFShardedLinearMethod``: llama.cpp's Q4_K_M mixes Q4_K and
Q6_K in q | k | v); any other (F32, F16, BF16, other quantizations) is dequantized by
``gguf.quants`` into the model's dtype and loaded as usual.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from kernels.cpu import ops
from services.executor.layers.gguf import FORMATS, GGUFLinearMethod, GGUFShardedLinearMethod

# our module (under model.layers.N) -> its GGUF tensors (under blk.N), in merged row order
LAYER_TENSORS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
    "input_layernorm": ("attn_norm",),
    "post_attention_layernorm": ("ffn_norm",),
}
MODEL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
IGNORED = ("rope_freqs.weight",)  # llama.cpp's RoPE scaling factors: our config carries the RoPE


def gguf_file(model_dir: Path | str) -> Path | None:
    """The GGUF file a model directory is served from (``model_source.prepare_gguf_model``
    links it as ``model.gguf``), or ``None``."""
    path = Path(model_dir) / "model.gguf"
    return path if path.exists() else None


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:  # [H D, ...] -> [H D, ...]
    """Undo llama.cpp's q/k row permutation: ``[H, 2, D/2]`` rows were stored as ``[H, D/2, 2]``."""
    d = rows.shape[0] // num_heads
    return rows.reshape(num_heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _raw(tensor) -> torch.Tensor:  # a GGUFReader tensor's bytes / values, copied out of the memory map
    return torch.from_numpy(np.array(tensor.data, copy=True))


def _dequantized(tensor) -> torch.Tensor:  # [rows, cols] float32
    from gguf import quants

    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), copy=True)).reshape(shape)


@torch.no_grad()
def load_gguf_weights(model: nn.Module, path: Path, native: bool) -> None:
    """Load ``model``'s parameters from the GGUF file at ``path``; ``native``: the kept
    formats' matmuls may run in the C kernel (``GGUFLinearMethod``).

    Raises:
        ValueError: a tensor is missing or has the wrong shape, the file holds tensors this
            architecture does not know, or the model is split over tensor-parallel ranks.
    """
    from gguf import GGUFReader

    if model.tp_size > 1:
        raise ValueError("a GGUF model is served on one rank (tensor parallelism needs a Hugging Face directory)")
    native = native and ops.load() is not None
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    used: set[str] = set(IGNORED)
    attn = model.model.layers[0].self_attn
    permuted = {"attn_q": attn.num_heads, "attn_k": attn.num_kv_heads}

    def load(module: nn.Module, names: list[str], permute: dict[str, int]) -> None:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{path}: tensors missing: {missing}")
        used.update(names)
        parts = [tensors[n] for n in names]
        fmts = [FORMATS.get(int(t.tensor_type)) for t in parts]
        kept = None not in fmts and hasattr(module, "quant_method")
        rows = [_raw(t) if kept else _dequantized(t) for t in parts]  # whole rows of each shard
        rows = [unpermute_rows(r, permute[n.split(".")[-2]]) if n.split(".")[-2] in permute else r
                for r, n in zip(rows, names, strict=True)]
        expected = tuple(module.weight.shape)
        if sum(r.shape[0] for r in rows) != expected[0] or (not kept and tuple(torch.cat(rows).shape) != expected):
            raise ValueError(f"{names}: GGUF shapes {[tuple(r.shape) for r in rows]} do not fit {expected}")
        if kept and len(set(fmts)) > 1:  # each shard's blocks apart
            GGUFShardedLinearMethod(fmts, model.dtype, native).install(module, rows, expected[1])
        elif kept:  # [rows, K / block_size * block_bytes] uint8
            GGUFLinearMethod(fmts[0], model.dtype, native).install(module, torch.cat(rows), expected[1])
        else:  # [rows, K] float32
            module.weight.data.copy_(torch.cat(rows))

    for i, layer in enumerate(model.model.layers):
        for attr, parts in LAYER_TENSORS.items():
            module = layer.get_submodule(attr)
            load(module, [f"blk.{i}.{p}.weight" for p in parts], permuted)
    for attr, name in MODEL_TENSORS.items():
        if attr == "lm_head" and model.tie_word_embeddings:
            continue
        load(model.get_submodule(attr), [f"{name}.weight"], {})
    if model.tie_word_embeddings:
        embed, head = model.model.embed_tokens, model.lm_head
        head.weight, head.quant_method = embed.weight, embed.quant_method
        if embed.quant_method.quantized:
            head.gguf_input_size = embed.gguf_input_size
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise ValueError(f"{len(unexpected)} unexpected tensors in {path}, e.g. {unexpected[:5]}")
